"""Exact rewrites of the softmax family onto ``scaled_dot_product_attention`` (SDPA).

* every per-query scale (log n, SSMax, alpha*(n), ...): q rows are multiplied by base x multiplier (autograd
  carries the gradient to learnable factors such as ``ssmax_s``), SDPA runs with ``scale=1`` (a
  constant factor alone goes to SDPA's ``scale`` instead);
* ``cosine``: q and k are l2-normalised first (the normalizer's own ``transform_qk``), then as above;
* ``softmax_n`` / ``sink``: an always-visible extra logit lambda (ln n_extra, or sigma_h per head) with value 0.
  Path ``sdpa`` (CPU) uses SDPA's CPU flash kernel, which returns the row log-sum-exp L:
  out' = out * exp(L - L') with L' = logaddexp(L, lambda), and the flash backward fed with (out', L') is exactly
  the backward of softmax over the keys plus the sink; d lambda = -sum_i exp(lambda - L'_i) (dO_i . out'_i).
  No extra key, no extra feature, masks and causality unchanged. Path ``sdpa_sinkcol`` (any device) appends one
  feature instead: q' = [q, lambda], k' = [k, 0], plus a prepended key [0, 1] with value 0 that every query sees
  (with a causal call and no mask, a prepended zero query keeps the upper-left causal pattern aligned; its row is
  dropped). It is exact but D+1 falls off SDPA's fast kernels (several times slower, and on a GPU the math backend
  with its [B, H, Lq, Lk] weights), so the rule uses it only where the lse rewrite cannot run. On CUDA the lse
  rewrite runs the flash kernel's own ops (``_SinkCUDA``): ``_scaled_dot_product_flash_attention`` for half-precision
  calls without a mask (causal or not; GQA natively), ``_scaled_dot_product_efficient_attention`` (with the keep-mask
  as SDPA itself passes it, an additive bias) otherwise; both return the log-sum-exp and take (out', L') in their
  backward, so memory is SDPA's.
* forgetting attention (``AttnCall.forget``), F_ij = -|c_{p_i} - c_j|. On a CPU, a call of several queries whose
  visible keys all precede the query's own key (causal, or key padding x causal) runs SDPA's CPU flash kernel on
  blocks of query rows (``_ForgetFlash``), O(n) memory beside one mask block of at most ``FORGET_BIAS_ELEMENTS``:
  there F_ij = c_{p_i} - c_j, and with c = hi + lo split into two fp32 numbers the block's float mask holds
  hi_{p_i} - hi_j (exact for near keys, however large c grows with the length), while lo goes into the values:
  v' = [e^{-lo_j} v_j, e^{-lo_j}], out = v'-weighted sum / its last column, which is softmax with the exact decay.
  The gradient of c comes from two extra features, q' = [s q, 1, 0], k' = [k, 0, 1], which leave the scores as they
  are: the flash backward's dk' of the first is the column sum sum_i dS_ij, its dq' of the second the row sum
  sum_j dS_ij, and dc_t = row sum of the query at key t - column sum of key t. A single fp32
  feature -c_j in k instead would round every score at the magnitude of the whole decay (1e-4 at 2048 keys and
  f = 1/2, 100x the reference path's error). Elsewhere the bias goes in SDPA's float mask, materialised, for calls
  whose bias is small (decode steps, short sequences; with a gradient, SDPA's own autograd gives the bias's); a
  larger causal call without gradients runs SDPA on blocks of query rows with the decay as a per-key bias
  (``_forget_blocks``); the rest go to ``chunked``, which forms the bias per chunk (O(n) memory).
* a decode step on a CPU (one query, no autograd) with enough keys (``one_query_runs``) runs
  ``one_query_softmax`` (two matrix products with a kv head's query heads as one matrix) instead of the CPU flash
  kernel, which is slower for one long row per head; the sink's rescale takes its log-sum-exp alike. Plain softmax
  (normalizer ``softmax``, standard scale, no learned memory) keeps SDPA's own kernel even there: it is the
  baseline, the very call transformers' sdpa makes.

Fully masked rows give 0 with finite gradients; fp16/bf16 on CPU are computed in fp32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from ..normalizers.base import Normalizer
from ..torch_compat import FLASH_CPU_GQA, FLASH_CPU_GQA_FEATURE, is_exporting, warn_fallback
from . import triton_rows
from .base import (
    AttnCall,
    compute_dtype,
    factored_query,
    has_query_factor,
    one_query_ctx,
    one_query_runs,
    one_query_softmax,
    query_factor,
    repeat_kv,
)
from .memory import memory_specs


def takes(norm: Normalizer) -> str | None:
    """The softmax family (declared ``kernel_family = "softmax"``) without a feature map."""
    if norm.kernel_family != "softmax":
        return f"normalizer {norm.name!r} is not in the softmax family (kernel_family {norm.kernel_family!r})"
    if type(norm).feature_map is not Normalizer.feature_map:
        return f"normalizer {norm.name!r} has a feature map"
    return None


def takes_sink(norm: Normalizer) -> str | None:
    """The softmax family with a sink logit (a normalizer that overrides ``sink_logit``)."""
    why = takes(norm)
    if why is None and type(norm).sink_logit is Normalizer.sink_logit:
        why = f"normalizer {norm.name!r} has no sink logit (sdpa_sinkcol is for those with one)"
    return why


def sink_logit(call: AttnCall, dtype: torch.dtype) -> torch.Tensor | None:
    """lambda: 0-d or [H] (autograd-connected to a learned sink), from the normalizer's declaration, combined with
    the call's attention sinks (s_aux [H]) as log(e^lambda + e^s_aux); None without any sink."""
    lam = call.normalizer.sink_logit(call.ctx(), dtype)
    if lam is not None:
        lam = lam.to(call.q.device)
    if call.sinks is None:
        return lam
    aux = call.sinks.to(device=call.q.device, dtype=dtype)
    return aux if lam is None else torch.logaddexp(lam, aux)


def _has_sink(call: AttnCall) -> bool:
    """Whether the call has a sink logit (its own or s_aux), from the settings alone (no tensor is built or read)."""
    if call.sinks is not None:
        return True
    norm = call.normalizer
    if type(norm).sink_logit is Normalizer.sink_logit:
        return False
    return not (call.settings.normalizer == "softmax_n" and call.settings.n_extra == 0)


def _bias_grad(call: AttnCall) -> bool:
    """A score bias that needs a gradient (T5's learned position bias while training): the flash kernel's backward
    gives none to its mask, so such calls take SDPA's own autograd (metadata only, nothing is read)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (call.bias, call.forget))


def _common(call: AttnCall) -> str | None:
    """What both SDPA paths need: inputs, a float dtype (a bias goes in SDPA's float mask, sinks in the sink logit;
    SDPA cannot soft-cap the scores, and ALiBi arrives as a bias: make_call materialises it for the softmax family)."""
    if call.q.numel() == 0 or call.k.shape[2] == 0:
        return "empty inputs"  # SDPA's CPU kernel crashes (SIGFPE) on zero keys
    if not call.q.dtype.is_floating_point:
        return f"dtype {call.q.dtype}"
    return None


def _one_query(call: AttnCall, causal: bool) -> bool:
    """A CPU call ``one_query_softmax`` runs (module docstring): one query per head and enough keys
    (``one_query_runs``), no autograd, not traced or exported, not plain softmax (the baseline keeps SDPA's own
    kernel)."""
    return (call.q.shape[2] == 1 and one_query_runs(call.k.shape[2]) and not causal
            and not torch.is_grad_enabled() and call.q.device.type == "cpu" and not torch.compiler.is_compiling()
            and not is_exporting() and not _plain_softmax(call.settings))


def _plain_softmax(settings: Any) -> bool:
    """Calls of these settings are transformers' own SDPA call (normalizer softmax, no per-query factor, no learned
    memory)."""
    return settings.normalizer == "softmax" and not has_query_factor(settings) and not memory_specs(settings)


def _uses_flash_cpu(call: AttnCall) -> bool:
    dt = compute_dtype(call.q.dtype)
    return (call.q.device.type == "cpu" and call.dropout == 0 and call.v.shape[-1] == call.q.shape[-1]
            and dt in (torch.float32, torch.float64) and not _bias_grad(call))


#: the largest forget bias (B x H x Lq x Lk entries) this path materialises: 2^24 fp32 entries are 64 MB
FORGET_BIAS_ELEMENTS = 1 << 24


def _forget_too_large(call: AttnCall) -> bool:
    B, H, Lq, Lk = call.q.shape[0], call.q.shape[1], call.q.shape[2], call.k.shape[2]
    return B * H * Lq * Lk > FORGET_BIAS_ELEMENTS


def _forget_keys_precede(call: AttnCall) -> bool:
    """Every key a query sees lies at or before the query's own key p_i = Lk - Lq + i, so its decay is
    c_{p_i} - c_j: a causal call (Lq <= Lk; causal here is upper-left, j <= i <= p_i), a single query, or a given mask
    that is key padding x causal with an offset of at most Lk - Lq (``MaskInfo.padding``: read once per mask, unknown
    under torch.compile)."""
    m, lq, lk = call.mask, call.q.shape[2], call.k.shape[2]
    if lq > lk:
        return False
    if m.keep is None:
        return m.causal or lq == 1
    pad = m.padding()
    return pad is not None and (lq == 1 or (pad[2] and pad[3] <= lk - lq))


def _forget_by_flash(call: AttnCall) -> bool:
    """The decay through SDPA's CPU flash kernel on row blocks (module docstring): a CPU call of several queries in
    fp32/fp64 compute without sink or dropout whose visible keys precede the query, on a torch whose CPU flash op
    is called directly (not under torch.export, whose ONNX translation of it is wrong with masks). Decode steps
    (one query) keep the materialised bias, which is as cheap there."""
    return (call.forget is not None and call.q.device.type == "cpu" and call.q.shape[2] > 1 and call.dropout == 0
            and not _has_sink(call) and compute_dtype(call.q.dtype) in (torch.float32, torch.float64)
            and not is_exporting() and _forget_keys_precede(call))


def _forget_rows(B: int, H: int, Lq: int, Lk: int) -> int:
    """Query rows per block of ``_ForgetFlash``: Lq / 8 within [64, 256], and the block's mask [B, H, rows, <= Lk] at
    most ``FORGET_BIAS_ELEMENTS`` entries. The kernel computes a whole block, so the keys after a causal block's
    queries cost rows / (2 Lq) of the work; short blocks cost calls. Measured (fox fwd+bwd over SDPA softmax, B1 H8
    d64, 2 threads): at n = 1024 one block 2.10x, 128 rows 1.25x, 64 rows 1.33x; at n = 4096 512 rows 1.42x,
    256 rows 1.31x, 128 rows 1.48x."""
    return max(1, min(FORGET_BIAS_ELEMENTS // (B * H * Lk), max(64, min(256, Lq // 8))))


class _ForgetFlash(torch.autograd.Function):
    """SDPA's CPU flash kernel per block of query rows with forgetting attention's decay in the block's mask.

    q2: [B, H, Lq, W] = [s q, 1, 0, 0...], k2: [B, H, Lk, W] = [k, 0, 1, 0...], v2: [B, H, Lk, W] = [e^-lo v, e^-lo,
    0...] (W = max(D, Dv) + 2, q2's 1 at ``one_at``, k2's at ``one_at + 1``; k and v repeated to the query heads,
    as the decay is per query head); hi: [B, H, Lk] (fp32, or fp64 for fp64 calls); extra: None or the other
    additive mask terms (``_float_mask``), float [B|1, H|1, Lq, Lk] with -inf where hidden; causal:
    no keep-mask, query i sees keys j <= i. Returns out2 [B, H, Lq, W]. The two features leave the scores as they
    are and give the flash backward's column sums sum_i dS_ij (dk2 at ``one_at``) and row sums sum_j dS_ij (dq2 at
    ``one_at + 1``): dhi_j = -colsum_j + rowsum of the query at key j. The row sums vanish in exact arithmetic
    (softmax), but kept they pair each dS_ij with the decay between i and j, as the reference's gradient does:
    without them the fp32 rounding of the row sums reaches the gate parameters multiplied by the whole length."""

    @staticmethod
    def forward(ctx, q2, k2, v2, hi, extra, causal: bool, one_at: int):
        B, H, Lq, _ = q2.shape
        Lk = k2.shape[2]
        rows = _forget_rows(B, H, Lq, Lk)
        buf = q2.new_empty(B, H, min(rows, Lq), Lk)
        out, lse = q2.new_empty(q2.shape), q2.new_empty(B, H, Lq)
        for r0 in range(0, Lq, rows):
            r1 = min(Lq, r0 + rows)
            mask, t1 = _forget_mask(hi, extra, Lq, r0, r1, causal, buf)
            o, lse_block = _FLASH(q2[:, :, r0:r1], k2[:, :, :t1], v2[:, :, :t1], 0.0, False, attn_mask=mask,
                                  scale=1.0)[:2]
            out[:, :, r0:r1], lse[:, :, r0:r1] = o, lse_block
        ctx.save_for_backward(q2, k2, v2, hi, extra, out, lse)
        ctx.causal, ctx.one_at = causal, one_at
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q2, k2, v2, hi, extra, out, lse = ctx.saved_tensors
        B, H, Lq, _ = q2.shape
        Lk = k2.shape[2]
        rows = _forget_rows(B, H, Lq, Lk)
        buf = q2.new_empty(B, H, min(rows, Lq), Lk)
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q2), torch.zeros_like(k2), torch.zeros_like(v2)
        for r0 in range(0, Lq, rows):
            r1 = min(Lq, r0 + rows)
            mask, t1 = _forget_mask(hi, extra, Lq, r0, r1, ctx.causal, buf)
            gq, gk, gv = _FLASH_BWD(dout[:, :, r0:r1], q2[:, :, r0:r1], k2[:, :, :t1], v2[:, :, :t1],
                                    out[:, :, r0:r1], lse[:, :, r0:r1], 0.0, False, attn_mask=mask, scale=1.0)
            dq[:, :, r0:r1] = gq
            dk[:, :, :t1] += gk
            dv[:, :, :t1] += gv
        dhi = -dk[..., ctx.one_at]
        dhi[..., Lk - Lq:] += dq[..., ctx.one_at + 1]
        return dq, dk, dv, dhi, None, None, None


def _forget_mask(hi: torch.Tensor, extra: torch.Tensor | None, lq: int, r0: int, r1: int, causal: bool,
                 buf: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(mask [B, H, r1 - r0, t1], t1) for query rows [r0, r1) of ``_ForgetFlash``: hi_{p_i} - hi_j, p_i = Lk - Lq + i,
    over the keys [0, t1) the rows may see: causal, t1 = r1 and -inf after key i (only the block's own square
    has such keys); otherwise t1 = p_{r1 - 1} + 1 (``_forget_keys_precede``: no later key is visible), then plus
    ``extra``. Written into ``buf``; one pass over the block without ``extra``."""
    off = hi.shape[-1] - lq
    t1 = r1 if causal else off + r1
    m = buf[:, :, : r1 - r0, :t1]
    torch.sub(hi[..., off + r0:off + r1, None], hi[..., None, :t1], out=m)
    if causal:
        n = r1 - r0
        m[..., r0:r1].masked_fill_(torch.ones(n, n, dtype=torch.bool, device=m.device).triu(1), float("-inf"))
    if extra is not None:
        m.add_(extra[:, :, r0:r1, :t1])
    return m, t1


def _forget_flash(call: AttnCall) -> torch.Tensor:
    """out [B, H, Lq, Dv] of a forget call through ``_ForgetFlash`` (module docstring)."""
    dt = compute_dtype(call.q.dtype)
    q, k, v, scale = _prepare(call, dt)
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[-1]
    k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])
    c = call.forget  # [B, H, Lk], float64
    hi = c.to(dt)
    # e^{-lo} per key, lo = c - hi (what fp32 rounded away), no gradient (c's comes through hi)
    weight = torch.exp(hi.detach().to(c.dtype) - c.detach()).to(dt).unsqueeze(-1)
    width = max(D, Dv) + 2
    q2 = torch.cat([q * scale if scale != 1.0 else q, q.new_ones(B, H, Lq, 1),
                    q.new_zeros(B, H, Lq, width - D - 1)], dim=-1)
    k2 = torch.cat([k, k.new_zeros(B, H, Lk, 1), k.new_ones(B, H, Lk, 1), k.new_zeros(B, H, Lk, width - D - 2)],
                   dim=-1)
    v2 = torch.cat([v * weight, weight, v.new_zeros(B, H, Lk, width - Dv - 1)], dim=-1)
    keep = call.mask.keep
    extra = _float_mask(dataclasses.replace(call, bias=call.score_bias(with_forget=False)), keep, dt)
    out2 = _ForgetFlash.apply(q2, k2, v2, hi, extra, keep is None and call.mask.causal, D)
    den = out2[..., Dv:Dv + 1]  # sum_j P_ij e^{-lo_j}: 0 on rows that see no key
    out = torch.where(den > 0, out2[..., :Dv] / den.clamp_min(torch.finfo(dt).tiny), 0.0)
    return out.to(call.q.dtype)


def _forget_reason(call: AttnCall) -> str | None:
    """Why this path leaves a forget call to ``chunked`` (module docstring), or None. Shapes and flags only (and a
    given mask's padding form, read once per mask)."""
    if call.forget is None or not _forget_too_large(call) or _forget_by_flash(call):
        return None
    if (call.needs_grad or _has_sink(call) or call.dropout > 0 or call.mask.kind != "causal"
            or call.q.shape[2] > call.k.shape[2]):
        return (f"a forget gate over B x H x Lq x Lk > {FORGET_BIAS_ELEMENTS} scores, other than a causal call "
                "(Lq <= Lk) without gradients, sink or dropout (chunked keeps O(n) memory)")
    return None


def _forget_blocks(call: AttnCall) -> torch.Tensor:
    """out [B, H, Lq, Dv] of a large causal forget call (Lq <= Lk) without gradients: SDPA on blocks of query rows,
    each with a float mask of at most ``FORGET_BIAS_ELEMENTS`` entries. On a causal row the decay c_{p_i} - c_j is a
    per-row constant (which softmax ignores) minus c_j, so the mask is the causal -inf plus -c_j, with c re-based at
    the block's first query in float64 before the cast: near keys keep their precision, and a far key's rounding
    (|F| x 6e-8) is tiny against its weight exp(-|F|)."""
    dt = compute_dtype(call.q.dtype)
    q, k, v, scale = _prepare(call, dt)
    B, H, Lq, Lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    rows = max(1, FORGET_BIAS_ELEMENTS // (B * H * Lk))
    # causal as everywhere here: query i sees keys j <= i (upper-left); with Lq <= Lk, j <= i <= p_i = Lk - Lq + i,
    # so every visible key lies before the query's forget position and the decay is c_{p_i} - c_j
    causal = torch.zeros(Lq, Lk, dtype=dt, device=q.device).masked_fill_(
        ~torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    bias = call.score_bias(with_forget=False)
    outs = []
    for r0 in range(0, Lq, rows):
        r1 = min(Lq, r0 + rows)
        keys = -(call.forget - call.forget[..., max(0, Lk - Lq + r0), None]).to(dt)  # [B, H, Lk]
        mask = causal[r0:r1] + keys[:, :, None, :]
        if bias is not None:
            mask = mask + bias[:, :, r0:r1 if bias.shape[2] > 1 else 1].to(dt)
        outs.append(F.scaled_dot_product_attention(q[:, :, r0:r1], k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=H != k.shape[1]))
    return torch.cat(outs, dim=2).to(call.q.dtype)


def accepts(call: AttnCall) -> str | None:
    """sdpa: softmax / cosine anywhere (dropout ok); a sink through the lse rewrite (SDPA's CPU flash kernel, on CUDA
    its flash or efficient kernel: ``sink_backend``); a forget gate when its bias is small."""
    why = _common(call) or _forget_reason(call)
    if why is None and _has_sink(call) and is_exporting():
        # the lse rewrite's CPU flash op does not translate to ONNX with a sink; the extra-column rewrite does
        return "a sink under torch.export (sdpa_sinkcol exports it as plain SDPA)"
    if why is None and _has_sink(call) and not _uses_flash_cpu(call) and sink_backend(call) is None:
        reason = ("dropout > 0" if call.dropout > 0 else "head dims of v and q differ"
                  if call.v.shape[-1] != call.q.shape[-1] else "a score bias that needs a gradient"
                  if _bias_grad(call) else
                  f"device {call.q.device}, dtype {call.q.dtype}, head dim {call.q.shape[-1]}")
        why = (f"the lse rewrite of the sink needs SDPA's CPU flash kernel, or on CUDA its flash or efficient kernel "
               f"(head dim a multiple of 8 up to 256) ({reason}); see sdpa_sinkcol")
    return why


def _prepare(call: AttnCall, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(q, k, v, scale) for SDPA in ``dtype``: q, k transformed and the per-query factor base x multiplier multiplied
    into q, or, when it is one number (no per-query scale), left to SDPA's ``scale`` (no extra pass over q).
    The transform and the factor are computed in fp32 when ``dtype`` is fp16/bf16 (a GPU's SDPA runs in the model
    dtype) and rounded once: a norm taken in bf16, or a learned scale whose gradient sums bf16 products, loses
    several bits more than SDPA itself. On a GPU in fp16/bf16 that is one fused pass per tensor (``triton_rows``:
    the factor, and cosine's l2-normalisation of q and k, in fp32 inside); keys without a transform are not copied."""
    work = compute_dtype(dtype)
    norm = call.normalizer
    transform = type(norm).transform_qk is not Normalizer.transform_qk
    factor = call.q_factor(work)
    v = call.v.to(dtype)
    if call.q.dtype == dtype and triton_rows.usable(call.q) and (not transform or norm.qk_norm_eps is not None):
        if transform:
            return (triton_rows.row_scale(call.q, factor, True, norm.qk_norm_eps),
                    triton_rows.row_scale(call.k, 1.0, True, norm.qk_norm_eps), v, 1.0)
        if isinstance(factor, float):
            return call.q, call.k, v, factor
        return triton_rows.row_scale(call.q, factor), call.k, v, 1.0
    kept = call.k_transformed
    if transform and kept is not None and kept.dtype == work:  # the keys' transform kept across decoding
        # (row-wise: q's transform is the same with any keys beside it; one key is the least work)
        q, k = norm.transform_qk(call.q.to(work), kept[:, :, :1], call.ctx())[0], kept
    elif transform:
        q, k = norm.transform_qk(call.q.to(work), call.k.to(work), call.ctx())  # row-wise: fine on unrepeated k
    else:
        q, k = call.q.to(work), call.k
    k = k.to(dtype)
    if isinstance(factor, float):
        return q.to(dtype), k, v, factor
    return (q * factor).to(dtype), k, v, 1.0


def _sdpa_mask(call: AttnCall) -> tuple[torch.Tensor | None, bool]:
    """(keep or None, is_causal) for SDPA. A given mask is passed as is, even when it is all-visible or exactly
    causal: finding out would read it on the host (a sync per call, a graph break under torch.compile), and
    transformers already passes None when nothing beyond causality is masked."""
    m = call.mask
    return m.keep, (m.keep is None and m.causal)


def _float_mask(call: AttnCall, keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The float mask SDPA adds to the scores: without a bias the keep-mask as 0 / -inf (built once per mask),
    with one the bias where visible and -inf elsewhere, [B|1, H|1, Lq, Lk] (SDPA broadcasts the leading dims only)."""
    bias = call.bias
    if bias is None:
        return None if keep is None else call.mask.additive(dtype)
    bias = bias.to(dtype)
    if keep is not None:
        bias = bias.masked_fill(~keep, float("-inf"))
    return bias.expand(*bias.shape[:2], call.q.shape[2], call.k.shape[2])


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _with_sink(out: torch.Tensor, lse: torch.Tensor, lam: torch.Tensor,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash op's out [B, H, Lq, Dv] and log-sum-exp L [B, H, Lq] with the sink logit lambda (0-d or [H]) among
    the keys: (out e^(L - L'), L'), L' = logaddexp(L, lambda); with the float ``mask``, rows that see no key (out 0,
    L 0 from the kernel) get L' = lambda."""
    lam_b = lam.view(1, -1, 1) if lam.dim() == 1 else lam
    lse_all = torch.logaddexp(lse, lam_b)
    if mask is not None:
        lse_all = torch.where(torch.isinf(mask).all(-1), lam_b.expand_as(lse_all), lse_all)
    return out * torch.exp(lse - lse_all).unsqueeze(-1), lse_all


class _FlashCPU(torch.autograd.Function):
    """SDPA's CPU flash kernel with an optional sink logit lambda (0-d or [H]); see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, lam, mask, causal: bool, scale: float):
        ctx.kv_heads = k.shape[1]
        if not FLASH_CPU_GQA:  # (older kernels corrupt memory in the backward with fewer k/v heads than q heads)
            k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
        out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        if lam is not None:
            out, lse = _with_sink(out, lse, lam, mask)
        ctx.save_for_backward(q, k, v, out, lse, mask, lam)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, mask, lam = ctx.saved_tensors
        dq, dk, dv = _FLASH_BWD(dout.contiguous(), q, k, v, out.contiguous(), lse, 0.0, ctx.causal,
                                attn_mask=mask, scale=ctx.scale)
        if dk.shape[1] != ctx.kv_heads:  # k/v were repeated in the forward: sum each group's gradients
            dk, dv = dk.unflatten(1, (ctx.kv_heads, -1)).sum(2), dv.unflatten(1, (ctx.kv_heads, -1)).sum(2)
        dlam = None
        if lam is not None and ctx.needs_input_grad[3]:
            lam_b = lam.view(1, -1, 1) if lam.dim() == 1 else lam
            g = -torch.exp(lam_b - lse) * (dout * out).sum(-1)  # [B, H, Lq]
            dlam = g.sum(dim=(0, 2)) if lam.dim() == 1 else g.sum()
        return dq, dk, dv, dlam, None, None, None


#: the ops of SDPA's CUDA backends that return the row log-sum-exp, by role (their schemas as called here:
#: tests/test_sink_cuda.py, which also runs ``_SinkCUDA`` on the CPU with these replaced by math of the same contract)
CUDA_OPS: dict[str, Any] = {
    "flash": torch.ops.aten._scaled_dot_product_flash_attention,
    "flash_backward": torch.ops.aten._scaled_dot_product_flash_attention_backward,
    "efficient": torch.ops.aten._scaled_dot_product_efficient_attention,
    "efficient_backward": torch.ops.aten._scaled_dot_product_efficient_attention_backward,
}
#: the efficient kernel reads its bias in rows aligned to this many elements (SDPA pads the mask the same way)
_BIAS_ALIGNMENT = 16


def sink_backend(call: AttnCall) -> str | None:
    """Which CUDA kernel runs a sink call's lse rewrite: "flash" (fp16/bf16, no mask or bias, causal only with
    Lq == Lk), "efficient" (a mask or bias, fp32, a causal call with Lq != Lk), or None when neither can (dropout,
    head dims that differ or are not a multiple of 8 up to 256, a bias that needs a gradient, another device).
    Shapes, dtypes and flags only."""
    q = call.q
    if q.device.type != "cuda" or call.dropout > 0 or _bias_grad(call):
        return None
    d = q.shape[-1]
    if call.v.shape[-1] != d or d % 8 or d > 256 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    # (the flash kernel aligns a causal mask to the last key when Lq != Lk; MaskInfo's causal is upper-left)
    square = not call.mask.causal or q.shape[2] == call.k.shape[2]
    if q.dtype != torch.float32 and call.mask.keep is None and call.bias is None and square:
        return "flash"
    return "efficient"


def _aligned_bias(bias: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """An additive bias [B|1, H|1, Lq, Lk] as the efficient kernel reads it: rows padded to ``_BIAS_ALIGNMENT``
    elements (then sliced back, as SDPA's own mask preprocessing does) and expanded (stride 0) to ``shape``."""
    lk = bias.shape[-1]
    if bias.stride(-2) % _BIAS_ALIGNMENT or bias.stride(-1) != 1:
        pad = -lk % _BIAS_ALIGNMENT
        bias = F.pad(bias, (0, pad))[..., :lk]
    return bias.expand(shape)


class _SinkCUDA(torch.autograd.Function):
    """A sink logit lambda (0-d or [H]) on CUDA: out' = out e^(L - L'), L' = logaddexp(L, lambda) from the flash or
    efficient kernel's (out, L); its backward fed (out', L') is softmax's over the keys and the sink (module
    docstring), d lambda = -sum_i e^(lambda - L'_i) (dO_i . out'_i). bias: the additive mask for the efficient
    kernel (None for flash); live: bool [B|1, 1|H, Lq, 1] of rows with a visible key (the bias opened dead rows:
    their out' is 0, their L' lambda, their dO ignored) or None."""

    @staticmethod
    def forward(ctx, q, k, v, lam, bias, live, causal: bool, scale: float):
        B, H, Lq, _ = q.shape
        ctx.kv_heads = k.shape[1]
        if bias is None:  # flash: GQA natively
            res = CUDA_OPS["flash"](q, k, v, 0.0, causal, False, scale=scale)
            out, lse, aux = res[0], res[1], (res[2], res[3], res[6], res[7])  # (cum_seq_q, cum_seq_k, rng state)
            ctx.max_qk = (res[4], res[5])
        else:  # efficient: k/v repeated for GQA, the bias as SDPA hands it over
            k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])
            bias = _aligned_bias(bias.to(q.dtype), (B, H, Lq, k.shape[2]))
            out, lse, seed, offset = CUDA_OPS["efficient"](q, k, v, bias, True, 0.0, False, scale=scale)
            aux = (seed, offset)
        lam_b = lam.view(1, -1, 1) if lam.dim() == 1 else lam
        rows = lse[..., :Lq]  # (the efficient kernel pads its lse to a multiple of 32 rows)
        both = torch.logaddexp(rows, lam_b.to(rows.dtype))
        factor = torch.exp(rows - both).unsqueeze(-1)
        if live is not None:
            both = torch.where(live.squeeze(-1), both, lam_b.to(rows.dtype).expand_as(both))
            factor = torch.where(live, factor, torch.zeros((), dtype=factor.dtype, device=factor.device))
        out = (out * factor).to(q.dtype)
        lse = lse.clone()
        lse[..., :Lq] = both
        ctx.save_for_backward(q, k, v, out, lse, bias, live, lam, *aux)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, bias, live, lam, *aux = ctx.saved_tensors
        dout = dout.contiguous()
        if live is not None:
            dout = torch.where(live, dout, torch.zeros((), dtype=dout.dtype, device=dout.device))
        if bias is None:
            cum_q, cum_k, seed, offset = aux
            dq, dk, dv = CUDA_OPS["flash_backward"](
                dout, q, k, v, out, lse, cum_q, cum_k, *ctx.max_qk, 0.0, ctx.causal, seed, offset, scale=ctx.scale)
        else:
            seed, offset = aux
            dq, dk, dv, _ = CUDA_OPS["efficient_backward"](
                dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=ctx.scale)
            if dk.shape[1] != ctx.kv_heads:  # k/v were repeated: sum each group's gradients
                dk, dv = dk.unflatten(1, (ctx.kv_heads, -1)).sum(2), dv.unflatten(1, (ctx.kv_heads, -1)).sum(2)
        dlam = None
        if ctx.needs_input_grad[3]:
            Lq = q.shape[2]
            lam_b = lam.view(1, -1, 1) if lam.dim() == 1 else lam
            g = -torch.exp(lam_b - lse[..., :Lq]) * (dout.float() * out.float()).sum(-1)  # [B, H, Lq]
            dlam = (g.sum(dim=(0, 2)) if lam.dim() == 1 else g.sum()).to(lam.dtype)
        return dq, dk, dv, dlam, None, None, None, None


def _sink_cuda(call: AttnCall, backend: str) -> torch.Tensor:
    """out [B, H, Lq, Dv] of a sink call on CUDA through ``_SinkCUDA`` with ``backend`` ("flash" or "efficient":
    ``sink_backend``). fp32 calls without a mask take the efficient kernel with a causal bias [1, 1, Lq, Lk] (its
    backward op needs a bias tensor where its forward could take none)."""
    dt = call.q.dtype
    lam = sink_logit(call, torch.float32)
    q, k, v, scale = _prepare(call, dt)
    keep, causal = _sdpa_mask(call)
    bias, live = None, None
    if backend == "efficient":
        keep, live = _open_dead_rows(keep, call)
        if keep is None and causal:  # the efficient op's own causal flag is not used: one code path for masks
            keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]
        # the additive mask as SDPA builds it from a boolean one (0 / -inf), the call's bias added where visible; the
        # dead rows opened above (no row of -inf reaches the kernel)
        bias = torch.zeros((), dtype=torch.float32, device=q.device) if call.bias is None else \
            call.bias.to(device=q.device, dtype=torch.float32)
        if keep is not None:
            bias = torch.where(keep, bias, torch.tensor(-math.inf, device=q.device))
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        bias = bias.expand(*bias.shape[:2], q.shape[2], k.shape[2])
        causal = False
    return _SinkCUDA.apply(q.contiguous(), k.contiguous(), v.contiguous(), lam, bias, live, causal, scale)


def _open_dead_rows(keep: torch.Tensor | None, call: AttnCall) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """With a mask: (the mask with rows that see no key opened, bool [B|1, 1|H, Lq, 1] of live rows), so SDPA never
    sees an empty row (NaN on some backends); the caller zeroes the dead rows' outputs. Done whether or not a dead
    row exists (asking would be a host sync)."""
    if keep is None:
        return None, None
    live = call.mask.has_keys.to(keep.device).unsqueeze(-1)
    return keep | ~live, live


def sdpa_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """softmax / cosine (any device, dropout ok) and softmax_n / sink (CPU, or CUDA: ``sink_backend``; no dropout,
    D == Dv); forgetting attention (module docstring)."""
    if _forget_by_flash(call):
        return _forget_flash(call), None
    if call.forget is not None and _forget_too_large(call):  # (accepts: no gradient) blocks of query rows
        return _forget_blocks(call), None
    if call.forget is not None:  # (accepts: a small bias) the float mask carries the decay
        call = dataclasses.replace(call, bias=call.score_bias(), forget=None)
    keep, causal = _sdpa_mask(call)
    if call.bias is not None and causal:  # a bias goes in SDPA's float mask, which excludes is_causal
        keep, causal = call.mask.dense(call.q.device), False
    # not under torch.export: torch.onnx (torch 2.13) translates the CPU flash op with fewer key/value heads than
    # query heads and a mask into a graph onnxruntime rejects ("MatMul Incompatible dimensions"); plain SDPA with
    # enable_gqa translates correctly (tests/test_export.py checks that the bug is still there)
    if _uses_flash_cpu(call) and not is_exporting():
        dt = compute_dtype(call.q.dtype)
        lam = sink_logit(call, dt) if _has_sink(call) else None
        q, k, v, scale = _prepare(call, dt)
        mask = _float_mask(call, keep, dt)  # (None without a bias or keep-mask)
        if _one_query(call, causal):
            out, lse = one_query_softmax(q, k, v, scale, mask, lam is not None)
            return (out if lam is None else _with_sink(out, lse, lam, mask)[0]).to(call.q.dtype), None
        if lam is None and keep is None and call.bias is None:  # plain SDPA picks this flash kernel, less work
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            return out.to(call.q.dtype), None
        if not FLASH_CPU_GQA and k.shape[1] != q.shape[1]:  # (_FlashCPU repeats the key/value heads)
            warn_fallback(FLASH_CPU_GQA_FEATURE)
        out = _FlashCPU.apply(q, k, v, lam, mask, causal, scale)
        return out.to(call.q.dtype), None
    if _has_sink(call) and sink_backend(call) is not None and not is_exporting():
        return _sink_cuda(call, sink_backend(call)).to(call.q.dtype), None
    dt = compute_dtype(call.q.dtype) if call.q.device.type == "cpu" else call.q.dtype
    q, k, v, scale = _prepare(call, dt)
    keep, live = _open_dead_rows(keep, call)
    if call.bias is not None:
        keep = _float_mask(call, keep, dt)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=call.dropout, is_causal=causal,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if live is not None:
        out = torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.to(call.q.dtype), None


def _sinkcol_accepts(call: AttnCall) -> str | None:
    """sdpa_sinkcol: what both SDPA paths need (no score bias: its extra sink column has none)."""
    return _common(call)


def sdpa_sinkcol_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """softmax_n / sink through plain SDPA with one extra feature and a prepended sink key (any device)."""
    dt = compute_dtype(call.q.dtype) if call.q.device.type == "cpu" else call.q.dtype
    lam = sink_logit(call, dt)
    q, k, v, scale = _prepare(call, dt)
    if lam is None:  # softmax_n with n_extra = 0: plain softmax
        keep, causal = _sdpa_mask(call)
        keep, live = _open_dead_rows(keep, call)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=call.dropout, is_causal=causal,
                                             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        if live is not None:
            out = torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out.to(call.q.dtype), None
    q = q * scale  # the sink column must not be scaled
    B, H, Lq, _ = q.shape
    if is_exporting():
        # GQA SDPA repeats the k/v heads of Lk + 1 keys inside, and export cannot prove that reshape's stride guards
        # for a dynamic length; repeated here, on Lk keys, they export
        k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])
    Hkv = k.shape[1]
    lam_col = (lam.view(1, H, 1, 1) if lam.dim() == 1 else lam.view(1, 1, 1, 1)).expand(B, H, Lq, 1)
    q = torch.cat([q, lam_col.to(q.dtype)], dim=-1)
    k = torch.cat([k, k.new_zeros(B, Hkv, k.shape[2], 1)], dim=-1)
    sink_key = torch.zeros(B, Hkv, 1, k.shape[-1], dtype=k.dtype, device=k.device)
    sink_key[..., -1] = 1
    k = torch.cat([sink_key, k], dim=2)
    v = torch.cat([v.new_zeros(B, Hkv, 1, v.shape[-1]), v], dim=2)
    keep, causal = _sdpa_mask(call)
    dummy = False
    if keep is not None:
        # the sink key (index 0) is visible to every query, so no row is ever empty
        keep = torch.cat([keep.new_ones(*keep.shape[:-1], 1), keep], dim=-1)
    elif causal:
        q = torch.cat([q.new_zeros(B, H, 1, q.shape[-1]), q], dim=2)  # query i+1 sees the sink and keys <= i
        dummy = True
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=call.dropout, is_causal=causal,
                                         scale=1.0, enable_gqa=H != Hkv)
    if dummy:
        out = out[:, :, 1:]
    return out.to(call.q.dtype), None


def direct(call: AttnCall) -> Any:
    """The direct entry of a plain call (no sink, score modifier, mask tensor, q/k transform or dropout; q, k and v
    of one dtype that is computed as is): SDPA on the raw (q, k, v) with the call's causality, scale and GQA,
    exactly what ``sdpa_attention`` runs for such a call. With a per-query factor (a length-aware scale, a per-head
    multiplier), on CPU and for one query per head: the factor from the call's per-head values and n = Lk, as
    ``make_call`` resolves it, multiplied into q as ``sdpa_attention`` does. A sink logit (softmax_n, sink) on CPU
    for one query per head: the lse rewrite (``_sink_direct``). None for every other call."""
    q = call.q
    if _has_sink(call):
        return _sink_direct(call)
    if (call.modifies_scores or call.mask.keep is not None
            or call.dropout > 0 or type(call.normalizer).transform_qk is not Normalizer.transform_qk
            or compute_dtype(q.dtype) != q.dtype or call.k.dtype != q.dtype or call.v.dtype != q.dtype
            or not q.dtype.is_floating_point or is_exporting()):
        return None
    causal, scale, gqa = call.mask.causal, float(call.base), q.shape[1] != call.k.shape[1]
    if not has_query_factor(call.settings):
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: dict) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)

        if _plain_softmax(call.settings) or q.shape[2] != 1 or q.device.type != "cpu":
            return run

        def run_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: dict) -> torch.Tensor:
            if one_query_runs(k.shape[2]):  # (as sdpa_attention: ``_one_query``; one query is never causal)
                return one_query_softmax(q, k, v, scale)[0]
            return run(q, k, v, heads)

        return run_one
    if q.shape[2] != 1 or q.device.type != "cpu":  # (on a GPU the factor goes through triton_rows)
        return None
    settings, info = call.settings, call.module_info

    def run_factored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: dict) -> torch.Tensor:
        mult = query_factor(settings, q, one_query_ctx(settings, heads, q, k.shape[2], info))
        q, factor_scale = factored_query(q, mult, scale)
        if one_query_runs(k.shape[2]):  # (as sdpa_attention: ``_one_query``; one query is never causal)
            return one_query_softmax(q, k, v, factor_scale)[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=factor_scale, enable_gqa=gqa)

    return run_factored


def _sink_direct(call: AttnCall) -> Any:
    """The direct entry of a plain one-query CPU call with the normalizer's sink logit lambda (no s_aux, mask
    tensor, score modifier or dropout; fp32/fp64 q, k and v of one dtype, D == Dv): what ``_FlashCPU`` computes
    without autograd, out * exp(L - logaddexp(L, lambda)) from the CPU flash op's output and log-sum-exp L, with
    lambda and any per-query factor resolved from the call's per-head values and n = Lk as ``make_call`` resolves
    them. None for every other call."""
    q = call.q
    if (q.shape[2] != 1 or q.device.type != "cpu" or not _uses_flash_cpu(call) or call.modifies_scores
            or call.mask.keep is not None or type(call.normalizer).transform_qk is not Normalizer.transform_qk
            or compute_dtype(q.dtype) != q.dtype or call.k.dtype != q.dtype or call.v.dtype != q.dtype):
        return None
    norm, settings, info = call.normalizer, call.settings, call.module_info
    causal, base, factored = call.mask.causal, float(call.base), has_query_factor(settings)
    repeat = not FLASH_CPU_GQA and q.shape[1] != call.k.shape[1]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: dict) -> torch.Tensor:
        ctx = one_query_ctx(settings, heads, q, k.shape[2], info)
        lam = norm.sink_logit(ctx, q.dtype)
        q, scale = factored_query(q, query_factor(settings, q, ctx) if factored else None, base)
        if one_query_runs(k.shape[2]):  # (as sdpa_attention: ``_one_query``; one query is never causal)
            out, lse = one_query_softmax(q, k, v, scale, None, lam is not None)
            return out if lam is None else _with_sink(out, lse, lam.to(q.device))[0]
        if repeat:
            k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
        if lam is None:  # (a normalizer whose sink logit is absent for these values: plain SDPA, as the path)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
        return _with_sink(out, lse, lam.to(q.device))[0]

    return run


from .dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

# (its accepts reads the call's length only for a forget gate: how large the decay bias would be)
register_path("sdpa", sdpa_attention, takes=takes, accepts=accepts, priority=10, exportable=True,
              supports=("bias", "sinks", "forget", "dropout"),
              plan_stable=lambda call: call.forget is None, direct=direct)
# exact on any device, but on CPU D+1 falls off SDPA's fast kernel: the automatic rule uses it elsewhere only
register_path("sdpa_sinkcol", sdpa_sinkcol_attention, takes=takes_sink, accepts=_sinkcol_accepts, priority=20,
              supports=("sinks", "dropout"), auto_exclude=("cpu",), exportable=True, plan_stable=True)
