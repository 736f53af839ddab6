"""The family matrix: every model family of ``family_zoo.FAMILIES`` on tiny random-init configs (no hub).

Checks per family: load (per-head values exist right after from_pretrained/_from_config, set_attn_implementation
and hf_attnorm.apply, one per head the module really has), softmax equal to transformers' eager (and sdpa) with
padding, causality, cached generation equal to no-cache, cross-attention (seq2seq), sliding windows (sequences
longer than the window), a train step that reaches the learnable values, save and reload exact, and every
registered implementation running (or refused at load time with a message naming the keyword). Families that do
not use the attention interface are refused at load and set time.

Generic over the registry: the learnable implementations are every preset with a learnable per-head value, and the
"every implementation" check takes every preset. Set ``FAMILY_MATRIX_JSON=<file>`` to record the largest error of
each (family, check).
"""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
from conftest import LAST_CALL, needs_compile
from family_zoo import FAMILIES, REFUSED, build, inputs, make_config, output

import hf_attnorm
from hf_attnorm.attention import param_specs
from hf_attnorm.hf import forward
from hf_attnorm.hf.families import SELECTION_KEYWORDS, attention_modules, num_heads_of, rope_parameters
from hf_attnorm.hf.state import SCORE_KEYWORDS, AttnormState
from hf_attnorm.registry import NORMALIZERS, PRESETS, SCALES, AttnormError
from hf_attnorm.settings import resolve_settings

NAMES = list(FAMILIES)
CAUSAL = [n for n in NAMES if FAMILIES[n].kind == "causal"]
KEYWORD_FAMILIES = [n for n in NAMES if FAMILIES[n].keywords]
WINDOWED = [n for n in NAMES if FAMILIES[n].window]
#: families passing a keyword acting on the scores (soft-cap, position bias, sinks): scoreless normalizers refuse it
SCORE_KEYWORD_FAMILIES = [n for n in NAMES if set(FAMILIES[n].keywords) & set(SCORE_KEYWORDS)]
#: families passing a sparse indexer's choice of keys (indices, block_indices)
SELECTING = [n for n in NAMES if set(FAMILIES[n].keywords) & SELECTION_KEYWORDS.keys()]


def _score_keywords(family: str) -> list[str]:
    return [k for k in FAMILIES[family].keywords if k in SCORE_KEYWORDS]


def _learnable(impl: str) -> list[str]:
    s = resolve_settings(impl, {})
    return [p.name for p in param_specs(s) if p.is_learnable(s)]


#: presets with a learnable per-head value (ssmax, sink, cosine, ...): the ones that can lose one
LEARNABLE = [p for p in PRESETS if _learnable(p)]
#: the default run's representative: the first learnable preset on a softmax-family normalizer (exact SDPA path)
LEARN = next(p for p in LEARNABLE if resolve_settings(p, {}).normalizer == "softmax")
SCORELESS = {p for p in PRESETS if NORMALIZERS.get(resolve_settings(p, {}).normalizer).scoreless}
FREE = {p for p in PRESETS if NORMALIZERS.get(resolve_settings(p, {}).normalizer).row_sum == "free"}

ERRORS: dict[str, dict[str, float]] = {}


def _paths_take(path: str, impl: str) -> bool:
    from hf_attnorm.kernels import PATHS

    return PATHS[path].takes(NORMALIZERS.get(resolve_settings(impl, {}).normalizer)) is None


def _record(family: str, check: str, err: float) -> None:
    row = ERRORS.setdefault(family, {})
    row[check] = max(row.get(check, 0.0), float(err))


@pytest.fixture(scope="module", autouse=True)
def _write_matrix():
    yield
    path = os.environ.get("FAMILY_MATRIX_JSON")
    if path:
        old = json.loads(open(path).read()) if os.path.exists(path) else {}
        for fam, row in ERRORS.items():
            for check, err in row.items():
                old.setdefault(fam, {})[check] = max(old.get(fam, {}).get(check, 0.0), err)
        with open(path, "w") as f:
            json.dump(old, f, indent=1, sort_keys=True)


def _run(model, x) -> torch.Tensor:
    with torch.no_grad():
        return output(model(**x))


def _states(model) -> list[tuple[torch.nn.Module, AttnormState]]:
    out = []
    for _, mod in attention_modules(model):
        st = mod._modules.get("attnorm")
        assert isinstance(st, AttnormState), f"{type(mod).__name__} has no attnorm state"
        out.append((mod, st))
    assert out, "no attention module found"
    return out


def _check_values(model, impl: str) -> None:
    names = _learnable(impl)
    for mod, st in _states(model):
        assert st.settings.implementation == impl
        for name in names:
            p = st._parameters.get(name)
            assert isinstance(p, torch.nn.Parameter), f"{type(mod).__name__}.attnorm lacks {name}"
            assert p.shape == (num_heads_of(mod),)
    have = [n for n, _ in model.named_parameters() if ".attnorm." in n]
    assert len(have) == len(names) * len(_states(model))


# ----------------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("family", NAMES)
def test_load_set_apply_create_values(family):
    model = build(family, LEARN)
    _check_values(model, LEARN)
    model = build(family, "eager")
    assert not any(".attnorm." in n for n, _ in model.named_parameters())
    model.set_attn_implementation(LEARN)
    _check_values(model, LEARN)
    other = next(p for p in LEARNABLE if p != LEARN)
    hf_attnorm.apply(model, other)
    _check_values(model, other)


@pytest.mark.parametrize("family", list(REFUSED))
def test_refused_families_fail_at_load_and_set_time(family):
    with pytest.raises(AttnormError, match=f"model family '{family}'"):
        build(family, "symax")
    model = build(family, "eager")
    with pytest.raises(AttnormError, match=f"model family '{family}'"):
        model.set_attn_implementation("symax")
    with pytest.raises(AttnormError, match=f"model family '{family}'"):
        hf_attnorm.apply(model, "softmax")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", SCORE_KEYWORD_FAMILIES)
def test_score_keywords_refused_for_scoreless_normalizers_at_load(family):
    impl = sorted(SCORELESS)[0]
    kw = _score_keywords(family)[0]
    with pytest.raises(AttnormError, match=kw):
        build(family, impl)


def test_unknown_keyword_refused_at_load_and_per_call():
    from transformers.models.llama import modeling_llama

    class OddAttention(modeling_llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            attention_interface = modeling_llama.ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, modeling_llama.eager_attention_forward)
            q = k = v = hidden_states.view(*hidden_states.shape[:2], -1, self.head_dim).transpose(1, 2)
            return attention_interface(
                self, q, k[:, :2], v[:, :2], attention_mask, scaling=self.scaling, window_bias=1.0,
            )

    model = build("llama", "eager")
    model.model.layers[0].self_attn.__class__ = OddAttention
    with pytest.raises(AttnormError, match="'window_bias'"):
        model.set_attn_implementation("symax")
    # a keyword arriving through **kwargs that no module declares: refused at the call, never ignored
    model = build("llama", "symax")
    q = torch.randn(1, 4, 3, 8)
    fn = hf_attnorm.hf.forward.forward_for("symax")
    with pytest.raises(AttnormError, match="'block_indices'"):
        fn(model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None, block_indices=1)
    # a sliding window with no mask is only legal when it cannot bite (sdpa_mask skips the mask only then)
    with pytest.raises(AttnormError, match="sliding_window=2"):
        fn(model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None, sliding_window=2)
    out, _ = fn(model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None, sliding_window=3)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("family", NAMES)
def test_softmax_equals_eager_and_sdpa_with_padding(family):
    model = build(family, "eager")
    x, live = inputs(family)
    eager = _run(model, x)
    model.set_attn_implementation("softmax")
    LAST_CALL.path = ""
    ours = _run(model, x)
    assert LAST_CALL.path, "the call did not go through hf_attnorm"
    sel = (lambda t: t[live]) if live is not None else (lambda t: t)
    err = (sel(ours) - sel(eager)).abs().max().item()
    _record(family, "softmax vs eager (padding)", err)
    torch.testing.assert_close(sel(ours), sel(eager), atol=1e-5, rtol=0)
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError):
        return  # the family has no sdpa
    sdpa = _run(model, x)
    _record(family, "softmax vs sdpa (padding)", (sel(ours) - sel(sdpa)).abs().max().item())
    torch.testing.assert_close(sel(ours), sel(sdpa), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", SELECTING)
def test_key_selection_reaches_every_call_and_bites(family, monkeypatch):
    """The keys the family's indexer selects (``indices``, ``block_indices``) restrict every call with one: softmax
    equals eager with them (the test above) and differs without them, so in these configs the selection matters."""
    model = build(family, "softmax")
    x, live = inputs(family)
    sel = (lambda t: t[live]) if live is not None else (lambda t: t)
    seen = []
    real = forward.key_selection

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(forward, "key_selection", spy)
    ours = _run(model, x)
    assert LAST_CALL.mask == "given" and LAST_CALL.path, (LAST_CALL.mask, LAST_CALL.path)
    chosen = [s for s in seen if s is not None]
    assert chosen and all(s.dtype == torch.bool and not s.all() for s in chosen)
    monkeypatch.setattr(forward, "key_selection", lambda *args, **kwargs: None)
    unselected = _run(model, x)
    assert (sel(unselected) - sel(ours)).abs().max() > 1e-3


@pytest.mark.parametrize("family", CAUSAL)
def test_causality(family):
    model = build(family, "symax")
    x, _ = inputs(family, pad=False)
    base = _run(model, x)
    y = dict(x, input_ids=x["input_ids"].clone())
    y["input_ids"][:, 7] = (y["input_ids"][:, 7] % 90) + 3
    changed = _run(model, y)
    err = (changed[:, :7] - base[:, :7]).abs().max().item()
    _record(family, "causality (earlier rows unchanged)", err)
    assert err <= 1e-6
    assert not torch.allclose(changed[:, 7:], base[:, 7:])


@pytest.mark.parametrize("family", CAUSAL)
def test_cached_generation_equals_no_cache(family):
    model = build(family, LEARN)
    x, _ = inputs(family)
    args = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True,
                pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = model.generate(input_ids=x["input_ids"], attention_mask=x["attention_mask"], use_cache=True, **args)
        b = model.generate(input_ids=x["input_ids"], attention_mask=x["attention_mask"], use_cache=False, **args)
    err = max((p - q).abs().max().item() for p, q in zip(a.logits, b.logits))
    _record(family, "cached generation vs no cache", err)
    assert torch.equal(a.sequences, b.sequences)
    assert err <= 1e-4


@pytest.mark.parametrize("family", [n for n in NAMES if FAMILIES[n].kind in ("seq2seq", "speech")])
def test_cross_attention(family):
    """Cross-attention modules carry states and the decoder output depends on the encoder input through them."""
    model = build(family, LEARN)
    cross = [name for name, _ in attention_modules(model) if "encoder_attn" in name or "EncDec" in name]
    assert cross, "no cross-attention module found"
    x, _ = inputs(family, pad=False)
    base = _run(model, x)
    key = "input_ids" if "input_ids" in x else "input_features"
    y = dict(x, **{key: x[key].flip(-1)})
    assert not torch.allclose(_run(model, y), base), "the decoder must see the encoder through cross-attention"


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_window(family):
    """Past the window the mask transformers builds (sdpa_mask) limits the keys: softmax equals eager there, and a
    single layer's first query's token is invisible to queries beyond the window."""
    model = build(family, "eager")
    x, _ = inputs(family, pad=False, length=3 * FAMILIES[family].window)
    eager = _run(model, x)
    model.set_attn_implementation("softmax")
    ours = _run(model, x)
    err = (ours - eager).abs().max().item()
    _record(family, "sliding window vs eager (L = 3 x window)", err)
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------- training / saving


@pytest.mark.parametrize("family", NAMES)
def test_train_step_reaches_learnable_values(family):
    model = build(family, LEARN).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # built right after loading, as users do
    params = {n: p for n, p in model.named_parameters() if ".attnorm." in n}
    before = {n: p.detach().clone() for n, p in params.items()}
    x, _ = inputs(family)
    loss = output(model(**x)).float().pow(2).mean()
    loss.backward()
    for n, p in params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{n} got no gradient"
    opt.step()
    moved = min((params[n] - before[n]).abs().max().item() for n in params)
    _record(family, "train step: min change of a learnable value", moved)
    assert moved > 0


@pytest.mark.parametrize("family", NAMES)
def test_save_reload_exact(family, tmp_path):
    model = build(family, LEARN)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".attnorm." in n:
                p.copy_(torch.rand(p.shape) + 0.5)
    x, _ = inputs(family)
    ref = _run(model, x)
    model.save_pretrained(tmp_path)
    cls = type(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = cls.from_pretrained(tmp_path).eval()
    assert back.config._attn_implementation == LEARN
    a = dict(model.named_parameters())
    for n, p in back.named_parameters():
        if ".attnorm." in n:
            assert torch.equal(p, a[n]), n
    # loaded tensors sit at the file's offsets (safetensors: not 64-byte aligned), where vectorised kernels can sum in
    # another order (MiniMax M3's experts: 1 ulp); the values are what is checked, so they run from fresh memory
    with torch.no_grad():
        for t in [*back.parameters(), *back.buffers()]:
            t.data = t.data.clone()
    err = (_run(back, x) - ref).abs().max().item()
    _record(family, "save/reload (max |diff|)", err)
    assert err == 0


# ----------------------------------------------------------------------------------------- every implementation


def _every_impl(family: str) -> None:
    x, _ = inputs(family)
    for impl in PRESETS:
        if impl in SCORELESS and _score_keywords(family):
            continue  # refused at load: test_score_keywords_refused_for_scoreless_normalizers_at_load
        if impl in FREE and "s_aux" in FAMILIES[family].keywords:
            with pytest.raises(AttnormError, match="'s_aux'"):
                build(family, impl)  # a sink would change nothing for a normalizer without a sum over keys
            continue
        scale = SCALES.get(resolve_settings(impl, {}).scale)
        refusal = scale.refuses({"rope": rope_parameters(make_config(family)), "family": family})
        if refusal:  # the model applies that scale itself (yarn on a yarn-rope config): refused at load
            with pytest.raises(ValueError, match=re.escape(refusal.split(":")[0])):
                build(family, impl)
            continue
        # scales that need a training length get one where the config has no max_position_embeddings (T5)
        extra = {"attnorm": {"train_length": 64}} if "train_length" in scale.options else {}
        model = build(family, impl, **extra).train()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        out = output(model(**x))
        assert torch.isfinite(out).all(), impl
        out.float().pow(2).mean().backward()
        for n, p in model.named_parameters():
            if ".attnorm." in n:
                assert p.grad is not None and torch.isfinite(p.grad).all(), (impl, n)


@pytest.mark.parametrize("family", KEYWORD_FAMILIES)
def test_every_implementation_runs_with_keywords(family):
    _every_impl(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", [n for n in NAMES if n not in KEYWORD_FAMILIES])
def test_every_implementation_runs(family):
    _every_impl(family)


@pytest.mark.parametrize("family", ["vit", "gpt2"])
def test_verify_follows_renaming_and_env_skips_every_check(family, tmp_path, monkeypatch):
    """ViT saves its layers as encoder.layer.N (the module is layers.N): the post-load check must follow that; a
    checkpoint that really lacks a learned value fails it, unless HF_ATTNORM_VERIFY=0 (which skips every check)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from hf_attnorm.hf.persistence import CheckpointError

    model = build(family, LEARN)
    model.save_pretrained(tmp_path)
    type(model).from_pretrained(tmp_path)  # renamed keys are found
    f = tmp_path / "model.safetensors"
    with safe_open(f, "pt") as fh:
        meta = fh.metadata()
    state = {k: v for k, v in load_file(f).items() if ".attnorm." not in k}
    save_file(state, f, metadata=meta)
    (tmp_path / "attnorm_checksums.json").unlink()
    with pytest.raises(CheckpointError, match="lack the learned parameter"):
        type(model).from_pretrained(tmp_path)
    monkeypatch.setenv("HF_ATTNORM_VERIFY", "0")
    type(model).from_pretrained(tmp_path)


#: families whose attention passes a score modifier: soft-cap (Gemma2), sinks (GPT-OSS), position bias (T5)
COMPILE_FAMILIES = [n for n in ("gemma2", "gpt_oss", "t5") if n in FAMILIES]


@pytest.mark.slow
@needs_compile
# aot_eager (no kernel generation hides a bad view) for both on every family; inductor (~25-90 s a case on 2 cores)
# for symax on T5, whose learned position bias takes the fused C++ op with its gradient (the op's soft-cap, and
# the chunked path of GPT-OSS's sinks, are traced by the aot_eager cases)
@pytest.mark.parametrize("family, impl, backend", [
    *[(family, impl, "aot_eager") for family in COMPILE_FAMILIES for impl in ("softmax", "symax")],
    *[(family, "symax", "inductor") for family in COMPILE_FAMILIES if family == "t5"]])
def test_torch_compile_fullgraph_with_score_modifiers_and_padding(family, impl, backend):
    """torch.compile(fullgraph=True) with a padding mask: the score modifiers add no data-dependent branch or host
    sync; the compiled model matches eager and runs the same path."""
    torch._dynamo.reset()
    model = build(family, impl)
    x, live = inputs(family)
    LAST_CALL.path = ""
    eager = _run(model, x)
    path = LAST_CALL.path
    assert path, "the eager call did not go through hf_attnorm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        LAST_CALL.path = ""
        out = _run(compiled, x)
    sel = (lambda t: t[live]) if live is not None else (lambda t: t)
    torch.testing.assert_close(sel(out), sel(eager), atol=1e-4, rtol=1e-4)
    assert LAST_CALL.path == path
    # a compiled training step: gradients reach the model's own modifier weights (T5's relative bias, GPT-OSS sinks)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output(compiled(**x)).float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    for key in ("relative_attention_bias", "sinks"):
        if any(key in n for n, _ in model.named_parameters()):
            assert any(key in n and g.abs().sum() > 0 for n, g in grads.items()), key


#: a preset whose normalizer runs on the fused C++ kernels (the first such preset, generic over the registry)
FUSED_IMPL = next(p for p in PRESETS if p not in FREE and _paths_take("fused_cpu", p))
#: families passing a soft-cap or a position bias (the fused kernels apply both; s_aux families go to chunked)
BIAS_CAP_FAMILIES = [n for n in KEYWORD_FAMILIES if {"softcap", "position_bias"} & set(FAMILIES[n].keywords)]


@pytest.mark.parametrize("family", BIAS_CAP_FAMILIES)
def test_score_modifier_families_take_the_fused_path(family):
    """Gemma2's soft-cap and T5's learned position bias run on fused_cpu for a fused-map normalizer (no longer
    declined to chunked), equal to the reference path, forward and every parameter gradient (the relative bias's
    included)."""
    from hf_attnorm.kernels import set_forced_path
    from hf_attnorm.kernels.fused import cpu as fused_cpu

    if fused_cpu.unavailable_reason():
        pytest.skip(fused_cpu.unavailable_reason())
    model = build(family, FUSED_IMPL)  # eval mode: no attention dropout (which fused paths decline); grads flow
    x, live = inputs(family)
    runs = {}
    try:
        for path in ("reference", "auto"):
            set_forced_path(path)
            model.zero_grad()
            LAST_CALL.path = ""
            out = output(model(**x))
            ran = LAST_CALL.path
            out.float().pow(2).mean().backward()
            runs[path] = (out.detach(), ran, {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None})
    finally:
        set_forced_path()
    (ref, _, gref), (got, ran, ggot) = runs["reference"], runs["auto"]
    assert ran == "fused_cpu", ran
    sel = (lambda t: t[live]) if live is not None else (lambda t: t)
    torch.testing.assert_close(sel(got), sel(ref), atol=1e-5, rtol=1e-4)
    assert gref.keys() == ggot.keys()
    for n in gref:
        torch.testing.assert_close(ggot[n], gref[n], atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    bias_params = [n for n in ggot if "relative_attention_bias" in n]
    assert all(ggot[n].abs().sum() > 0 for n in bias_params)


#: documents packed into one row (TRL-style packing: position_ids restart per document, no attention mask, no cache)
PACKED_DOCS = (5, 7, 4)


def _packed_paths(impl: str) -> list[str]:
    """The reference and every CPU path that implements ``impl``'s normalizer, from the kernel registry."""
    from hf_attnorm.kernels import paths_for

    norm = resolve_settings(impl, {}).normalizer
    return ["reference", *[p for p in paths_for(norm) if "triton" not in p]]


@pytest.mark.parametrize("impl", list(PRESETS))
def test_packed_rows_equal_documents_alone(impl):
    """A row packing 3 documents (position_ids restarting per document, no mask, use_cache=False: transformers'
    sdpa_mask makes the mask block-diagonal) gives every document the logits it gets alone, on every path that
    takes the packed call: selective attention's BOS exemption is per document (normalizers/selective.py)."""
    from hf_attnorm.kernels import set_forced_path

    model = build("llama", impl)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, 99, (1, n), generator=g) for n in PACKED_DOCS]
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in PACKED_DOCS])[None]
    ran: dict[str, str] = {}
    try:
        for path in _packed_paths(impl):
            set_forced_path(path)
            LAST_CALL.path = ""
            try:
                with torch.no_grad():
                    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            except ValueError as e:
                if "cannot run this call" in str(e):
                    continue  # a path that declines block-diagonal masks (e.g. linear_chunked): the others run
                raise
            ran[path] = LAST_CALL.path
            start = 0
            for doc in docs:
                n = doc.shape[1]
                with torch.no_grad():
                    alone = model(input_ids=doc, position_ids=torch.arange(n)[None], use_cache=False).logits
                assert LAST_CALL.path == path, (path, LAST_CALL.path)
                err = (packed[:, start:start + n] - alone).abs().max().item()
                assert err <= 1e-5, f"{impl} on {path}: document at {start} differs by {err:.3g} packed vs alone"
                start += n
    finally:
        set_forced_path()
    assert ran.get("reference") == "reference", ran
    assert all(ran[p] == p for p in ran), ran
