"""Device code of the fused-map Triton kernels (``triton.py`` holds the host side): plain Python functions that
``triton._compiled`` jits on first use, in one namespace per mode (compiled or interpreted) together with the
per-entry code generated from the map declarations (``triton_maps.py``). Nothing here names a map: a map's facts
arrive as compile-time constants (``triton.map_constants``) and its per-entry code as ``_map_weight`` /
``_map_slope``.

FlashAttention-2's design, for maps other than softmax:

* every product is a tensor-core dot on the input dtype: Q K^T, P V (P cast to the input dtype), dO V^T,
  dS K and dS^T Q (dS cast), P^T dO, all accumulated in fp32; fp32 inputs keep fp32 dots (``PREC``: exact unless
  torch allows TF32). Outputs are written in the input dtype;
* the key blocks a causal query block sees wholly are walked without any mask (``MASKED=False``), the blocks on the
  diagonal (and the ragged last block) with it; a keep-mask is read blockwise, skipping blocks without a visible key
  (``TABLE``);
* the backward's delta_i = sum_j w_ij dp_ij comes from dO_i . O_i (a preprocess on the host) for the normalised maps
  whose declaration allows it (``FusedMap.delta_from_output``); the others walk the keys once more for it (see
  ``_bwd_dq_kernel``);
* ``FAST``: half-precision inputs on a GPU evaluate a map's transcendental the fast way where it has one
  (sigmoid: 0.5 + 0.5 tanh(x / 2) by ``tanh.approx``, one special-function op instead of an exp and a division,
  as FlashSigmoid does); its error (about 5e-4 absolute) sits below the rounding of P to bf16/fp16.

Shapes: Q [B, H, Lq, D], K [B, Hkv, Lk, D], V [B, Hkv, Lk, Dv] (any strides with a unit last stride); SCORE_SCALE and
R [B, H, Lq] fp32 (strides scb, sch, scm: R shares them); OUT [B, H, Lq, Dv] (input dtype, contiguous); DEN, SHIFT,
DELTA, ROWMAX [B, H, Lq] fp32 contiguous; DO [B, H, Lq, Dv] contiguous in the input dtype; DQ [B, H, Lq, D],
DK [B, Hkv, Lk, D], DV_OUT [B, Hkv, Lk, Dv] contiguous (input dtype; fp32 for fp32 inputs); KEEP uint8 and TABLE uint8
[B|1, H|1, ., .] read through broadcast strides.
"""

from __future__ import annotations

from typing import Any

# bound by triton._compiled before jitting (this module imports no triton: the plain package needs none)
tl: Any = None

#: power: |s| below the smallest normal fp32 counts as 0 (weight 0); the log-domain "minus infinity" of its shift
TINY = 1.1754943508222875e-38
POW_NEG = -1e30


# ------------------------------------------------------------------------------------------------ small helpers


def _sel(keep, x, MASKED: tl.constexpr):
    """x where keep, else 0 (MASKED); x itself in a block without hidden entries."""
    if MASKED:
        return tl.where(keep, x, 0.0)
    return x


def _sigmoid(x, FAST: tl.constexpr):
    """sigmoid(x) in fp32: FAST (compiled, half inputs) 0.5 + 0.5 tanh(x / 2) by the tanh.approx instruction, else
    1 / (1 + e^-x)."""
    if FAST:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x * 0.5], dtype=tl.float32,
                                      is_pure=True, pack=1)
        return 0.5 + 0.5 * t
    return 1.0 / (1.0 + tl.exp(-x))


def _tanh(x):
    """tanh in fp32 (Cephes tanhf: odd polynomial below 0.625, else from exp; triton 3.9 has no tl.tanh)."""
    ax = tl.abs(x)
    z = x * x
    p = -5.70498872745e-3 * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    return tl.where(ax < 0.625, p * z * x + x, tl.where(x < 0, -big, big))


def _entry(s, r, keep, shift, MAP: tl.constexpr, RUNNING_SHIFT: tl.constexpr, THRESHOLD_EXPONENT: tl.constexpr,
           MASKED: tl.constexpr, FAST: tl.constexpr):
    """Forward map of one score block: (a, b) with a the numerator weight and b the denominator term.

    s: [BM, BN] fp32 scores (or their transpose [BN, BM]: the dk/dv kernel's); r and shift: the row values
    broadcast against s ([BM, 1], or [1, BM] transposed): r the map's row value, shift softpick's running max,
    power's and softplus's shift, the sparse maps' threshold tau; keep: bool like s (read when MASKED). Hidden entries
    give exactly 0."""
    if RUNNING_SHIFT == 1:  # (shift 'max_score') softpick in units of e^-M: e^(s-M) - e^-M
        if MASKED:
            e = tl.exp(tl.where(keep, s - shift, -float("inf")))
        else:
            e = tl.exp(s - shift)
        p = e - tl.exp(-shift)
        a = tl.where(p > 0, p, 0.0)
        b = _sel(keep, tl.abs(p), MASKED)
    elif RUNNING_SHIFT == 4:  # (shift 'max_exp') softmax: e^(s - M), M the running max of the visible scores
        if MASKED:
            a = tl.exp(tl.where(keep, s - shift, -float("inf")))
        else:
            a = tl.exp(s - shift)
        b = a
    elif RUNNING_SHIFT == 5:  # (shift 'max_abs_exp') cog: sign(s) e^(|s| - M) over e^(|s| - M), M the max |s|
        if MASKED:
            b = tl.exp(tl.where(keep, tl.abs(s) - shift, -float("inf")))
        else:
            b = tl.exp(tl.abs(s) - shift)
        a = tl.where(s > 0, b, tl.where(s < 0, -b, 0.0))
    elif THRESHOLD_EXPONENT == 1:  # sparsemax [s - tau]_+
        a = _sel(keep, tl.maximum(s - shift, 0.0), MASKED)
        b = a
    elif RUNNING_SHIFT == 3:  # ('log_abs_max') power |s|^p = e^(p ln|s| - M), p = |r|, M = max of p ln|s|
        mag = tl.abs(s)
        nz = mag >= TINY
        if MASKED:
            nz = nz & keep
        a = tl.where(nz, tl.exp(tl.where(nz, tl.abs(r) * tl.log(tl.where(nz, mag, 1.0)) - shift,
                                         POW_NEG)), 0.0)
        b = a
    elif RUNNING_SHIFT == 2:  # ('max_score_below_zero') softplus(s) e^-c, c = min(0, running max) (shift):
        # s + log1p(e^-s) for s > 0 (then c = 0), else e^(s - c) log1p(u) / u with u = e^s (exact where u
        # underflows); log1p by Goldberg
        u = tl.exp(-tl.abs(s))
        w = 1.0 + u
        d = w - 1.0
        lp = tl.where(d == 0, u, tl.log(w) * (u / tl.where(d == 0, 1.0, d)))
        ratio = tl.where(u > 0, lp / tl.where(u > 0, u, 1.0), 1.0)
        neg = tl.exp(tl.minimum(s - shift, 0.0)) * ratio
        a = _sel(keep, tl.where(s > 0, s + lp, neg), MASKED)
        b = a
    elif THRESHOLD_EXPONENT == -1:  # alpha-entmax [x - tau]_+^(1/(alpha-1)), x = (s - M)(alpha - 1) from the caller
        d = _sel(keep, s - shift, MASKED)
        pos = d > 0
        a = tl.where(pos, tl.exp(tl.log(tl.where(pos, d, 1.0)) / (r - 1.0)), 0.0)
        b = a
    elif THRESHOLD_EXPONENT == 2:  # entmax-1.5 [s/2 - tau]_+^2
        t = _sel(keep, tl.maximum(s * 0.5 - shift, 0.0), MASKED)
        a = t * t
        b = a
    else:  # the declared per-entry code (FusedMap.code; _map_weight is generated from it: triton_maps.py)
        a = _sel(keep, _map_weight(s, r, MAP, FAST), MASKED)  # noqa: F821  (generated: _compiled)
        b = a
    return a, b


def _slopes(s, r, keep, shift, MAP: tl.constexpr, RUNNING_SHIFT: tl.constexpr, THRESHOLD_EXPONENT: tl.constexpr,
            MASKED: tl.constexpr, FAST: tl.constexpr):
    """Backward map of one score block: (a, da, db) with da = a'(s), db = b'(s) (0 on hidden entries).

    For the sparse maps da is the Jacobian weight g = p^(2 - alpha) (1 on sparsemax's support, sqrt(p) for
    entmax-1.5) and db is unused."""
    if RUNNING_SHIFT == 1:  # (shift 'max_score') softpick
        if MASKED:
            e = tl.exp(tl.where(keep, s - shift, -float("inf")))
        else:
            e = tl.exp(s - shift)
        p = e - tl.exp(-shift)
        a = tl.where(p > 0, p, 0.0)
        da = tl.where(p > 0, e, 0.0)
        db = tl.where(p > 0, e, tl.where(p < 0, -e, 0.0))
    elif RUNNING_SHIFT == 4:  # (shift 'max_exp') softmax: (e^(s - M))' = e^(s - M)
        if MASKED:
            a = tl.exp(tl.where(keep, s - shift, -float("inf")))
        else:
            a = tl.exp(s - shift)
        da = a
        db = a
    elif RUNNING_SHIFT == 5:  # (shift 'max_abs_exp') cog: a' = [s != 0] e^(|s| - M), b' = sign(s) e^(|s| - M)
        if MASKED:
            e = tl.exp(tl.where(keep, tl.abs(s) - shift, -float("inf")))
        else:
            e = tl.exp(tl.abs(s) - shift)
        a = tl.where(s > 0, e, tl.where(s < 0, -e, 0.0))
        da = tl.where(s != 0, e, 0.0)
        db = a
    elif THRESHOLD_EXPONENT == 1:  # sparsemax
        a = _sel(keep, tl.maximum(s - shift, 0.0), MASKED)
        da = tl.where(a > 0, 1.0, 0.0)
        db = da
    elif RUNNING_SHIFT == 3:  # (shift 'log_abs_max') power: d|s|^p/ds = p |s|^p / s (0 at s = 0)
        mag = tl.abs(s)
        nz = mag >= TINY
        if MASKED:
            nz = nz & keep
        pw = tl.abs(r)
        a = tl.where(nz, tl.exp(tl.where(nz, pw * tl.log(tl.where(nz, mag, 1.0)) - shift, POW_NEG)), 0.0)
        da = tl.where(nz, a * pw / tl.where(nz, s, 1.0), 0.0)
        db = da
    elif RUNNING_SHIFT == 2:  # (shift 'max_score_below_zero') (softplus(s) e^-c)' = sigmoid(s) e^-c
        u = tl.exp(-tl.abs(s))
        w = 1.0 + u
        d = w - 1.0
        lp = tl.where(d == 0, u, tl.log(w) * (u / tl.where(d == 0, 1.0, d)))
        ratio = tl.where(u > 0, lp / tl.where(u > 0, u, 1.0), 1.0)
        e = tl.exp(tl.minimum(s - shift, 0.0))
        a = _sel(keep, tl.where(s > 0, s + lp, e * ratio), MASKED)
        da = _sel(keep, tl.where(s > 0, 1.0, e) / w, MASKED)
        db = da
    elif THRESHOLD_EXPONENT == -1:  # alpha-entmax: g = d^(1/(alpha-1) - 1) = p^(2 - alpha) (unnormalised)
        d = _sel(keep, s - shift, MASKED)
        pos = d > 0
        d1 = tl.where(pos, d, 1.0)
        a = tl.where(pos, tl.exp(tl.log(d1) / (r - 1.0)), 0.0)
        da = tl.where(pos, a / d1, 0.0)
        db = da
    elif THRESHOLD_EXPONENT == 2:  # entmax-1.5
        t = _sel(keep, tl.maximum(s * 0.5 - shift, 0.0), MASKED)
        a = t * t
        da = t
        db = da
    else:  # the declared per-entry code (FusedMap.code; _map_weight / _map_slope are generated from it)
        w = _map_weight(s, r, MAP, FAST)  # noqa: F821  (generated: _compiled)
        a = _sel(keep, w, MASKED)
        da = _sel(keep, _map_slope(s, r, w, MAP, FAST), MASKED)  # noqa: F821
        db = da
    return a, da, db


def _mods(s, b, h, om, on, inside, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, LK,
          HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, HAS_FORGET: tl.constexpr):
    """Score modifiers on a block s (fp32; [BM, BN], or transposed): CAP tanh(s / CAP), + BIAS (strides 0 on its
    broadcast dims), - SLOPES[h] |QOFF + i - j| (ALiBi), - |c_p - c_j| (forgetting attention's decay: c the
    cumulative log forget gates [B, H, Lk] as hi + lo fp32 pairs, p = clamp(QOFF + i, 0, Lk - 1) the query's own key;
    for causal rows the paper's sum of log f after key j). om, on: the query and key indices broadcast like s
    (offs_m[:, None], offs_n[None, :] or transposed); inside: the entries within the call. Returns (s, capd, fsg):
    capd = 1 - tanh^2 (1.0 without a cap), fsg = sign(c_p - c_j) (0.0 without a decay: dF/dc_p = -fsg,
    dF/dc_j = fsg)."""
    capd = 1.0
    fsg = 0.0
    if HAS_CAP:
        t = _tanh(s / CAP)
        s = CAP * t
        capd = 1.0 - t * t
    if HAS_BIAS:
        s += tl.load(BIAS + b * sbb + h * sbh + om * sbm + on * sbn, mask=inside, other=0.0).to(tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h)
        s -= slope * tl.abs((om + QOFF - on).to(tl.float32))
    if HAS_FORGET:
        base = b * sfb + h * sfh
        pq = tl.minimum(tl.maximum(om + QOFF, 0), LK - 1)
        kv = on < LK
        # (hi_p - hi_j) + (lo_p - lo_j): near keys' hi values are close, so their difference is exact and the lo
        # parts restore what fp32 rounded off c (whose magnitude grows with the length)
        x = ((tl.load(FHI + base + pq * sfn) - tl.load(FHI + base + on * sfn, mask=kv, other=0.0))
             + (tl.load(FLO + base + pq * sfn) - tl.load(FLO + base + on * sfn, mask=kv, other=0.0)))
        s -= tl.abs(x)
        fsg = tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))
    return s, capd, fsg


def _keep(keep_ptrs, om, on, inside, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr):
    """The visible entries of a masked block (like ``_mods``'s om, on, inside): inside the call, causal (j <= i),
    the keep-mask's (keep_ptrs: its pointers for the block)."""
    keep = inside
    if CAUSAL:
        keep = keep & (on <= om)
    if HAS_MASK:
        keep = keep & (tl.load(keep_ptrs, mask=keep, other=0) != 0)
    return keep


def _load_rows(ptrs, rows_valid, cols_valid, EVEN: tl.constexpr):
    """A [rows, cols] tile: bounds on the rows always, on the columns unless EVEN (the head dim fills the block)."""
    if EVEN:
        return tl.load(ptrs, mask=rows_valid[:, None], other=0.0)
    return tl.load(ptrs, mask=rows_valid[:, None] & cols_valid[None, :], other=0.0)


def _load_cols(ptrs, rows_valid, cols_valid, EVEN: tl.constexpr):
    """A transposed [dims, cols] tile (k^T, v^T): bounds on the columns, on the dims unless EVEN."""
    if EVEN:
        return tl.load(ptrs, mask=cols_valid[None, :], other=0.0)
    return tl.load(ptrs, mask=rows_valid[:, None] & cols_valid[None, :], other=0.0)


def _causal_ranges(start_m, LK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_MASK: tl.constexpr):
    """(full, hi) for a query block starting at start_m: the key blocks [0, full) need no mask (every entry visible
    to every query row of the block, all keys inside Lk), [full, hi) do. Causal: hi ends at the block's last row;
    with a keep-mask every block is masked."""
    if CAUSAL:
        hi = tl.minimum(LK, start_m + BLOCK_M)
        full = tl.minimum(((start_m + 1) // BLOCK_N) * BLOCK_N, (LK // BLOCK_N) * BLOCK_N)
    elif HAS_MASK:
        hi = LK
        full = 0
    else:
        hi = LK
        full = (LK // BLOCK_N) * BLOCK_N
    return full, hi


def _qk(q, start_n, k_base, keep_base, offs_m, offs_n0, offs_d, m_valid, d_valid, skn, skd, smm, smn, score_scale,
        LK, b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn,
        HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, HAS_FORGET: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
        MASKED: tl.constexpr):
    """One block of scores of a query block against the keys [start_n, start_n + BN): (s [BM, BN] fp32 with the
    score modifiers, k^T [BD, BN] as loaded, capd and fsg (``_mods``), keep (MASKED; else 0), n_valid [BN]). The
    pointers
    are formed here from the bases (this program's batch and head), so no pointer tile stays live across a loop."""
    offs_n = start_n + offs_n0
    n_valid = offs_n < LK
    kt = _load_cols(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd, d_valid, n_valid, EVEN_D)
    if UPCAST:
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=PREC) * score_scale[:, None]
    om = offs_m[:, None]
    on = offs_n[None, :]
    inside = m_valid[:, None] & n_valid[None, :]
    s, capd, fsg = _mods(s, b, h, om, on, inside, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF, FHI, FLO, sfb, sfh,
                         sfn, LK, HAS_BIAS, HAS_ALIBI, HAS_CAP, HAS_FORGET)
    keep = 0
    if MASKED:
        keep = _keep(keep_base + om * smm + on * smn, om, on, inside, CAUSAL, HAS_MASK)
    return s, kt, capd, fsg, keep, n_valid


def _rescale(acc, den, shift, new):
    """A running shift rises to ``new``: what was accumulated is rescaled by e^(old - new)."""
    alpha = tl.exp(shift - new)
    return acc * alpha[:, None], den * alpha, new


# ------------------------------------------------------------------------------------------------ forward


def _fwd_blocks(acc, den, shift, q, r, score_scale, mrow, lo, hi, k_base, v_base, keep_base, t_ptr, skn, skd, svn,
                svd, smm, smn, stn, offs_m, offs_n0, offs_d, offs_dv, m_valid, d_valid, dv_valid, LK, b, h,
                BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn,
                HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, HAS_FORGET: tl.constexpr,
                MAP: tl.constexpr, RUNNING_SHIFT: tl.constexpr, THRESHOLD_EXPONENT: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, FAST: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The forward's accumulation over the key blocks [lo, hi): acc [BM, BDV] += a V (a in V's dtype), den [BM] +=
    sum b, with the running shift rescaling both when it rises."""
    for start_n in range(lo, hi, BLOCK_N):
        live = 1
        if HAS_MASK:
            live = tl.load(t_ptr + (start_n // BLOCK_N) * stn)
        if live != 0:
            s, kt, capd, fsg, keep, n_valid = _qk(
                q, start_n, k_base, keep_base, offs_m, offs_n0, offs_d, m_valid, d_valid, skn, skd, smm, smn,
                score_scale, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, HAS_BIAS,
                HAS_ALIBI, HAS_CAP, HAS_FORGET, CAUSAL, HAS_MASK, PREC, UPCAST, EVEN_D, MASKED)
            if THRESHOLD_EXPONENT == -1:
                s = (s - mrow[:, None]) * (r - 1.0)[:, None]
            if RUNNING_SHIFT == 1:  # 'max_score': m = max(0, visible scores)
                acc, den, shift = _rescale(acc, den, shift, tl.maximum(shift, tl.max(_sel(keep, s, MASKED), 1)))
            if RUNNING_SHIFT == 3:  # 'log_abs_max': m = max of p ln|s| over visible s != 0
                mag = tl.abs(s)
                nz = mag >= TINY
                if MASKED:
                    nz = nz & keep
                lmax = tl.max(tl.where(nz, tl.abs(r)[:, None] * tl.log(tl.where(nz, mag, 1.0)), POW_NEG), 1)
                acc, den, shift = _rescale(acc, den, shift, tl.maximum(shift, lmax))
            if RUNNING_SHIFT == 5:  # 'max_abs_exp': m = max(0, visible |s|) (cog)
                acc, den, shift = _rescale(acc, den, shift,
                                           tl.maximum(shift, tl.max(_sel(keep, tl.abs(s), MASKED), 1)))
            if RUNNING_SHIFT == 4:  # 'max_exp': m = the max of the visible scores (softmax)
                if MASKED:
                    smax = tl.max(tl.where(keep, s, POW_NEG), 1)
                else:
                    smax = tl.max(s, 1)
                acc, den, shift = _rescale(acc, den, shift, tl.maximum(shift, smax))
            if RUNNING_SHIFT == 2:  # 'max_score_below_zero': m = min(0, max of visible s)
                if MASKED:
                    smax = tl.max(tl.where(keep, s, POW_NEG), 1)
                else:
                    smax = tl.max(s, 1)
                acc, den, shift = _rescale(acc, den, shift, tl.maximum(shift, tl.minimum(smax, 0.0)))
            a, bden = _entry(s, r[:, None], keep, shift[:, None], MAP, RUNNING_SHIFT, THRESHOLD_EXPONENT, MASKED, FAST)
            offs_n = start_n + offs_n0
            v = _load_rows(v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd, n_valid, dv_valid, EVEN_DV)
            if UPCAST:
                v = v.to(tl.float32)
            acc += tl.dot(a.to(v.dtype), v, input_precision=PREC)
            den += tl.sum(bden, 1)
    return acc, den, shift


def _fwd_kernel(
    Q, K, V, SCORE_SCALE, R, KEEP, TABLE, SHIFT_IN, OUT, DEN, SHIFT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, scb, sch, scm,
    smb, smh, smm, smn, stb, sth, stm, stn,
    H, GROUPS, LQ, LK, DH, DV, ROWMAX,
    BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, LQ_KEY, LK_KEY,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, HAS_FORGET: tl.constexpr,
    MAP: tl.constexpr, NORMALISED: tl.constexpr, ROW_VALUE_USE: tl.constexpr, RUNNING_SHIFT: tl.constexpr,
    THRESHOLD_EXPONENT: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, FAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One program per (query block, batch x head): OUT [B, H, Lq, Dv] (input dtype), DEN and SHIFT [B, H, Lq]
    (fp32). alpha-entmax: DEN = Z = sum_j [x_j - tau]_+^P, by which the row is renormalised as in the reference.
    LQ_KEY / LK_KEY: the lengths rounded up to a power of two (the autotuner's key; unused here)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = h // GROUPS
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_valid = offs_m < LQ
    d_valid = offs_d < DH
    dv_valid = offs_dv < DV
    row = pid_bh.to(tl.int64) * LQ + offs_m
    q = _load_rows(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, m_valid, d_valid, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)
    score_scale = tl.load(SCORE_SCALE + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
    r = tl.load(R + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    keep_base = KEEP + b * smb + h * smh
    t_ptr = TABLE + b * stb + h * sth + pid_m * stm
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    if THRESHOLD_EXPONENT != 0:
        shift = tl.load(SHIFT_IN + row, mask=m_valid, other=0.0)  # the sparse threshold tau
    # max_score_below_zero, log_abs_max, max_exp
    elif (RUNNING_SHIFT == 2) | (RUNNING_SHIFT == 3) | (RUNNING_SHIFT == 4):
        # power: running max of p ln|s| over visible s != 0; softplus: min(0, running max of visible s); softmax:
        # running max of visible s
        shift = tl.full([BLOCK_M], POW_NEG, tl.float32)
    else:
        # shift 1 (softpick): running max of (0, visible scores); 5 (cog): of (0, visible |s|)
        shift = tl.zeros([BLOCK_M], tl.float32)
    mrow = shift
    if THRESHOLD_EXPONENT == -1:
        mrow = tl.load(ROWMAX + row, mask=m_valid, other=0.0)
    full, hi = _causal_ranges(start_m, LK, BLOCK_M, BLOCK_N, CAUSAL, HAS_MASK)
    acc, den, shift = _fwd_blocks(
        acc, den, shift, q, r, score_scale, mrow, 0, full, k_base, v_base, keep_base, t_ptr, skn, skd, svn, svd, smm,
        smn, stn, offs_m, offs_n0, offs_d, offs_dv, m_valid, d_valid, dv_valid, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm,
        sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, HAS_BIAS, HAS_ALIBI, HAS_CAP, HAS_FORGET, MAP, RUNNING_SHIFT,
        THRESHOLD_EXPONENT, CAUSAL, HAS_MASK, PREC, UPCAST, FAST, EVEN_D, EVEN_DV, False, BLOCK_N)
    acc, den, shift = _fwd_blocks(
        acc, den, shift, q, r, score_scale, mrow, full, hi, k_base, v_base, keep_base, t_ptr, skn, skd, svn, svd, smm,
        smn, stn, offs_m, offs_n0, offs_d, offs_dv, m_valid, d_valid, dv_valid, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm,
        sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, HAS_BIAS, HAS_ALIBI, HAS_CAP, HAS_FORGET, MAP, RUNNING_SHIFT,
        THRESHOLD_EXPONENT, CAUSAL, HAS_MASK, PREC, UPCAST, FAST, EVEN_D, EVEN_DV, True, BLOCK_N)
    if NORMALISED:
        if ROW_VALUE_USE == 3:  # den_offset: r is added to the denominator
            den = den + r
        acc = acc * tl.where(den != 0, 1.0 / tl.where(den != 0, den, 1.0), 0.0)[:, None]
    if THRESHOLD_EXPONENT == -1:
        acc = acc * tl.where(den != 0, 1.0 / tl.where(den != 0, den, 1.0), 0.0)[:, None]
    tl.store(OUT + row[:, None] * DV + offs_dv[None, :], acc.to(OUT.dtype.element_ty),
             mask=m_valid[:, None] & dv_valid[None, :])
    tl.store(DEN + row, den, mask=m_valid)
    if RUNNING_SHIFT != 0:
        tl.store(SHIFT + row, shift, mask=m_valid)


# ------------------------------------------------------------------------------------------------ threshold


def _threshold_kernel(
    Q, K, SCORE_SCALE, KEEP, TABLE, TAU,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, scb, sch, scm,
    smb, smh, smm, smn, stb, sth, stm, stn,
    H, GROUPS, LQ, LK, DH, R, ROWMAX,
    BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, LQ_KEY, LK_KEY,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, HAS_FORGET: tl.constexpr,
    MAP: tl.constexpr, THRESHOLD_EXPONENT: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
    STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Sparse maps: per-row threshold TAU [B, H, Lq] with sum_j [z_j - tau]_+^(1/(alpha-1)) = 1 (z = s or s/2).

    Pass 1 finds the row max m of z; tau lies in [m - 1, m] (the max alone has mass >= 1 at m - 1). Then Newton
    steps on f(tau) = mass(tau) - 1 from the left end (f is convex and decreasing, so they approach the root from
    below without overshooting; sparsemax's f is piecewise linear and Newton lands exactly once the support is
    found), safeguarded by the bracket (bisection if a step leaves it). Each step is one pass over the key blocks;
    a block stops when all its rows converged (|f| <= 1e-7 or a relative step below 2e-8), at most STEPS passes.
    Fully masked rows get tau = 0 (their p is 0 anyway).

    alpha-entmax (alpha_i = R, P = 1/(alpha - 1)): z = x = (s - M)(alpha - 1) with M the row max of s, stored in
    ROWMAX for the other kernels (shifted before scaling, as the reference: (alpha - 1) s would be rounded first and
    P amplifies that), tau in [-1, 0]. For alpha <= 2 the step is Newton's on h(tau) = mass^(1/P) (= ||[x - tau]_+||_P,
    convex and decreasing for P >= 1, so from below it never overshoots; nearly linear where mass is a high power,
    i.e. near-uniform rows and alpha -> 1); for alpha > 2 bisection (about 26 passes to fp32 precision).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = h // GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < LQ
    d_valid = offs_d < DH
    q = _load_rows(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, m_valid, d_valid, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)
    score_scale = tl.load(SCORE_SCALE + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
    k_base = K + b * skb + hk * skh
    keep_base = KEEP + b * smb + h * smh
    t_ptr = TABLE + b * stb + h * sth + pid_m * stm
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, (pid_m + 1) * BLOCK_M)
    zmax = tl.full([BLOCK_M], -float("inf"), tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        live = 1
        if HAS_MASK:
            live = tl.load(t_ptr + (start_n // BLOCK_N) * stn)
        if live != 0:
            s, kt, capd, fsg, keep, n_valid = _qk(
                q, start_n, k_base, keep_base, offs_m, offs_n0, offs_d, m_valid, d_valid, skn, skd, smm, smn,
                score_scale, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, HAS_BIAS,
                HAS_ALIBI, HAS_CAP, HAS_FORGET, CAUSAL, HAS_MASK, PREC, UPCAST, EVEN_D, True)
            if THRESHOLD_EXPONENT == 2:
                s = s * 0.5
            zmax = tl.maximum(zmax, tl.max(tl.where(keep, s, -float("inf")), 1))
    has_keys = zmax > -float("inf")
    hi_t = tl.where(has_keys, zmax, 0.0)
    lo_t = hi_t - 1.0
    am1 = hi_t
    pw = hi_t
    mrow = hi_t
    if THRESHOLD_EXPONENT == -1:
        am1 = tl.load(R + b * scb + h * sch + offs_m * scm, mask=m_valid, other=2.0) - 1.0
        pw = 1.0 / am1
        mrow = hi_t  # M (0 on fully masked rows)
        tl.store(ROWMAX + pid_bh * LQ + offs_m, mrow, mask=m_valid)
        hi_t = tl.zeros([BLOCK_M], tl.float32)
        lo_t = hi_t - 1.0
    tau = lo_t
    done = has_keys == 0  # fully masked rows: p = 0 whatever tau is (not ~has_keys: triton 3.2 cannot interpret it)
    for _ in range(STEPS):
        if tl.max(tl.where(done, 0, 1)) != 0:
            mass = tl.zeros([BLOCK_M], tl.float32)
            slope = tl.zeros([BLOCK_M], tl.float32)
            for start_n in range(0, hi, BLOCK_N):
                live = 1
                if HAS_MASK:
                    live = tl.load(t_ptr + (start_n // BLOCK_N) * stn)
                if live != 0:
                    s, kt, capd, fsg, keep, n_valid = _qk(
                        q, start_n, k_base, keep_base, offs_m, offs_n0, offs_d, m_valid, d_valid, skn, skd, smm, smn,
                        score_scale, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn,
                        HAS_BIAS, HAS_ALIBI, HAS_CAP, HAS_FORGET, CAUSAL, HAS_MASK, PREC, UPCAST, EVEN_D, True)
                    if THRESHOLD_EXPONENT == 2:
                        s = s * 0.5
                    if THRESHOLD_EXPONENT == -1:
                        s = (s - mrow[:, None]) * am1[:, None]
                    t = tl.where(keep, tl.maximum(s - tau[:, None], 0.0), 0.0)
                    if THRESHOLD_EXPONENT == -1:  # mass = sum t^P, slope = sum t^(P-1) (-d mass/d tau = P slope)
                        pos = t > 0
                        t1 = tl.where(pos, t, 1.0)
                        e = tl.where(pos, tl.exp(tl.log(t1) * pw[:, None]), 0.0)
                        mass += tl.sum(e, 1)
                        slope += tl.sum(e / t1, 1)
                    elif THRESHOLD_EXPONENT == 2:
                        mass += tl.sum(t * t, 1)
                        slope += 2.0 * tl.sum(t, 1)
                    elif THRESHOLD_EXPONENT == 1:
                        mass += tl.sum(t, 1)
                        slope += tl.sum(tl.where(t > 0, 1.0, 0.0), 1)
                    else:
                        tl.static_assert(False, "hf_attnorm triton: no threshold search for this fused map MAP")
            f = mass - 1.0  # decreasing and convex in tau
            lo_t = tl.where(f >= 0, tau, lo_t)
            hi_t = tl.where(f >= 0, hi_t, tau)
            if THRESHOLD_EXPONENT == -1:
                # h = mass^(1/P): tau + (h - 1) / -h' = tau + (mass - mass^(1 - 1/P)) / slope. alpha > 2: bisection
                # (-2 is outside the bracket), as the C++ kernel: there the slope is infinite at the support's edge,
                # so Newton's steps on mass shrink to nothing away from the root and stop the search early
                mpow = tl.exp(tl.log(tl.where(mass > 0, mass, 1.0)) * (1.0 - am1))
                newton = tl.where(pw >= 1.0, tau + (mass - mpow) / tl.where(slope > 0, slope, 1.0), -2.0)
                newton = tl.where(tl.abs(f) <= 1e-7, tau, newton)  # at the root (one candidate: tau = -1): stay
            else:
                newton = tau + f / tl.where(slope > 0, slope, 1.0)
            ok = (slope > 0) & (newton >= lo_t) & (newton <= hi_t)
            nxt = tl.where(ok, newton, 0.5 * (lo_t + hi_t))
            conv = (tl.abs(f) <= 1e-7) | (tl.abs(nxt - tau) <= 2e-8 * tl.maximum(tl.abs(tau), 1.0))
            tau = tl.where(done, tau, nxt)
            done = done | conv
    tau = tl.where(has_keys, tau, 0.0)
    tl.store(TAU + pid_bh * LQ + offs_m, tau, mask=m_valid)


# ------------------------------------------------------------------------------------------------ backward


def _delta_blocks(delta, gsum, ent, q, do, r, score_scale, shift, inv, den1, mrow, am1, lo, hi, k_base, v_base,
                  keep_base, t_ptr, skn, skd, svn, svd, smm, smn, stn, offs_m, offs_n0, offs_d, offs_dv, m_valid,
                  d_valid, dv_valid, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn,
                  HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, HAS_FORGET: tl.constexpr,
                  MAP: tl.constexpr, NORMALISED: tl.constexpr, RUNNING_SHIFT: tl.constexpr,
                  THRESHOLD_EXPONENT: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
                  UPCAST: tl.constexpr, FAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                  MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dq kernel's first pass over the key blocks [lo, hi): delta = sum_j w_ij dp_ij (normalised maps) or
    sum_j g_ij dp_ij with gsum = sum_j g_ij and, for alpha-entmax, ent = sum_j p_ij ln p_ij."""
    for start_n in range(lo, hi, BLOCK_N):
        live = 1
        if HAS_MASK:
            live = tl.load(t_ptr + (start_n // BLOCK_N) * stn)
        if live != 0:
            s, kt, capd, fsg, keep, n_valid = _qk(
                q, start_n, k_base, keep_base, offs_m, offs_n0, offs_d, m_valid, d_valid, skn, skd, smm, smn,
                score_scale, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, HAS_BIAS,
                HAS_ALIBI, HAS_CAP, HAS_FORGET, CAUSAL, HAS_MASK, PREC, UPCAST, EVEN_D, MASKED)
            offs_n = start_n + offs_n0
            vt = _load_cols(v_base + offs_n[None, :] * svn + offs_dv[:, None] * svd, dv_valid, n_valid, EVEN_DV)
            if UPCAST:
                vt = vt.to(tl.float32)
            dp = tl.dot(do, vt, input_precision=PREC)
            if THRESHOLD_EXPONENT == -1:
                s = (s - mrow[:, None]) * am1[:, None]
            if NORMALISED:
                a, _b = _entry(s, r[:, None], keep, shift[:, None], MAP, RUNNING_SHIFT,
                               THRESHOLD_EXPONENT, MASKED, FAST)
                delta += tl.sum(a / den1[:, None] * dp, 1)
            else:
                a, g, _db = _slopes(s, r[:, None], keep, shift[:, None], MAP, RUNNING_SHIFT,
                                    THRESHOLD_EXPONENT, MASKED,
                                    FAST)
                delta += tl.sum(g * dp, 1)
                gsum += tl.sum(g, 1)
                if THRESHOLD_EXPONENT == -1:
                    pa = a * inv[:, None]
                    ent += tl.sum(tl.where(pa > 0, pa * tl.log(tl.where(pa > 0, pa, 1.0)), 0.0), 1)
    return delta, gsum, ent


def _dq_blocks(acc, dr, dfrow, q, do, r, score_scale, shift, inv, delta, gsum, ent, zg, mrow, am1, lo, hi, k_base,
               v_base, keep_base, t_ptr, skn, skd, svn, svd, smm, smn, stn, offs_m, offs_n0, offs_d, offs_dv, m_valid,
               d_valid, dv_valid, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn,
               DBIAS, sdb, sdh, sdm, sdn, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr,
               HAS_FORGET: tl.constexpr, HAS_DBIAS: tl.constexpr, DB_BM: tl.constexpr, DB_BN: tl.constexpr,
               MAP: tl.constexpr, NORMALISED: tl.constexpr, ROW_VALUE_USE: tl.constexpr,
               RUNNING_SHIFT: tl.constexpr, THRESHOLD_EXPONENT: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_MASK: tl.constexpr, PREC: tl.constexpr,
               UPCAST: tl.constexpr, FAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
               MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dq kernel's accumulation over the key blocks [lo, hi): acc [BM, BD] += dS K (dS in K's dtype), dr [BM]
    += the row value's gradient terms, dfrow [BM] += the decay's gradient at each query's own key (HAS_FORGET), the
    score bias's gradient added atomically."""
    for start_n in range(lo, hi, BLOCK_N):
        live = 1
        if HAS_MASK:
            live = tl.load(t_ptr + (start_n // BLOCK_N) * stn)
        if live != 0:
            s, kt, capd, fsg, keep, n_valid = _qk(
                q, start_n, k_base, keep_base, offs_m, offs_n0, offs_d, m_valid, d_valid, skn, skd, smm, smn,
                score_scale, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, HAS_BIAS,
                HAS_ALIBI, HAS_CAP, HAS_FORGET, CAUSAL, HAS_MASK, PREC, UPCAST, EVEN_D, MASKED)
            offs_n = start_n + offs_n0
            vt = _load_cols(v_base + offs_n[None, :] * svn + offs_dv[:, None] * svd, dv_valid, n_valid, EVEN_DV)
            if UPCAST:
                vt = vt.to(tl.float32)
            dp = tl.dot(do, vt, input_precision=PREC)
            if THRESHOLD_EXPONENT == -1:
                s = (s - mrow[:, None]) * am1[:, None]
            a, da, db = _slopes(s, r[:, None], keep, shift[:, None], MAP, RUNNING_SHIFT,
                                THRESHOLD_EXPONENT, MASKED, FAST)
            if NORMALISED:
                ds = (da * dp - db * delta[:, None]) * inv[:, None]
            elif (THRESHOLD_EXPONENT == 1) | (THRESHOLD_EXPONENT == 2):
                ds = da * (dp - delta[:, None])
            elif THRESHOLD_EXPONENT == -1:
                ds = da * zg[:, None] * (dp - delta[:, None])
            else:
                ds = da * dp
            if ROW_VALUE_USE == 1:  # score_offset: weight(s + r), d/dr = sum_j ds_j
                dr += tl.sum(ds, 1)
            if ROW_VALUE_USE == 2:  # weight_factor: r weight(s, 1), d/dr = sum_j weight(s_j, 1) dp_j
                a1, _b1 = _entry(s, r[:, None] * 0.0 + 1.0, keep, shift[:, None], MAP, RUNNING_SHIFT,
                                 THRESHOLD_EXPONENT, MASKED,
                                 FAST)
                dr += tl.sum(a1 * dp, 1)
            if ROW_VALUE_USE == 4:  # exponent: |s|^|r|, d/dp of a_j / D is a_j ln|s_j| (dp_j - delta) / D; ln|s|
                # centred at the row's largest (shift / p), which sum_j a_j (dp_j - delta) = 0 allows, against rounding
                mag = tl.abs(s)
                centre = shift / tl.maximum(tl.abs(r), 1.0)  # (|r| = p >= 1; 0 on rows past Lq)
                lg = tl.where(a > 0, tl.log(tl.where(a > 0, mag, 1.0)) - centre[:, None], 0.0)
                dr += tl.sum(a * lg * (dp - delta[:, None]), 1) * inv
            if THRESHOLD_EXPONENT == -1:
                pa = a * inv[:, None]
                pt = da / tl.where(gsum > 0, gsum, 1.0)[:, None]
                plp = tl.where(pa > 0, pa * tl.log(tl.where(pa > 0, pa, 1.0)), 0.0)
                coef = ((pa - pt) / am1[:, None] - (plp - pt * ent[:, None])) / am1[:, None]
                dr += tl.sum(coef * (dp - delta[:, None]), 1)
            if HAS_FORGET:  # dF_ij / dc_p = -sign(c_p - c_j): the row's sum goes to its own key's c
                dfrow -= tl.sum(ds * fsg, 1)
            if HAS_DBIAS:
                ds = _sel(keep, ds, MASKED)
                db_ptr = DBIAS + b * sdb + h * sdh
                if DB_BM and DB_BN:
                    tl.atomic_add(db_ptr, tl.sum(tl.sum(ds, 1), 0))
                elif DB_BM:
                    tl.atomic_add(db_ptr + offs_n * sdn, tl.sum(ds, 0), mask=n_valid)
                elif DB_BN:
                    tl.atomic_add(db_ptr + offs_m * sdm, tl.sum(ds, 1), mask=m_valid)
                else:
                    tl.atomic_add(db_ptr + offs_m[:, None] * sdm + offs_n[None, :] * sdn, ds,
                                  mask=m_valid[:, None] & n_valid[None, :])
            if HAS_CAP:
                ds = ds * capd  # w.r.t. the capped score -> w.r.t. score_scale q k^T
            acc += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PREC)
    return acc, dr, dfrow


def _bwd_dq_kernel(
    Q, K, V, SCORE_SCALE, R, KEEP, TABLE, SHIFT, DEN, DELTA, DO, DQ, DSCORE_SCALE, DR, DFROW, sqb, sqh, sqm, sqd, skb,
    skh, skn, skd, svb, svh, svn, svd, scb, sch, scm, smb, smh, smm, smn, stb, sth, stm, stn, H, GROUPS, LQ, LK, DH,
    DV, ROWMAX, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, DBIAS, sdb, sdh, sdm, sdn,
    LQ_KEY, LK_KEY, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, HAS_FORGET: tl.constexpr,
    HAS_DBIAS: tl.constexpr, DB_BM: tl.constexpr, DB_BN: tl.constexpr, MAP: tl.constexpr, NORMALISED: tl.constexpr,
    ROW_VALUE_USE: tl.constexpr, RUNNING_SHIFT: tl.constexpr, THRESHOLD_EXPONENT: tl.constexpr,
    DELTA_FROM_OUTPUT: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, FAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One program per (query block, batch x head): DQ [B, H, Lq, D] (input dtype), DSCORE_SCALE, DR and (HAS_FORGET)
    DFROW [B, H, Lq] (fp32; DFROW: the decay's gradient at each query's own key p_i).

    DELTA [B, H, Lq] (normalised and sparse maps): DELTA_FROM_OUTPUT: read (dO . O, from the host); otherwise
    written here by a first pass over the keys, for the dk/dv kernel. DO: contiguous, input dtype.
    alpha-entmax: DR = d alpha_i = sum_j dp_ij [(p - pt) / (alpha-1)^2 - (p ln p - pt H) / (alpha-1)]_ij
    (Correia et al. 2019, pt = g / sum g, H = sum p ln p), formed per entry in the second pass once G and H are
    known (no cancellation between row sums), with dp - delta for dp (allowed: the bracket sums to 0 over j).
    DBIAS (HAS_DBIAS): fp32 in the bias's own shape (strides 0 on its broadcast dims); dS w.r.t. the modified scores
    is summed over the block's broadcast dims (DB_BM: over queries, DB_BN: over keys) and added atomically, since
    programs of other batches / heads / query blocks may share the entries.

    Why the first pass (delta = sum_j w_ij dp_ij from the same dp as the second pass) where the declaration does not
    allow dO . O: a row with one visible key (or a one-key support) then gets ds = 0 exactly, and a map whose
    b'(s) / D is unbounded near s = 0 (squared 2 / |s|, symax and softpick 1 / D, power p / |s|) would amplify the
    rounding of O into ds (docs/triton.md has the measurement).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = h // GROUPS
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_valid = offs_m < LQ
    d_valid = offs_d < DH
    dv_valid = offs_dv < DV
    row = pid_bh.to(tl.int64) * LQ + offs_m
    q = _load_rows(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, m_valid, d_valid, EVEN_D)
    do = _load_rows(DO + row[:, None] * DV + offs_dv[None, :], m_valid, dv_valid, EVEN_DV)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    score_scale = tl.load(SCORE_SCALE + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
    r = tl.load(R + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
    shift = tl.load(SHIFT + row, mask=m_valid, other=0.0)
    den = tl.load(DEN + row, mask=m_valid, other=0.0)
    inv = tl.where(den != 0, 1.0 / tl.where(den != 0, den, 1.0), 0.0)
    den1 = tl.where(den != 0, den, 1.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    keep_base = KEEP + b * smb + h * smh
    t_ptr = TABLE + b * stb + h * sth + pid_m * stm
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dr = tl.zeros([BLOCK_M], tl.float32)
    dfrow = tl.zeros([BLOCK_M], tl.float32)
    delta = tl.zeros([BLOCK_M], tl.float32)
    gsum = tl.zeros([BLOCK_M], tl.float32)
    ent = tl.zeros([BLOCK_M], tl.float32)  # alpha-entmax: H = sum_j p_j ln p_j
    mrow = den
    am1 = den
    zg = den
    if THRESHOLD_EXPONENT == -1:
        mrow = tl.load(ROWMAX + row, mask=m_valid, other=0.0)
        am1 = r - 1.0
        # g of the renormalised p = a / Z, as the reference: (a / Z)^(2 - alpha) = a^(2 - alpha) Z^(alpha - 2)
        # (Z - 1 is about P times tau's rounding: 6e-5 at alpha = 1.001)
        zg = tl.exp(tl.log(tl.where(den > 0, den, 1.0)) * (r - 2.0))
    full, hi = _causal_ranges(start_m, LK, BLOCK_M, BLOCK_N, CAUSAL, HAS_MASK)
    if DELTA_FROM_OUTPUT:
        delta = tl.load(DELTA + row, mask=m_valid, other=0.0)
    elif NORMALISED or (THRESHOLD_EXPONENT != 0):
        delta, gsum, ent = _delta_blocks(
            delta, gsum, ent, q, do, r, score_scale, shift, inv, den1, mrow, am1, 0, full, k_base, v_base, keep_base,
            t_ptr, skn, skd, svn, svd, smm, smn, stn, offs_m, offs_n0, offs_d, offs_dv, m_valid, d_valid, dv_valid, LK,
            b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, HAS_BIAS, HAS_ALIBI, HAS_CAP,
            HAS_FORGET, MAP, NORMALISED, RUNNING_SHIFT, THRESHOLD_EXPONENT, CAUSAL, HAS_MASK, PREC, UPCAST, FAST,
            EVEN_D, EVEN_DV, False,
            BLOCK_N)
        delta, gsum, ent = _delta_blocks(
            delta, gsum, ent, q, do, r, score_scale, shift, inv, den1, mrow, am1, full, hi, k_base, v_base, keep_base,
            t_ptr, skn, skd, svn, svd, smm, smn, stn, offs_m, offs_n0, offs_d, offs_dv, m_valid, d_valid, dv_valid, LK,
            b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, HAS_BIAS, HAS_ALIBI, HAS_CAP,
            HAS_FORGET, MAP, NORMALISED, RUNNING_SHIFT, THRESHOLD_EXPONENT, CAUSAL, HAS_MASK, PREC, UPCAST, FAST,
            EVEN_D, EVEN_DV, True,
            BLOCK_N)
        if THRESHOLD_EXPONENT != 0:
            delta = tl.where(gsum > 0, delta / tl.where(gsum > 0, gsum, 1.0), 0.0)
        tl.store(DELTA + row, delta, mask=m_valid)
    acc, dr, dfrow = _dq_blocks(
        acc, dr, dfrow, q, do, r, score_scale, shift, inv, delta, gsum, ent, zg, mrow, am1, 0, full, k_base, v_base,
        keep_base, t_ptr, skn, skd, svn, svd, smm, smn, stn, offs_m, offs_n0, offs_d, offs_dv, m_valid, d_valid,
        dv_valid, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, DBIAS, sdb, sdh, sdm,
        sdn, HAS_BIAS, HAS_ALIBI, HAS_CAP, HAS_FORGET, HAS_DBIAS, DB_BM, DB_BN, MAP, NORMALISED, ROW_VALUE_USE,
        RUNNING_SHIFT, THRESHOLD_EXPONENT, CAUSAL, HAS_MASK, PREC, UPCAST, FAST,
        EVEN_D, EVEN_DV, False, BLOCK_N)
    acc, dr, dfrow = _dq_blocks(
        acc, dr, dfrow, q, do, r, score_scale, shift, inv, delta, gsum, ent, zg, mrow, am1, full, hi, k_base, v_base,
        keep_base, t_ptr, skn, skd, svn, svd, smm, smn, stn, offs_m, offs_n0, offs_d, offs_dv, m_valid, d_valid,
        dv_valid, LK, b, h, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, DBIAS, sdb, sdh, sdm,
        sdn, HAS_BIAS, HAS_ALIBI, HAS_CAP, HAS_FORGET, HAS_DBIAS, DB_BM, DB_BN, MAP, NORMALISED, ROW_VALUE_USE,
        RUNNING_SHIFT, THRESHOLD_EXPONENT, CAUSAL, HAS_MASK, PREC, UPCAST, FAST,
        EVEN_D, EVEN_DV, True, BLOCK_N)
    if ROW_VALUE_USE == 3:  # den_offset: r is added to the denominator
        dr = -delta * inv
    if ROW_VALUE_USE == 4:  # exponent: r = +-p (the sign marks single-key rows; their gradient is 0 anyway)
        dr = tl.where(r < 0, -dr, dr)
    tl.store(DQ + row[:, None] * DH + offs_d[None, :], (acc * score_scale[:, None]).to(DQ.dtype.element_ty),
             mask=m_valid[:, None] & d_valid[None, :])
    tl.store(DSCORE_SCALE + row, tl.sum(q.to(tl.float32) * acc, 1), mask=m_valid)
    tl.store(DR + row, dr, mask=m_valid)
    if HAS_FORGET:
        tl.store(DFROW + row, dfrow, mask=m_valid)


def _dkdv_blocks(dk, dv, dfcol, k, v, lo, hi, row0, q_base, keep_base, t_ptr, sqm, sqd, smm, smn, stm, offs_m0, offs_n,
                 offs_d, offs_dv, n_valid, d_valid, dv_valid, LQ, LK, b, h, scb, sch, scm, SCORE_SCALE, R, SHIFT, DEN,
                 DELTA, DO, ROWMAX, DV, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn,
                 HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, HAS_FORGET: tl.constexpr,
                 MAP: tl.constexpr, NORMALISED: tl.constexpr, RUNNING_SHIFT: tl.constexpr,
                 THRESHOLD_EXPONENT: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
                 UPCAST: tl.constexpr, FAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                 MASKED: tl.constexpr, BLOCK_M: tl.constexpr):
    """The dk/dv kernel's accumulation over the query blocks [lo, hi) of one query head, in the transposed
    orientation (as FlashAttention-2's backward): s^T [BN, BM] = K Q^T, then dv [BN, BDV] += W^T dO and dk [BN, BD]
    += (dS^T c) Q, with K, V and the weight tiles as the products' register operands and Q, dO read once per block
    (their transposes are free views of the same tiles)."""
    for start_m in range(lo, hi, BLOCK_M):
        live = 1
        if HAS_MASK:
            live = tl.load(t_ptr + (start_m // BLOCK_M) * stm)
        if live != 0:
            offs_m = start_m + offs_m0
            m_valid = offs_m < LQ
            row = row0 + offs_m
            qt = _load_cols(q_base + offs_m[None, :] * sqm + offs_d[:, None] * sqd, d_valid, m_valid, EVEN_D)
            do = _load_rows(DO + row[:, None] * DV + offs_dv[None, :], m_valid, dv_valid, EVEN_DV)
            if UPCAST:
                qt = qt.to(tl.float32)
                do = do.to(tl.float32)
            score_scale = tl.load(SCORE_SCALE + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
            r = tl.load(R + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)[None, :]
            shift = tl.load(SHIFT + row, mask=m_valid, other=0.0)[None, :]
            den = tl.load(DEN + row, mask=m_valid, other=0.0)[None, :]
            inv = tl.where(den != 0, 1.0 / tl.where(den != 0, den, 1.0), 0.0)
            delta = tl.load(DELTA + row, mask=m_valid, other=0.0)[None, :]
            st = tl.dot(k, qt, input_precision=PREC) * score_scale[None, :]  # [BN, BM]
            om = offs_m[None, :]
            on = offs_n[:, None]
            inside = n_valid[:, None] & m_valid[None, :]
            st, capd, fsg = _mods(st, b, h, om, on, inside, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF, FHI, FLO, sfb,
                                  sfh, sfn, LK, HAS_BIAS, HAS_ALIBI, HAS_CAP, HAS_FORGET)
            keep = 0
            if MASKED:
                keep = _keep(keep_base + om * smm + on * smn, om, on, inside, CAUSAL, HAS_MASK)
            if THRESHOLD_EXPONENT == -1:
                st = (st - tl.load(ROWMAX + row, mask=m_valid, other=0.0)[None, :]) * (r - 1.0)
            a, da, db = _slopes(st, r, keep, shift, MAP, RUNNING_SHIFT, THRESHOLD_EXPONENT, MASKED, FAST)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)  # [BN, BM]
            if NORMALISED:
                w = a * inv
                ds = (da * dpt - db * delta) * inv
            elif THRESHOLD_EXPONENT == -1:  # renormalised by Z, as the forward (and g, see the dq kernel)
                w = a * inv
                ds = da * tl.exp(tl.log(tl.where(den > 0, den, 1.0)) * (r - 2.0)) * (dpt - delta)
            elif (THRESHOLD_EXPONENT == 1) | (THRESHOLD_EXPONENT == 2):
                w = a
                ds = da * (dpt - delta)
            else:
                w = a
                ds = da * dpt
            dv += tl.dot(w.to(do.dtype), do, input_precision=PREC)
            if HAS_FORGET:  # dF_ij / dc_j = sign(c_p - c_j): the column's sum over this head's queries
                dfcol += tl.sum(ds * fsg, 1)
            if HAS_CAP:
                ds = ds * capd
            dk += tl.dot((ds * score_scale[None, :]).to(qt.dtype), tl.trans(qt), input_precision=PREC)
    return dk, dv, dfcol


def _bwd_dkdv_kernel(
    Q, K, V, SCORE_SCALE, R, KEEP, TABLE, SHIFT, DEN, DELTA, DO, DK, DV_OUT, DFCOL,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, scb, sch, scm,
    smb, smh, smm, smn, stb, sth, stm, stn,
    H, HKV, GROUPS, LQ, LK, DH, DV, ROWMAX,
    BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh, sfn, LQ_KEY, LK_KEY,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, HAS_FORGET: tl.constexpr,
    MAP: tl.constexpr, NORMALISED: tl.constexpr, RUNNING_SHIFT: tl.constexpr, THRESHOLD_EXPONENT: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, FAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One program per (key block, batch x kv head), looping over the GROUPS query heads that share the kv head:
    DK [B, Hkv, Lk, D] and DV_OUT [B, Hkv, Lk, Dv] (input dtype), so no atomics; (HAS_FORGET) DFCOL [B, H, Lk] fp32,
    the decay's gradient at each key from each query head. Causal: the query blocks from the
    first one holding a query i >= the block's first key; those whose every row sees every key of the block
    (i >= the block's last key) without a mask."""
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b = (pid_bk // HKV).to(tl.int64)
    hk = pid_bk % HKV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_valid = offs_n < LK
    d_valid = offs_d < DH
    dv_valid = offs_dv < DV
    k = _load_rows(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, n_valid, d_valid, EVEN_D)
    v = _load_rows(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd, n_valid, dv_valid,
                   EVEN_DV)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    end = tl.cdiv(LQ, BLOCK_M) * BLOCK_M
    lo = 0
    full = 0  # [lo, full): query blocks with a mask; [full, end): without
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M  # the first query block holding a query i >= this block's first key
        # the first query block whose every row i >= this block's last key (a ragged last key block included: its
        # keys past Lk only reach their own dk/dv rows, which are not stored)
        full = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, end)
    elif HAS_MASK:
        full = end
    for g in range(GROUPS):
        h = hk * GROUPS + g
        row0 = (b * H + h) * LQ
        q_base = Q + b * sqb + h * sqh
        keep_base = KEEP + b * smb + h * smh
        t_ptr = TABLE + b * stb + h * sth + pid_n * stn
        dfcol = tl.zeros([BLOCK_N], tl.float32)
        if CAUSAL or HAS_MASK:
            dk, dv, dfcol = _dkdv_blocks(
                dk, dv, dfcol, k, v, lo, full, row0, q_base, keep_base, t_ptr, sqm, sqd, smm, smn, stm, offs_m0,
                offs_n, offs_d, offs_dv, n_valid, d_valid, dv_valid, LQ, LK, b, h, scb, sch, scm, SCORE_SCALE, R,
                SHIFT, DEN, DELTA, DO, ROWMAX, DV, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh,
                sfn, HAS_BIAS, HAS_ALIBI, HAS_CAP, HAS_FORGET, MAP, NORMALISED, RUNNING_SHIFT, THRESHOLD_EXPONENT,
                CAUSAL,
                HAS_MASK, PREC, UPCAST, FAST, EVEN_D, EVEN_DV, True, BLOCK_M)
        if not HAS_MASK:
            # (rows past Lq load q = dO = 0 and contribute nothing; keys past Lk only reach unstored rows)
            dk, dv, dfcol = _dkdv_blocks(
                dk, dv, dfcol, k, v, full, end, row0, q_base, keep_base, t_ptr, sqm, sqd, smm, smn, stm, offs_m0,
                offs_n, offs_d, offs_dv, n_valid, d_valid, dv_valid, LQ, LK, b, h, scb, sch, scm, SCORE_SCALE, R,
                SHIFT, DEN, DELTA, DO, ROWMAX, DV, BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, FHI, FLO, sfb, sfh,
                sfn, HAS_BIAS, HAS_ALIBI, HAS_CAP, HAS_FORGET, MAP, NORMALISED, RUNNING_SHIFT, THRESHOLD_EXPONENT,
                CAUSAL,
                HAS_MASK, PREC, UPCAST, FAST, EVEN_D, EVEN_DV, False, BLOCK_M)
        if HAS_FORGET:  # this query head's column sums: each (head, key) is written by one program
            tl.store(DFCOL + (b * H + h) * LK + offs_n, dfcol, mask=n_valid)
    out_row = pid_bk.to(tl.int64) * LK + offs_n
    tl.store(DK + out_row[:, None] * DH + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=n_valid[:, None] & d_valid[None, :])
    tl.store(DV_OUT + out_row[:, None] * DV + offs_dv[None, :], dv.to(DV_OUT.dtype.element_ty),
             mask=n_valid[:, None] & dv_valid[None, :])


#: the device functions in dependency order (the generated per-entry functions come first: triton._compiled)
JIT_FUNCTIONS = ("_sel", "_sigmoid", "_tanh", "_entry", "_slopes", "_mods", "_keep", "_load_rows", "_load_cols",
                 "_causal_ranges", "_qk", "_rescale", "_fwd_blocks", "_fwd_kernel", "_threshold_kernel",
                 "_delta_blocks", "_dq_blocks", "_bwd_dq_kernel", "_dkdv_blocks", "_bwd_dkdv_kernel")
#: the kernels (launched from the host); the rest are device helpers
KERNELS = ("_fwd_kernel", "_threshold_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel")
