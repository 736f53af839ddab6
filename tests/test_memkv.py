"""Learned memory key/values (``num_mem_kv``, ``hf_attnorm/kernels/memory.py``): every path against a direct
computation (the memory concatenated by hand to k/v repeated to the query heads, run through the reference without
memory), forward and every gradient including the memory's; with any normalizer; memory per key/value head (GQA k/v
never repeated) and per query head; in models (parameters, training, save/reload, cached decoding, checkpoints of
the per-query-head shape)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import LAST_CALL, tiny

from hf_attnorm.attention import constant_heads, make_call
from hf_attnorm.hf import persistence
from hf_attnorm.kernels import attend, dispatch, run_path
from hf_attnorm.kernels.base import alibi_bias, repeat_kv
from hf_attnorm.registry import AttnormError
from hf_attnorm.settings import resolve_settings

M = 3


def direct(q, k, v, mem_k, mem_v, settings, mask, causal, heads):
    """The memory prepended by hand to k/v repeated to the H query heads (memory [Hkv, M, D] repeated as its kv
    head's keys, or [H, M, D] as is): visible to every query that sees a key, then the reference without memory."""
    B, H, Lq, D = q.shape
    Lk, Hm = k.shape[2], mem_k.shape[0]
    mk, mv = (repeat_kv(t[None].expand(B, Hm, M, t.shape[-1]), H // Hm) for t in (mem_k, mem_v))
    kk = torch.cat([mk, repeat_kv(k, H // k.shape[1])], 2)
    vv = torch.cat([mv, repeat_kv(v, H // v.shape[1])], 2)
    if mask is None:
        keep = torch.ones(1, 1, Lq, Lk, dtype=torch.bool)
        if causal and Lq > 1:
            keep = keep.tril()
    else:
        keep = mask
    has = keep.any(-1, keepdim=True)
    keep = torch.cat([has.expand(*keep.shape[:3], M), keep.expand(*keep.shape[:3], Lk)], -1)
    plain = settings.replace(num_mem_kv=0)
    call = make_call(q, kk, vv, plain, heads, keep, False)
    return attend(call, "reference")[0]


CASES = [  # (B, H, Hkv, Lq, Lk, causal, padded, memory per "kv" head or per "query" head)
    (2, 4, 2, 13, 13, True, False, "kv"),  # causal, no mask: the zero-query rewrite; GQA
    (2, 2, 1, 17, 17, True, True, "kv"),  # causal + padding, fully masked rows; MQA
    (1, 2, 2, 11, 11, False, False, "kv"),
    (2, 4, 2, 1, 9, True, False, "kv"),  # one query: a decode step; GQA
    (2, 4, 1, 5, 12, False, True, "kv"),  # cache-like shapes with padding; MQA
    (2, 4, 2, 9, 9, True, True, "query"),  # one memory per query head with GQA: k/v repeated
]
NORMS = [("softmax", "standard"), ("softmax", "ssmax"), ("sink", "standard"), ("symax", "standard"),
         ("entmax15", "standard"), ("linear", "standard"), ("selective", "standard")]


def _padding(B, Lq, Lk, causal):
    keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    keep[0, :, :, :3] = False
    keep[0, :, :2] = False
    if causal:
        keep &= torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
    return keep


@pytest.mark.parametrize("norm,scale", NORMS, ids=[f"{n}+{s}" for n, s in NORMS])
@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_every_path_matches_the_direct_computation(norm, scale, case):
    B, H, Hkv, Lq, Lk, causal, padded, per = case
    settings = resolve_settings(norm, {"scale": scale, "num_mem_kv": M, "mem_kv_init": 0.7, "mem_kv_heads": per})
    g = torch.Generator().manual_seed(Lq)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64)
               for s in ((B, H, Lq, 8), (B, Hkv, Lk, 8), (B, Hkv, Lk, 8)))
    mask = _padding(B, Lq, Lk, causal) if padded else None
    heads0 = {n: t.double() for n, t in constant_heads(settings, H, None, 8, kv_heads=Hkv).items()}
    Hm = Hkv if per == "kv" else H
    assert heads0["mem_k"].shape == heads0["mem_v"].shape == (Hm, M, 8) and heads0["mem_k"].std() > 0.3
    gout = torch.randn(B, H, Lq, 8, generator=g, dtype=torch.float64)
    info = {"max_positions": 4}

    def grads_of(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        hl = {n: t.clone().requires_grad_(True) for n, t in heads0.items()}
        out = fn(*leaves, hl)
        gr = torch.autograd.grad(out, [*leaves, *hl.values()], gout, allow_unused=True)
        return [out, *[torch.zeros(()) if t is None else t for t in gr]]

    def ours(path):
        def fn(q_, k_, v_, hl):
            call = make_call(q_, k_, v_, settings, hl, mask, causal, module_info=info)
            # what every path receives: k/v with the memory prepended, per kv head never repeated to H
            assert call.k.shape == (B, Hm, M + Lk, 8) and call.v.shape == (B, Hm, M + Lk, 8)
            out, _, ran = attend(call, path)
            assert path is None or ran == path
            return out
        return fn

    def by_hand(q_, k_, v_, hl):
        rest = {n: t for n, t in hl.items() if n not in ("mem_k", "mem_v")}
        return direct(q_, k_, v_, hl["mem_k"], hl["mem_v"], settings, mask, causal, rest)

    want = grads_of(by_hand)
    # scales read n: the memory counts as visible keys, which the direct computation's mask says too
    ran = []
    for path in (None, "reference", "chunked", "decode", "fused_cpu", "sdpa", "linear_chunked", "selective"):
        try:
            got = grads_of(ours(path))
        except ValueError as e:
            if "cannot run this call" in str(e):
                continue  # the path does not take this normalizer / shape
            raise
        ran.append(path)
        for label, a, b in zip(("out", "dq", "dk", "dv", *heads0), got, want):
            # (per-head gradients through a scale pass n, which is fp32: fp32 agreement there)
            tol = dict(atol=1e-10, rtol=1e-9) if label in ("out", "dq", "dk", "dv", "mem_k", "mem_v") else \
                dict(atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(a, b, **tol, msg=lambda m, p=path, lb=label: f"{p} {lb}: {m}")
    assert len(ran) >= 3, ran  # the rule's choice, the reference and at least one forced fast path
    if padded:
        assert (want[0][0, :, :2] == 0).all()  # fully masked rows stay 0: the memory does not open them


def test_auto_rule_keeps_the_fast_paths():
    q, kv = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8)
    for name, path in (("memkv", "sdpa"), ("symax", "fused_cpu")):
        settings = resolve_settings(name, {"num_mem_kv": 2})
        call = make_call(q, kv, kv, settings, constant_heads(settings, 4, None, 8, kv_heads=2), None, True)
        assert call.around.drop_queries == 2 and call.around.memory == 2
        assert call.k.shape == call.v.shape == (1, 2, 18, 8)
        out, _, ran = attend(call)
        assert ran == path and out.shape == (1, 4, 16, 8)


def test_memory_of_another_head_count_is_refused():
    q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    settings = resolve_settings("memkv", {"num_mem_kv": 2})
    heads = constant_heads(settings, 4, None, 8, kv_heads=2)
    with pytest.raises(ValueError, match=r"mem_k have shape \[3, 2, 8\].*Hkv=2.*H=4"):
        make_call(q, kv, kv, settings, {**heads, "mem_k": torch.zeros(3, 2, 8)}, None, True)
    with pytest.raises(ValueError, match="mem_v have shape"):
        make_call(q, kv, kv, settings, {**heads, "mem_v": torch.zeros(4, 2, 8)}, None, True)
    with pytest.raises(ValueError, match="do not divide"):
        constant_heads(settings, 4, None, 8, kv_heads=3)


def test_options_are_validated_and_default_settings_are_unchanged():
    with pytest.raises(AttnormError, match="num_mem_kv"):
        resolve_settings("symax", {"num_mem_kv": -1})
    with pytest.raises(AttnormError, match="num_mem_kv"):
        resolve_settings("symax", {"num_mem_kv": 1.5})
    with pytest.raises(AttnormError, match=r"mem_kv_heads.*\['kv', 'query'\]"):
        resolve_settings("memkv", {"mem_kv_heads": "group"})
    assert "num_mem_kv" not in resolve_settings("symax").to_dict()  # existing configs and checkpoints: unchanged
    s = resolve_settings("symax", {"num_mem_kv": 2})
    assert s.to_dict()["num_mem_kv"] == 2 and resolve_settings("symax", s.to_dict()) == s


def test_any_normalizer_in_a_model_trains_saves_and_reloads_exactly(tmp_path, monkeypatch):
    model = tiny("llama", "causal_lm", implementation="symax", attnorm={"num_mem_kv": 2})
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA: the memory is per key/value head
    params = {n: p for n, p in model.named_parameters() if n.endswith(("attnorm.mem_k", "attnorm.mem_v"))}
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert len(params) == 2 * cfg.num_hidden_layers
    assert all(p.shape == (cfg.num_key_value_heads, 2, head_dim) for p in params.values())
    seen = []  # the k heads every path of the model received: never repeated to the query heads

    def recording(call, name):  # (every call a path runs passes here)
        seen.append(call.k.shape[1])
        return run_path(call, name)

    monkeypatch.setattr(dispatch, "run_path", recording)
    x = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    model.train()
    model(x, labels=x).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params.values())
    with torch.no_grad():
        for p in params.values():
            p.add_(0.1 * p.grad)
    model.eval()
    LAST_CALL.path = ""
    with torch.no_grad():
        logits = model(x).logits
    assert LAST_CALL.path == "fused_cpu"
    model.save_pretrained(tmp_path / "m")
    again = type(model).from_pretrained(tmp_path / "m")
    reloaded = dict(again.named_parameters())
    for n, p in params.items():
        assert torch.equal(reloaded[n], p), n
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, logits, atol=0, rtol=0)
        # cached decoding: the memory is not in the cache, and every step sees it
        gen = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
        a = again.generate(x, use_cache=True, **gen)
        b = again.generate(x, use_cache=False, **gen)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        torch.testing.assert_close(sa, sb, atol=1e-5, rtol=0)
    assert len(seen) > 4 * cfg.num_hidden_layers and set(seen) == {cfg.num_key_value_heads}


def test_a_checkpoint_with_memory_per_query_head_is_refused_clearly_or_loaded_exactly(tmp_path):
    """Memory saved per query head ([H, M, D], the shape before memory became per kv head) on a GQA model: the
    default (per kv head) refuses it naming the option; with ``mem_kv_heads="query"`` it loads and runs unchanged."""
    model = tiny("llama", "causal_lm", implementation="symax", attnorm={"num_mem_kv": 2, "mem_kv_heads": "query"})
    cfg = model.config
    key = next(n for n, _ in model.named_parameters() if n.endswith("attnorm.mem_k"))
    assert model.get_parameter(key).shape[0] == cfg.num_attention_heads > cfg.num_key_value_heads
    x = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(x).logits
    out = tmp_path / "old"
    model.save_pretrained(out)
    # as the older version wrote it: no mem_kv_heads in config.json nor in the safetensors metadata
    saved = json.loads((out / "config.json").read_text())
    del saved["attnorm"]["mem_kv_heads"]
    (out / "config.json").write_text(json.dumps(saved))
    for f in persistence.weight_files(out):
        meta = json.loads(persistence.read_safetensors_header(f)["__metadata__"][persistence.METADATA_KEY])
        del meta["mem_kv_heads"]
        persistence.write_safetensors_metadata(f, {persistence.METADATA_KEY: json.dumps(meta, sort_keys=True)})
    (out / persistence.CHECKSUM_FILE).unlink()
    with pytest.raises(persistence.CheckpointError, match=r"mem_k has shape \[4, 2, 8\].*'mem_kv_heads': 'query'"):
        type(model).from_pretrained(out)
    again = type(model).from_pretrained(out, attnorm={"num_mem_kv": 2, "mem_kv_heads": "query"})
    assert again.get_parameter(key).shape == model.get_parameter(key).shape
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, logits, atol=0, rtol=0)


def test_alibi_skips_the_memory_keys():
    """ALiBi distances count the real keys only (the memory has no position): materialised before the prepend, even
    for normalizers whose fused kernels compute ALiBi in place."""
    B, H, L = 1, 2, 11
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, L, 8, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    for name in ("softmax", "symax"):
        settings = resolve_settings(name, {"num_mem_kv": M})
        heads = {n: t.double() for n, t in constant_heads(settings, H, None, 8).items()}
        call = make_call(q, k, v, settings, heads, None, True, alibi_slopes=slopes)
        ours, _, ran = attend(call)
        kk = torch.cat([heads["mem_k"][None], k], 2)
        vv = torch.cat([heads["mem_v"][None], v], 2)
        keep = torch.cat([torch.ones(L, M, dtype=torch.bool), torch.ones(L, L, dtype=torch.bool).tril()], -1)
        bias = torch.nn.functional.pad(alibi_bias(slopes, L, L), (M, 0))
        plain = settings.replace(num_mem_kv=0)
        rest = {n: t for n, t in heads.items() if n not in ("mem_k", "mem_v")}
        want, _, _ = attend(make_call(q, kk, vv, plain, rest, keep[None, None], False, bias=bias), "reference")
        torch.testing.assert_close(ours, want, atol=1e-10, rtol=0, msg=f"{name} on {ran}")
