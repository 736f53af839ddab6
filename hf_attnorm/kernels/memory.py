"""Learned memory key/values (x-transformers' ``num_mem_kv``): M learned keys and values per head, prepended to the
keys and values of every call, with any normalizer on top.

Option ``num_mem_kv`` (default 0 = off) is accepted with every normalizer and scale
(``attn_implementation="symax", attnorm={"num_mem_kv": 4}``); the preset ``memkv`` is softmax with 4 of them. The
values are parameters ``mem_k`` [Hkv, M, D] and ``mem_v`` [Hkv, M, D] (``ParamSpec(heads="kv")``: one memory per
key/value head, as x-transformers' ``nn.Parameter(torch.randn(kv_heads, num_mem_kv, dim_head))``, prepended to k/v
before its ``Attend`` expands them to the query heads), initialised N(0, mem_kv_init^2) (x-transformers:
``torch.randn``, std 1) and learnable unless ``mem_kv_learnable=false``.

Semantics (what every path computes, since the step runs in ``make_call`` before any kernel):

* per key/value head (option ``mem_kv_heads="kv"``, the default): the query heads of a GQA group share their kv
  head's memory, exactly as they share its keys, so k' = [mem_k, k] keeps Hkv heads and no path repeats anything
  (the kernels take GQA k/v natively). Without GQA (Hkv = H) this is one memory per head, as before.
  ``mem_kv_heads="query"`` keeps one memory per query head ([H, M, D], the shape hf_attnorm saved for every model
  before memory became per key/value head): with GQA a memory slot may then differ between the query heads of a
  group, which k/v shared by the group cannot express, so k/v ARE repeated to the H query heads (O(n d H / Hkv)
  copies). It loads checkpoints saved with that shape exactly (a GQA checkpoint of [H, M, D] memory is refused by
  the default when loaded, with an error naming this option) and keeps the per-query-head freedom for whoever wants
  it. The tensor API (``make_call``) reads which one from the tensors' leading dim (Hkv or H);
* the memory keys come first, are never position-encoded (RoPE was applied to k before the attention function) and
  take no score bias (T5/ALiBi bias 0); they are visible to every query that sees at least one real key: not
  causal-masked, not padded, while a query with no visible key (a padded row) stays at exactly 0;
* they count in n (the visible keys a length-aware scale reads): n = M + the real visible keys;
* the KV cache holds only the real keys (the memory is prepended inside the attention function), so cached decoding
  is exact; the weights returned for ``output_attentions`` cover the real keys only ([B, H, Lq, Lk], as the model
  expects), so their rows sum to 1 minus the memory's share.

How: k' = [mem_k, k], v' = [mem_v, v]; with an explicit keep-mask, M leading columns equal to "the row sees some
key"; with the structured causal pattern (no mask, several queries), M zero queries are prepended too, so query
i + M sees keys j' <= i + M (the memory and keys 0..i) in the upper-left causal convention every path implements,
and their output rows are dropped by ``attend`` (``Around.drop_queries``, kernels/variants.py). Zero queries select
nothing from a selective head and cost M extra rows (M << L).
"""

from __future__ import annotations

import dataclasses

import torch

from ..masks import MaskInfo, build_mask_info
from ..normalizers.base import ParamSpec
from ..registry import PRESETS, Preset
from ..settings import AttnormSettings, declare_option, nonnegative
from .base import repeat_kv

NUM_MEM_KV = declare_option("num_mem_kv", int, 0, "learned memory key/values per head prepended to every row's keys "
                            "(x-transformers num_mem_kv; 0 = off), with any normalizer", check=nonnegative,
                            everywhere=True)
MEM_KV_INIT = declare_option("mem_kv_init", float, 1.0, "memory key/values: std of their normal initialisation "
                             "(x-transformers: 1)", check=nonnegative, everywhere=True)
MEM_KV_LEARNABLE = declare_option("mem_kv_learnable", bool, True, "memory key/values: learn them (else constants)",
                                  everywhere=True)

MEM_KV_HEADS = declare_option("mem_kv_heads", str, "kv", "memory key/values: one per key/value head ('kv', as "
                               "x-transformers; GQA k/v are not repeated) or per query head ('query': [H, M, D], "
                               "the shape saved before; with GQA k/v are then repeated)", choices=("kv", "query"),
                               everywhere=True)

#: per key/value head ([Hkv, M, D], the default) and per query head ([H, M, D]); the same parameter names
MEM_K = ParamSpec("mem_k", MEM_KV_INIT, MEM_KV_LEARNABLE, "learned memory keys [Hkv, num_mem_kv, head_dim]",
                  shape=(NUM_MEM_KV, "head_dim"), init="normal", heads="kv")
MEM_V = ParamSpec("mem_v", MEM_KV_INIT, MEM_KV_LEARNABLE, "learned memory values [Hkv, num_mem_kv, head_dim]",
                  shape=(NUM_MEM_KV, "head_dim"), init="normal", heads="kv")
MEM_K_PER_QUERY = dataclasses.replace(MEM_K, help="learned memory keys [H, num_mem_kv, head_dim]", heads="query")
MEM_V_PER_QUERY = dataclasses.replace(MEM_V, help="learned memory values [H, num_mem_kv, head_dim]", heads="query")

PRESETS.add("memkv", Preset("memkv", "softmax with 4 learned memory key/values per head (x-transformers "
                            "num_mem_kv)", {"normalizer": "softmax", "scale": "standard", NUM_MEM_KV: 4}))


def memory_specs(settings: AttnormSettings) -> tuple[ParamSpec, ...]:
    """The memory's per-head values when the settings use it (num_mem_kv > 0), else ()."""
    if settings.options.get(NUM_MEM_KV, 0) <= 0:
        return ()
    return (MEM_K, MEM_V) if settings.options.get(MEM_KV_HEADS, "kv") == "kv" else (MEM_K_PER_QUERY, MEM_V_PER_QUERY)


def _no_memo() -> bool:
    # as masks._no_cache: nothing may persist across a traced graph or out of inference_mode
    return torch.compiler.is_compiling() or torch.is_inference_mode_enabled()


def prepend_memory(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskInfo, bias: torch.Tensor | None,
    mem_k: torch.Tensor, mem_v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MaskInfo, torch.Tensor | None, int]:
    """q [B, H, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], mem_k / mem_v [Hkv, M, D] (per key/value head) or
    [H, M, D] (per query head) -> (q', k' [B, Hkv or H, M + Lk, D], v' [B, Hkv or H, M + Lk, Dv], mask', bias',
    drop): the call with the memory keys first (see the module docstring); ``drop`` leading query rows (zero
    queries) are to be dropped from the output. Per key/value head, k/v keep their Hkv heads (no GQA copies)."""
    B, H, Lq, D = q.shape
    Hkv = k.shape[1]
    Hm, M = mem_k.shape[:2] if mem_k.dim() == 3 else (-1, -1)
    if Hm not in (Hkv, H) or mem_k.shape[-1] != D:
        raise ValueError(f"memory keys mem_k have shape {list(mem_k.shape)}; this call needs [Hkv={Hkv}, M, D={D}] "
                         f"(one memory per key/value head) or [H={H}, M, D={D}] (per query head)")
    if mem_v.dim() != 3 or mem_v.shape[:2] != mem_k.shape[:2] or mem_v.shape[2] != v.shape[-1]:
        raise ValueError(f"memory values mem_v have shape {list(mem_v.shape)} but the values have head dimension "
                         f"{v.shape[-1]}: num_mem_kv needs [{Hm}, M={M}, Dv={v.shape[-1]}] like mem_k (memory values "
                         "are made with head_dim, so modules whose value head dim differs from q/k's are not "
                         "supported)")
    if Hm != Hkv:  # per query head with GQA: the group's query heads see different memory, so k/v are repeated
        k, v = repeat_kv(k, H // Hkv), repeat_kv(v, H // Hkv)
    k = torch.cat([mem_k.to(k.dtype)[None].expand(B, Hm, M, D), k], dim=2)
    v = torch.cat([mem_v.to(v.dtype)[None].expand(B, Hm, M, v.shape[-1]), v], dim=2)
    Lk = k.shape[2]
    drop = 0
    key = ("memory", M, B, H)
    derived = mask.derived.get(key)
    if mask.keep is None:
        if mask.causal:  # structured causal pattern: M zero queries keep it upper-left (module docstring)
            drop = M
            q = torch.cat([q.new_zeros(B, H, M, D), q], dim=2)
        if derived is None:
            derived = build_mask_info(None, B, H, Lq + drop, Lk, mask.causal, q.device)
    elif derived is None:
        keep = mask.keep
        b, h = max(keep.shape[0], mask.has_keys.shape[0]), max(keep.shape[1], mask.has_keys.shape[1])
        cols = mask.has_keys[..., None].expand(b, h, Lq, M)
        derived = build_mask_info(torch.cat([cols, keep.expand(b, h, Lq, Lk - M)], dim=-1), B, H, Lq, Lk,
                                  mask.causal, q.device, remember=False)
        derived.selected = mask.selected  # (a key selection stays one with the memory columns in front)
    if not _no_memo():
        mask.derived[key] = derived
    if bias is not None:  # no bias on the memory columns (nor on the zero queries' rows)
        if bias.shape[3] == 1:
            bias = bias.expand(*bias.shape[:3], Lk - M)
        bias = torch.nn.functional.pad(bias, (M, 0, drop if bias.shape[2] > 1 else 0, 0))
    return q, k, v, derived, bias, drop
