"""The contract with transformers: every assumption hf_attnorm makes about the installed transformers' internals,
asserted directly, each failure naming what changed and which feature depends on it (docs/internals.md lists them).

When a release renames or moves something, one of these fails with that sentence instead of two dozen scattered
failures elsewhere; the fix then belongs in ``hf_attnorm/hf/compat.py``, the one module that reads transformers' call
conventions. CI runs this file on every transformers version it tests (``compat.CI_VERSIONS``).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from conftest import tiny
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_attnorm.hf import compat, integration
from hf_attnorm.hf.families import keyword_role, refused_keywords
from hf_attnorm.hf.forward import record_paths
from hf_attnorm.registry import AttnormError

VERSION = transformers.__version__
PROBE = "contract_probe"  # a name of this test's own, registered like ours (function + sdpa_mask)


def broken(what: str, feature: str) -> str:
    """The message of a broken assumption: what changed, on which version, and what depends on it."""
    return (f"transformers {VERSION} changed an internal hf_attnorm relies on: {what}. Depends on it: {feature}. "
            "Adapt hf_attnorm/hf/compat.py (and docs/internals.md).")


class Probe:
    """An attention function registered under PROBE that records each call and computes plain SDPA attention.
    query [B, H, Lq, D], key/value [B, Hkv, Lk, D] -> (out [B, Lq, H, D], None)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        self.calls.append(dict(module=module, query=query, key=key, value=value, mask=attention_mask, args=args,
                               kwargs=dict(kwargs)))
        groups = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        causal = attention_mask is None and query.shape[2] > 1
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=attention_mask,
                                                               is_causal=causal, scale=kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def probe():
    rec = Probe()
    AttentionInterface.register(PROBE, rec)
    AttentionMaskInterface.register(PROBE, sdpa_mask)
    yield rec
    AttentionInterface._global_mapping.pop(PROBE, None)
    AttentionMaskInterface._global_mapping.pop(PROBE, None)


def _ids(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(0))


def _padded(batch: int = 2, length: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    x = _ids(batch, length)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    return x, mask


def test_registered_names_reach_the_attention_function_with_the_documented_call(probe):
    model = tiny("llama", "causal_lm", implementation=PROBE)
    x, mask = _padded()
    with torch.no_grad():
        model(x, attention_mask=mask)
    assert probe.calls, broken("a model built with a name registered in AttentionInterface never called its "
                               "function", "every hf_attnorm implementation (registration)")
    call = probe.calls[0]
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // heads
    assert call["query"].shape == (2, heads, 9, d), broken(
        f"the query reaches the attention function as {tuple(call['query'].shape)}, not [B, H, Lq, D]",
        "every implementation (shapes)")
    assert call["key"].shape == (2, kv, 9, d) and call["value"].shape == (2, kv, 9, d), broken(
        f"keys reach the attention function as {tuple(call['key'].shape)}, not [B, Hkv, Lk, D] (un-repeated GQA)",
        "every implementation (GQA grouping)")
    assert "scaling" in call["kwargs"] and "dropout" in call["kwargs"], broken(
        f"the attention function's keywords are {sorted(call['kwargs'])}, without 'scaling' and 'dropout'",
        "the score scale (GPT-2 folds its layer scaling into it) and attention dropout")
    assert call["module"] is model.model.layers[0].self_attn, broken(
        "the first argument of the attention function is not the calling attention module",
        "per-module settings and learned values (AttnormState lives on the module)")
    for attr in ("config", "is_causal", "layer_idx"):
        assert hasattr(call["module"], attr), broken(
            f"attention modules have no {attr!r} attribute", "causality, per-layer values and cache lookup")


def test_the_mask_function_gives_a_boolean_keep_mask_or_none(probe):
    model = tiny("llama", "causal_lm", implementation=PROBE)
    x, mask = _padded()
    with torch.no_grad():
        model(x, attention_mask=mask)
        model(x)  # no padding: plain causal
    padded, plain = probe.calls[0]["mask"], probe.calls[-1]["mask"]
    assert isinstance(padded, torch.Tensor) and padded.dtype == torch.bool and padded.shape == (2, 1, 9, 9), broken(
        f"sdpa_mask (registered for our names) returned {type(padded).__name__} "
        f"{getattr(padded, 'dtype', '')} {tuple(getattr(padded, 'shape', ()))}, not a bool keep-mask [B, 1, Lq, Lk]",
        "padding and causality of every implementation (masks.py reads True = keep)")
    expected = torch.ones(9, 9, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    assert torch.equal(padded, expected), broken("sdpa_mask's True no longer means 'keep'", "masks.py")
    assert plain is None, broken(
        "sdpa_mask returns a mask for a plain causal batch (it returned None: nothing beyond causality)",
        "the fast paths that run maskless causal attention (hf_attnorm rebuilds causality from module.is_causal)")
    assert inspect.signature(sdpa_mask).parameters, broken("sdpa_mask takes no parameters", "mask registration")


def _decode(model, x: torch.Tensor, mask: torch.Tensor, steps: int = 2):
    """A prefill and ``steps`` one-token steps on a DynamicCache -> the cache."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(x, attention_mask=mask, use_cache=True, **compat.cache_kwargs(model, cache))
        for _ in range(steps):
            assert compat.output_cache(out) is cache, broken(
                f"a model's output carries its cache under none of {compat.CACHE_ARGUMENTS}",
                "compat.output_cache (scripts/bench_decode.py, the decoding tests)")
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            out = model(nxt, attention_mask=mask, use_cache=True, **compat.cache_kwargs(model, cache))
    return cache


def test_the_cache_reaches_the_attention_module_under_a_known_argument(probe):
    model = tiny("llama", "causal_lm", implementation=PROBE)
    module = model.model.layers[0].self_attn
    seen: list[tuple[tuple, dict]] = []
    handle = module.register_forward_pre_hook(lambda m, a, kw: seen.append((a, dict(kw))), with_kwargs=True)
    try:
        cache = _decode(model, *_padded())
    finally:
        handle.remove()
    assert len(seen) == 3
    for args, kwargs in seen:
        assert any(isinstance(kwargs.get(n), DynamicCache) for n in compat.CACHE_ARGUMENTS), broken(
            f"the attention module's call carries the KV cache under none of the keywords "
            f"{compat.CACHE_ARGUMENTS} (it got keywords {sorted(kwargs)})",
            "linear attention's O(1) recurrent decode (hf/recurrent.py) and selective attention's cached generation "
            "(hf/selective_cache.py): both find the cache in the module's call")
        assert compat.cache_of_call(args, kwargs) is cache


def test_the_module_appends_to_its_cache_layer_before_calling_the_attention_function(probe):
    model = tiny("llama", "causal_lm", implementation=PROBE)
    x, mask = _padded()
    cache = DynamicCache(config=model.config)
    layer0 = model.model.layers[0].self_attn
    seen_keys = []
    inp = x
    with torch.no_grad():
        for step in range(3):
            if step:
                mask = torch.cat([mask, torch.ones_like(inp)], 1)
            probe.calls.clear()
            logits = model(inp, attention_mask=mask, use_cache=True, **compat.cache_kwargs(model, cache)).logits
            inp = logits[:, -1:].argmax(-1)
            call = next(c for c in probe.calls if c["module"] is layer0)
            layer = compat.cache_layer(cache, layer0.layer_idx)
            assert compat.plain_dynamic_layer(layer), broken(
                f"DynamicCache's layers are {type(layer).__name__}, not DynamicLayer", "the cache-bound states")
            keys, values = compat.layer_tensors(layer)
            assert call["key"] is keys and call["value"] is values, broken(
                "the key/value tensors the attention function receives are not the cache layer's own tensors",
                "the cache-bound states (they recognise their layer by tensor identity)")
            assert compat.layer_length(layer) == 9 + step
            seen_keys.append(keys)
    assert seen_keys[0] is not seen_keys[1] is not seen_keys[2], broken(
        "DynamicLayer.update no longer makes new tensors (it appends in place)",
        "the cache-bound states' staleness check (identity + version counter)")


def test_the_cache_layer_operations_generation_applies_exist_and_crop_removes():
    for op in compat.DYNAMIC_LAYER_OPERATIONS:
        assert callable(getattr(DynamicLayer, op, None)), broken(
            f"DynamicLayer has no {op!r}", "selective attention's state following cache operations "
                                           "(hf/selective_cache.SelectiveLayer)")
    layer = DynamicLayer()
    k = torch.randn(1, 2, 5, 4)
    layer.update(k, k.clone())
    before = layer.keys
    layer.crop(-2)
    assert compat.layer_length(layer) == 3 and layer.keys is not before, broken(
        "DynamicLayer.crop(-2) does not remove 2 positions by replacing the tensors",
        "selective attention under assisted decoding (crop)")


def test_a_model_forward_takes_the_cache_under_a_known_name():
    params = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    assert any(n in params for n in compat.CACHE_ARGUMENTS), broken(
        f"LlamaForCausalLM.forward takes the cache under none of {compat.CACHE_ARGUMENTS}",
        "compat.cache_kwargs (scripts/bench_decode.py, the decoding tests)")


def test_the_keyword_declarations_hf_attnorm_reads_exist():
    declared = compat.declared_passthrough_keywords()
    attention = compat.attention_function_keywords()
    for k in ("num_items_in_batch", "output_hidden_states"):
        assert k in declared, broken(f"{k!r} is no longer declared in TransformersKwargs",
                                     "keyword classification (compat.keyword_roles)")
    assert "shift_labels" in declared, broken("ForCausalLMLoss no longer declares 'shift_labels'",
                                              "keyword classification: loss keywords pass through")
    for k in ("dropout", "scaling", "is_causal", "softcap", "s_aux", "sliding_window"):
        assert k in attention, broken(f"no transformers attention function declares {k!r}",
                                      "keyword classification: attention keywords are refused unless implemented")
    assert keyword_role("softcap").kind == compat.IMPLEMENTED
    assert keyword_role("shift_labels").kind == compat.PASSTHROUGH
    assert keyword_role("block_table").kind == compat.ATTENTION  # paged attention: would change attention
    assert keyword_role("not_a_keyword").kind == compat.UNKNOWN


def test_every_keyword_a_model_passes_down_is_classified_and_accepted(probe):
    """What a decode step and a training step with loss keywords hand the attention function: a new release that
    adds a keyword here fails with its name, before users meet the refusal."""
    model = tiny("llama", "causal_lm", implementation=PROBE)
    x, mask = _padded()
    _decode(model, x, mask)
    with torch.no_grad():
        model(x, attention_mask=mask, labels=x, shift_labels=torch.roll(x, -1, 1))
    passed = set().union(*(c["kwargs"] for c in probe.calls))
    assert "shift_labels" in passed  # models hand loss keywords down to the attention function
    refused = refused_keywords(passed)
    assert not refused, broken(f"the model passes keywords hf_attnorm would refuse: {refused}",
                               "every implementation inside models (forward.py's keyword check)")


def test_the_private_methods_hooked_exist_with_the_arguments_passed():
    for attr in ("_check_and_adjust_attn_implementation", "post_init", "set_attn_implementation",
                 "_initialize_weights", "from_pretrained", "save_pretrained"):
        assert attr in integration.HOOKED, broken(f"PreTrainedModel.{attr} is gone", "docs/internals.md")
    first = list(inspect.signature(PreTrainedModel._check_and_adjust_attn_implementation.__wrapped__).parameters)
    assert first[1] == "attn_implementation", broken(
        f"_check_and_adjust_attn_implementation's first argument is {first[1]!r}",
        "loading a config that names 'hf_attnorm:<name>'")
    assert hasattr(PreTrainedModel, "_keys_to_ignore_on_load_missing"), broken(
        "PreTrainedModel._keys_to_ignore_on_load_missing is gone", "quiet loading of plain checkpoints")
    from transformers.utils import output_capturing

    assert hasattr(output_capturing, "_active_collector"), broken(
        "transformers.utils.output_capturing._active_collector is gone",
        "attention weights requested through transformers' output collector")


#: continuous batching on a transformers older than the first one checked, lacking a name relied on: refused there
CB_REFUSED = (compat.release(VERSION) < compat.release(compat.CONTINUOUS_BATCHING_CHECKED)
              and bool(compat.continuous_batching_missing()))
needs_cb = pytest.mark.skipif(CB_REFUSED, reason=f"continuous batching is refused for hf_attnorm implementations on "
                                                 f"transformers {VERSION}: it lacks "
                                                 f"{', '.join(compat.continuous_batching_missing())}")


def small_cache() -> transformers.ContinuousBatchingConfig:
    """Continuous batching with a few small pages and short batches (tests on a CPU)."""
    return transformers.ContinuousBatchingConfig(page_size=8, num_blocks=16, max_batch_tokens=16)


def test_continuous_batching_has_one_entry_and_runs_ours_on_its_sdpa_route():
    owner = compat.continuous_batching_owner()
    assert owner is not None and issubclass(transformers.GenerationMixin, owner), broken(
        f"continuous batching's entry {compat.CONTINUOUS_BATCHING_ENTRY} moved",
        "generate_batch with hf_attnorm implementations (and their refusal where not exact)")
    assert compat.CONTINUOUS_BATCHING_ENTRY[1] in integration.HOOKED
    if CB_REFUSED:  # an older protocol: refused, naming what is missing, and the model left as it was
        model = tiny("llama", "causal_lm", implementation="symax")
        with pytest.raises(AttnormError, match=r"^continuous batching .* cannot run hf_attnorm's 'symax': .* lacks"):
            model.generate_batch([[1, 2, 3]])
        assert model.config._attn_implementation == "symax"
        return
    assert compat.continuous_batching_missing() == [], broken(
        f"continuous batching lacks {compat.continuous_batching_missing()}",
        "generate_batch with hf_attnorm implementations (refused without them, as docs/internals.md says)")
    assert {compat.CONTINUOUS_BATCHING_ENTRY[1], compat.CONTINUOUS_BATCHING_SWITCH[1],
            compat.CONTINUOUS_BATCHING_MASKS[1]} <= integration.HOOKED
    assert compat.CONTINUOUS_BATCHING_THREAD[1] in integration.HOOKED, broken(
        f"the manager has no {compat.CONTINUOUS_BATCHING_THREAD[1:]}", "record_paths around generate_batch")
    model = tiny("llama", "causal_lm", implementation="symax")
    # a small explicit cache: sized from the free memory, a CPU's would take most of it (14.9 GB peak here)
    with record_paths() as rec:  # (the manager's thread runs in this context's copy: its calls are recorded here)
        out = model.generate_batch([[1, 2, 3], [4]], max_new_tokens=2, continuous_batching_config=small_cache())
    assert rec.packed > 0, broken("the manager's thread does not run the method the hook gives the caller's context",
                                  "record_paths around generate_batch")
    assert [len(r.generated_tokens) for r in out.values()] == [2, 2]
    assert model.config._attn_implementation == "symax"  # not switched away (e.g. to flash attention)
    with pytest.raises(AttnormError, match=r"^continuous batching .* cannot run hf_attnorm's 'selective'"):
        tiny("llama", "causal_lm", implementation="selective").generate_batch(
            [[1, 2, 3]], continuous_batching_config=small_cache())


@needs_cb
def test_the_managers_name_check_is_a_method_taking_the_model():
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    params = list(inspect.signature(ContinuousBatchingManager.switch_to_cb_friendly_attn.__wrapped__).parameters)
    assert params[:2] == ["self", "model"], broken(
        f"ContinuousBatchingManager.switch_to_cb_friendly_attn takes {params}",
        "continuous batching keeps an hf_attnorm implementation (instead of refusing it or switching to flash)")


@needs_cb
def test_the_mask_decision_is_a_function_of_the_config_imported_where_the_batch_is_built():
    from transformers.generation.continuous_batching import input_outputs, utils

    hooked = utils.attn_mask_is_needed
    assert input_outputs.attn_mask_is_needed is hooked and hooked.__name__ == "attn_mask_is_needed", broken(
        "continuous_batching.input_outputs no longer decides the masks with utils.attn_mask_is_needed",
        "continuous batching builds the block-diagonal masks for hf_attnorm implementations")

    def config(name):
        cfg = transformers.LlamaConfig()
        cfg._attn_implementation = name
        return cfg

    assert hooked(config("symax")) and hooked(config("sdpa")) and not hooked(config("flash_attention_2")), broken(
        "attn_mask_is_needed answers otherwise for sdpa / flash attention", "the sdpa route of continuous batching")


@needs_cb
def test_the_paged_cache_and_the_managers_keywords():
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    params = list(inspect.signature(PagedAttentionCache.update).parameters)
    assert params[1:5] == ["key_states", "value_states", "layer_idx", "kwargs"], broken(
        f"PagedAttentionCache.update takes {params}",
        "continuous batching: the keys the attention function receives are gathered by the cache")
    assert compat.paged_cache_in_call((), {"cache": PagedAttentionCache.__new__(PagedAttentionCache)})
    assert not compat.paged_cache_in_call((), {"cache": DynamicCache()})
    passed = compat.paged_arguments()
    assert set(compat.CONTINUOUS_BATCHING_KEYWORDS) <= passed, broken(
        f"PagedAttentionArgs no longer declares {sorted(set(compat.CONTINUOUS_BATCHING_KEYWORDS) - passed)}",
        "the keywords hf_attnorm takes on continuous batching's packed calls")
    assert "cache" in passed and "attention_mask" in passed
    assert dict(compat.packed_keywords()) == compat.CONTINUOUS_BATCHING_KEYWORDS  # (read when it was hooked)


def test_a_missing_name_turns_continuous_batching_off_for_ours(monkeypatch):
    monkeypatch.setattr(compat, "CONTINUOUS_BATCHING_MASKS", (compat.CONTINUOUS_BATCHING_MASKS[0], "renamed"))
    missing = compat.continuous_batching_missing()
    assert "transformers.generation.continuous_batching.utils.renamed" in missing
    assert compat.hook_continuous_batching(lambda model: True, lambda config: True) == []  # (nothing hooked)


def test_loss_keywords_pass_through_our_function_and_undeclared_ones_are_refused_by_name():
    model = tiny("llama", "causal_lm", implementation="symax")
    x, mask = _padded()
    with torch.no_grad():
        loss = model(x, attention_mask=mask, labels=x, shift_labels=torch.roll(x, -1, 1)).loss
        assert torch.isfinite(loss)
        with pytest.raises(AttnormError, match=r"passed 'window_bias' \(transformers .* declares no keyword"):
            model(x, attention_mask=mask, window_bias=torch.zeros(1))


def test_the_keyword_scan_classifies_what_families_pass(tmp_path):
    """scripts/scan_keywords.py (run after a release to see which families a new keyword would refuse)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "scan_keywords.py"
    subprocess.run([sys.executable, str(script), "--out-dir", str(tmp_path), "--only", "llama", "gemma2"],
                   check=True, capture_output=True, timeout=300)
    result = json.loads((tmp_path / "keywords.json").read_text())
    assert result["transformers"] == VERSION and not result["import_failures"]
    by_class = {r["class"]: r for r in result["classes"]}
    assert by_class["Gemma2Attention"]["keywords"]["softcap"] == compat.IMPLEMENTED
    assert by_class["Gemma2Attention"]["keywords"]["sliding_window"] == compat.IMPLEMENTED
    assert "LlamaAttention" in by_class
    assert result["refused_classes"] == 0


# ------------------------------------------------------------ transformers serve (python -m hf_attnorm serve)

def _serving():
    missing = compat.serve_missing()
    if missing:  # (the serve command refuses with these names: tests/test_serve.py)
        pytest.skip(f"python -m hf_attnorm serve is refused on transformers {transformers.__version__}: it lacks "
                    f"{', '.join(missing)}")
    if not compat.serve_extra_installed():
        pytest.skip("the serving extra is not installed (pip install 'hf_attnorm[serve]')")


def test_transformers_cli_app_has_serve_with_the_options_the_serve_command_reads():
    """cli/transformers.py: ``app`` (a click group) has the "serve" command built from cli/serve.py's ``Serve``: the
    model is its first parameter (positional), ``--attn-implementation`` takes a value, ``--continuous-batching`` /
    ``--no-continuous-batching`` is a switch, and the hidden ``--non-blocking`` starts uvicorn in ``self._thread``
    and returns the ``Serve`` object, whose ``kill_server`` stops the generation managers and the model."""
    _serving()  # (before 5.17 the command refuses, naming what is missing: its own test checks that)
    from transformers.cli import serve as cli_serve
    from transformers.cli.transformers import app

    from hf_attnorm import serve

    feature = "python -m hf_attnorm serve"
    command = getattr(app, "commands", {}).get("serve")
    assert command is not None, broken("transformers' CLI app has no 'serve' command", feature)
    params = {p.name: p for p in command.params}
    assert command.params[0].name == serve.SERVE_PARAMETERS[0] and not command.params[0].opts[0].startswith("-"), (
        broken("transformers serve's first parameter is no longer the model, as a positional argument", feature))
    opts = {name: (list(p.opts), list(getattr(p, "secondary_opts", []))) for name, p in params.items()}
    assert opts.get("attn_implementation", ([], []))[0] == [serve.ATTN_OPTION], broken(
        f"transformers serve has no option {serve.ATTN_OPTION}", feature)
    assert opts.get("continuous_batching") == ([serve.CB_OPTION], [serve.NO_CB_OPTION]), broken(
        f"transformers serve has no switch {serve.CB_OPTION}/{serve.NO_CB_OPTION}", feature)
    assert opts.get("non_blocking", ([], []))[0] == [serve.NON_BLOCKING_OPTION], broken(
        f"transformers serve has no (hidden) option {serve.NON_BLOCKING_OPTION}", feature + " (its clean stop)")
    assert "non_blocking" in inspect.signature(cli_serve.Serve.__init__).parameters
    start, kill = inspect.getsource(cli_serve.Serve.start_server), inspect.getsource(cli_serve.Serve.kill_server)
    assert "self._thread" in start and "_generation_state.shutdown()" in kill, broken(
        "Serve.start_server no longer keeps uvicorn's thread in self._thread, or kill_server no longer stops the "
        "generation managers", feature + " (its clean stop)")


def test_serve_loads_with_an_explicit_attn_implementation_that_only_names_its_own(tmp_path):
    """cli/serving/model_manager.py: ``ModelManager`` passes ``attn_implementation`` to ``from_pretrained`` always
    (None when unset), which overrides config.json's value: with hf_attnorm imported, None loads the implementation
    config.json's ``attnorm`` records (the hook of ``_check_and_adjust_attn_implementation``); without it, softmax
    runs (hence the marker tensor, hf/persistence.py). Its own check refuses every name but transformers' (hence the
    serve command leaves ``--attn-implementation`` out)."""
    _serving()
    from test_serve import save_checkpoint  # (a tiny checkpoint with a tokenizer: serve loads both)
    from transformers.cli.serving.model_manager import ModelManager

    feature = "python -m hf_attnorm serve (the checkpoint's implementation) and the marker tensor's warning"
    save_checkpoint(tmp_path, "symax")
    manager = ModelManager(device="cpu", force_model=str(tmp_path))
    try:
        model = next(iter(manager.loaded_models.values())).model
        assert model.config._attn_implementation == "symax", broken(
            "transformers serve's ModelManager no longer loads a checkpoint with attn_implementation=None", feature)
    finally:
        manager.shutdown()
    assert "attn_implementation" in inspect.getsource(ModelManager._load_model)
    with pytest.raises(ValueError, match="Unsupported attention implementation"):
        ModelManager(device="cpu", attn_implementation="symax")


def test_serves_generation_paths_reach_our_hooks():
    """cli/serving/utils.py: continuous batching starts with ``model.init_continuous_batching`` (hooked: it refuses
    or prepares ours); the sequential path calls ``model.generate(..., tokenizer=processor)``, whose keyword reaches
    the attention function (ignored: hf/families.py ``IGNORED_KEYWORDS``)."""
    _serving()
    from transformers.cli.serving import utils

    feature = "python -m hf_attnorm serve --continuous-batching"
    assert "init_continuous_batching" in inspect.getsource(utils.CBGenerateManager.init_cb), broken(
        "transformers serve no longer starts continuous batching with model.init_continuous_batching", feature)
    assert keyword_role("tokenizer").accepted


def test_the_serve_command_object_holds_what_the_command_stops():
    """cli/serve.py: ``Serve`` takes the hidden ``--non-blocking`` (``compat.SERVE_COMMAND``), assigns the attributes
    the serve command reads to stop it (``compat.SERVE_OBJECT_ATTRIBUTES``) and has ``kill_server``; the command
    reads them through compat, which names an attribute this transformers does not set."""
    _serving()
    from transformers.cli.serve import Serve

    feature = "python -m hf_attnorm serve's stop (grace period, continuous batching's worker, unloading the model)"
    path, option, parameter = compat.SERVE_COMMAND
    assert f"{Serve.__module__}.{Serve.__qualname__}" == path, broken(
        f"transformers serve's command moved from {path}", feature)
    assert parameter in inspect.signature(Serve.__init__).parameters, broken(f"Serve has no {option}", feature)
    assert callable(getattr(Serve, compat.SERVE_STOP, None)), broken(f"Serve has no {compat.SERVE_STOP}", feature)
    source = inspect.getsource(Serve)
    for name in compat.SERVE_OBJECT_ATTRIBUTES:
        assert f"self.{name} =" in source, broken(f"Serve no longer sets {name}", feature)
    with pytest.raises(AttnormError, match=r"transformers serve's .*Serve object has no '_thread'"):
        compat.serve_object_attribute(object(), "_thread")


def test_the_serve_guard_wraps_the_app_factory_before_uvicorn_starts():
    """cli/serve.py: ``Serve.__init__`` imports the app factory (``compat.SERVE_APP_FACTORY``) by name when it runs
    and calls it after the model is loaded and before uvicorn is built, with the model manager, the handlers and the
    generation state the guard reads; the app has the generation routes the guard checks and the /health it keeps
    answering 200."""
    _serving()
    from transformers.cli import serve as cli_serve

    from hf_attnorm.serve_guard import ROUTES

    feature = "python -m hf_attnorm serve's request guard (hf_attnorm/serve_guard.py) and its kernels' warm-up"
    assert compat.serve_guard_missing() == [], broken(f"transformers serve lacks {compat.serve_guard_missing()}",
                                                      feature)
    module, name = compat.SERVE_APP_FACTORY
    source = inspect.getsource(cli_serve.Serve.__init__)
    assert f"from .serving.server import {name}" in source, broken(
        f"Serve.__init__ no longer imports {name} by name when it runs (wrapping {module}.{name} would miss it)",
        feature)
    assert source.index("ModelManager(") < source.index(f"{name}(") < source.index("uvicorn.Server("), broken(
        f"Serve.__init__ no longer loads the model, then builds the app with {name}, then uvicorn", feature)
    routes = {path: methods for path, methods, _ in compat.serve_app_routes()}
    assert all("POST" in routes.get(path, ()) for path in ROUTES) and "GET" in routes.get("/health", ()), broken(
        f"transformers serve's app has the routes {sorted(routes)}", feature)
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler

    assert "messages" in compat.serve_handler_fields(ChatCompletionHandler), broken(
        f"ChatCompletionHandler.{compat.SERVE_HANDLER_FIELDS} no longer lists the fields it accepts",
        feature + " (what an 'Unexpected fields' refusal says is allowed)")
    assert "prompt" in compat.serve_handler_fields(CompletionHandler)


def test_the_generation_managers_give_the_guard_the_prompt_and_ways_to_stop():
    """cli/serving/utils.py: ``GenerateManager.generate_non_streaming(model, processor, inputs, gen_config,
    request_id)`` passes the inputs' keys to ``model.generate`` (the guard adds a stopping criterion there: set, the
    generation stops at its next step); ``GenerationState`` keeps continuous batching's manager in
    ``compat.SERVE_CB_STATE_ATTRIBUTE`` and it keeps its ``ContinuousBatchingManager`` in ``compat.SERVE_CB_MANAGER``,
    which cancels a request, reports a dead worker, tells its cache's size and stops at once (``hard_stop``)."""
    _serving()
    if CB_REFUSED:
        pytest.skip(f"continuous batching is refused for hf_attnorm implementations on transformers {VERSION}")
    import asyncio
    import threading
    import warnings
    from pathlib import Path
    from tempfile import TemporaryDirectory

    from test_serve import save_checkpoint
    from transformers.cli.serving.utils import GenerateManager, GenerationState

    from hf_attnorm.serve_guard import EventStop

    feature = "python -m hf_attnorm serve's request guard: stopping a generation whose client left, its bounds"
    with TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = save_checkpoint(Path(d), "symax")
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer("w1 w2 w3", return_tensors="pt")
    config = transformers.GenerationConfig(max_new_tokens=20, do_sample=False, pad_token_id=0)
    stop = threading.Event()
    stop.set()
    inputs = {**ids, "stopping_criteria": transformers.StoppingCriteriaList([EventStop(stop)])}
    _, _, generated = asyncio.run(GenerateManager().generate_non_streaming(model, tokenizer, inputs, config, "r"))
    assert len(generated) == 1, broken(f"GenerateManager.generate_non_streaming generated {len(generated)} tokens "
                                       "with a stopping criterion among its inputs that stops at once", feature)

    cb_config = transformers.ContinuousBatchingConfig(page_size=8, num_blocks=16, max_batch_tokens=16)
    state = GenerationState(continuous_batching=True, cb_config=cb_config)
    manager = state.get_manager("m", use_cb=True)
    assert getattr(state, compat.SERVE_CB_STATE_ATTRIBUTE) is manager and compat.serve_is_continuous_batching(
        manager), broken(f"GenerationState.{compat.SERVE_CB_STATE_ATTRIBUTE} is not its continuous-batching manager",
                         feature)
    cb_gen = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, use_cache=False)
    try:
        manager.init_cb(model, cb_gen)
        cb = compat.serve_continuous_batching(manager)
        assert cb is not None and callable(getattr(cb, "cancel_request", None)), broken(
            f"CBGenerateManager.{compat.SERVE_CB_MANAGER[1]} holds no ContinuousBatchingManager with cancel_request",
            feature)
        asyncio.run(manager.generate_non_streaming(model, tokenizer, {"input_ids": [1, 2, 3]}, cb_gen, "r1"))
        assert compat.serve_cache_tokens(cb) == 16 * 8, broken(
            "a running ContinuousBatchingManager no longer tells its cache's blocks and page size "
            "(batch_processor.cache.num_blocks, continuous_batching_config.page_size)", feature)
        assert compat.serve_worker_error(state) is None and state.is_cb_alive()
        assert "hard_stop" in inspect.signature(type(cb).stop).parameters
        compat.serve_stop_continuous_batching(state)
        assert not cb.is_running() and compat.serve_continuous_batching(manager) is None
    finally:
        state.shutdown()


#: (model folder, attention class, keyword): every family passing a sparse indexer's choice of keys to the attention
#: function, and what hf_attnorm reads it as (``families.SELECTION_KEYWORDS``)
SELECTING_FAMILIES = [
    ("deepseek_v32", "DeepseekV32Attention", "indices"),
    ("glm_moe_dsa", "GlmMoeDsaAttention", "indices"),
    ("hy_v4", "HYV4Attention", "indices"),
    ("hy_v4_vl", "HYV4VLAttention", "indices"),
    ("axk2", "AXK2Attention", "indices"),
    ("dots3_note", "Dots3NoteTextAttention", "indices"),
    ("mistral_large4", "MistralLarge4TextAttention", "indices"),
    ("minimax_m3_vl", "MiniMaxM3VLAttention", "block_indices"),
]


@pytest.mark.parametrize("folder, cls_name, keyword", SELECTING_FAMILIES)
def test_each_selecting_family_passes_its_indexers_keys_as_hf_attnorm_reads_them(folder, cls_name, keyword):
    """``indices``: [B, Lq, k] key positions per query (shared by the heads), which the module scatters into a mask
    of the call's keys for eager/sdpa and passes by keyword to any other implementation; ``block_indices``:
    [B, Hkv, Lq, k] key blocks of ``indexer.block_size`` keys, -1 in unused slots, which the indexer's
    ``build_block_mask`` expands (per key/value head, to the query heads of its group) for eager/sdpa."""
    import importlib
    import importlib.util

    from hf_attnorm.hf.families import SELECTION_KEYWORDS, interface_keywords, unread_selections

    if importlib.util.find_spec(f"transformers.models.{folder}") is None:  # a family newer than this transformers
        pytest.skip(f"transformers {VERSION} does not ship {folder}")
    mod = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
    cls = getattr(mod, cls_name, None)
    assert cls is not None, broken(f"{folder} has no {cls_name}", f"{keyword!r} of {folder} (key selections)")
    feature = f"{folder}'s {keyword!r}: hf_attnorm reads it as {SELECTION_KEYWORDS[keyword].meaning}"
    assert keyword in interface_keywords(cls), broken(f"{cls_name} no longer passes {keyword!r} by name", feature)
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    assert not unread_selections(module), broken(f"{cls_name}.forward no longer folds {keyword!r} into its eager/sdpa "
                                                 f"mask as {SELECTION_KEYWORDS[keyword].markers}", feature)
    if keyword == "block_indices":  # the expansion itself, against masks.selected_keys
        from hf_attnorm.masks import selected_keys

        indexer = getattr(mod, cls_name.replace("Attention", "Indexer"))
        fake = type("Fake", (), {"block_size": 2, "config": type("C", (), {"num_attention_heads": 4})()})()
        blocks = torch.tensor([[[[0, 2], [1, -1]], [[2, 2], [-1, -1]]]])  # [B=1, Hkv=2, Lq=2, k=2]
        padding = torch.ones(1, 1, 2, 5, dtype=torch.bool)
        padding[..., 0] = False
        theirs = indexer.build_block_mask(fake, blocks, padding, 5, torch.float32, "cpu", torch.arange(2)[None]) == 0
        ours = padding & selected_keys(blocks, 5, 2).repeat_interleave(2, dim=1)
        assert torch.equal(theirs, ours), broken(f"{indexer.__name__}.build_block_mask expands block indices "
                                                 "otherwise", feature)
