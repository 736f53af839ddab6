"""Every registered normalizer and scale against an independent transcription of its published formula.

The transcriptions below are plain float64 torch written from the papers (the sources each normalizer and scale
file cites; the formulas of the design notes), one query row at a time over its visible keys, without any helper
of hf_attnorm: they read only q, k, the keep-mask and option values. The library side is the reference path
(``variants.weights``), the one every fast path is tested against, so a formula that is wrong in the reference and
the kernels alike fails here. Each is checked with default options and with one non-default option set.

A normalizer or scale registered without a transcription here fails ``test_every_registered_*_has_a_transcription``:
a new one adds its transcription (and its paper) below.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
import torch

from hf_attnorm.attention import constant_heads, make_call
from hf_attnorm.kernels import attend
from hf_attnorm.kernels.variants import weights as reference_weights
from hf_attnorm.normalizers.base import Normalizer
from hf_attnorm.registry import NORMALIZERS, SCALES
from hf_attnorm.settings import resolve_settings

B, H, L, D = 2, 2, 6, 4
#: the attention module facts the scales read (L_train / L_orig from max_positions)
MODULE_INFO = {"max_positions": 4, "head_dim": D, "num_heads": H}
F64 = torch.float64
#: float64 comparisons, loose enough for what is exact only to ~1e-8 on either side: a maximum located by search
#: (max_gradient: alpha* to about sqrt(eps)), alpha-entmax's bisection, yarn's temperature (computed in float32);
#: a wrong formula is off by far more (sigmoid with -ln(n + 1) instead of -ln n: by up to 0.16 here)
RTOL, ATOL = 1e-6, 5e-8


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [B, H, L, D] (float64) and a causal keep-mask [B, 1, L, L] whose batch 1 has its first key padded: row 0
    of batch 0 sees one key, batch 1's row 0 sees none."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=F64) * 1.5
    k = torch.randn(B, H, L, D, generator=g, dtype=F64)
    keep = torch.ones(L, L, dtype=torch.bool).tril().expand(B, 1, L, L).clone()
    keep[1, :, :, 0] = False
    return q, k, keep


def _rows(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor):
    """(b, h, i, visible key indices, q_i, K of the visible keys) for every row with a visible key."""
    for b in range(B):
        for h in range(H):
            for i in range(L):
                idx = keep[b, 0, i].nonzero().flatten()
                if len(idx):
                    yield b, h, i, idx, q[b, h, i], k[b, h, idx]


def _softmax(x: torch.Tensor) -> torch.Tensor:
    e = torch.exp(x - x.max())
    return e / e.sum()


def _alpha_entmax(z: torch.Tensor, alpha: float) -> torch.Tensor:
    """Peters, Niculae & Martins 2019: p_i = [(alpha - 1) z_i - tau]_+^(1/(alpha - 1)), sum p = 1 (bisection on
    tau)."""
    x = (alpha - 1) * z
    lo, hi = x.max() - 1.0, x.max()  # sum at tau = max - 1 is >= 1, at tau = max it is 0
    for _ in range(200):
        mid = (lo + hi) / 2
        if (torch.relu(x - mid) ** (1 / (alpha - 1))).sum() > 1:
            lo = mid
        else:
            hi = mid
    return torch.relu(x - (lo + hi) / 2) ** (1 / (alpha - 1))


# ------------------------------------------------------------------------------------------- normalizer formulas
# Each: (q, k, keep, options) -> weights [B, H, L, L] (0 on invisible keys and rows without one); s = q.k / sqrt(d)
# unless the paper says otherwise.


def _per_row(row_fn: Callable[[torch.Tensor, dict, int], torch.Tensor]):
    """A formula given as row_fn(visible scores s, options, n) -> weights over those keys."""

    def weights(q, k, keep, opts):
        w = torch.zeros(B, H, L, L, dtype=F64)
        for b, h, i, idx, qi, kv in _rows(q, k, keep):
            s = kv @ qi / math.sqrt(D)
            w[b, h, i, idx] = row_fn(s, opts, len(idx))
        return w

    return weights


def _sparsemax_row(s, opts, n):
    """Martins & Astudillo 2016, Algorithm 1: sort z descending, k(z) = max{k : 1 + k z_(k) > sum_{j<=k} z_(j)},
    tau = (sum_{j<=k(z)} z_(j) - 1) / k(z), p = [z - tau]_+."""
    z = torch.sort(s, descending=True).values
    ks = torch.arange(1, n + 1, dtype=F64)
    support = 1 + ks * z > torch.cumsum(z, 0)
    kz = int(ks[support].max())
    tau = (z[:kz].sum() - 1) / kz
    return torch.relu(s - tau)


def _entmax15_row(s, opts, n):
    """Peters, Niculae & Martins 2019, Algorithm 2 (exact 1.5-entmax by sorting): z = s/2 sorted descending; for each
    k, tau_k = M_k - sqrt(max(0, (1 - k (S_k - M_k^2)) / k)) with M_k, S_k the means of z and z^2 over the top k;
    tau = tau_k of the largest k with tau_k <= z_(k); p = [z - tau]_+^2."""
    z = torch.sort(s / 2, descending=True).values
    tau = None
    for kk in range(1, n + 1):
        mean, sq = z[:kk].mean(), (z[:kk] ** 2).mean()
        tau_k = mean - torch.sqrt(torch.clamp((1 - kk * (sq - mean**2)) / kk, min=0))
        if tau_k <= z[kk - 1]:
            tau = tau_k
    return torch.relu(s / 2 - tau) ** 2


def _stablemax_g(x):
    return torch.where(x >= 0, x + 1, 1 / (1 - torch.clamp(x, max=0)))


def _softpick_row(s, opts, n):
    """Zuhri et al. 2025: relu(e^s - 1) / sum |e^s - 1| (0 where the sum is 0)."""
    num, den = torch.relu(torch.exp(s) - 1), (torch.exp(s) - 1).abs().sum()
    return num / den if den > 0 else torch.zeros_like(s)


def _cosine(q, k, keep, opts):
    """Softmax over T cos(q_i, k_j), T = tau x the max_gradient scale with the cosine score model in d dims (no
    1/sqrt(d)): QK-norm with a length-aware temperature."""
    w = torch.zeros(B, H, L, L, dtype=F64)
    tau = opts.get("cosine_temperature", 1.0)
    for b, h, i, idx, qi, kv in _rows(q, k, keep):
        cos = (kv @ qi) / (kv.norm(dim=-1) * qi.norm())
        w[b, h, i, idx] = _softmax(tau * _max_gradient_alpha(len(idx), "cosine", D) * cos)
    return w


def _linear(q, k, keep, opts):
    """Katharopoulos et al. 2020: phi(q_i).phi(k_j) / sum_j phi(q_i).phi(k_j), phi = elu + 1, no 1/sqrt(d)."""
    def phi(x):
        return torch.where(x > 0, x + 1, torch.exp(x))

    w = torch.zeros(B, H, L, L, dtype=F64)
    for b, h, i, idx, qi, kv in _rows(q, k, keep):
        a = phi(kv) @ phi(qi)
        w[b, h, i, idx] = a / a.sum()
    return w


def _hedgehog(q, k, keep, opts):
    """Zhang et al. 2024 (Hedgehog): phi(x) = [softmax(x W), softmax(-x W)] over the feature dim, W_h started at
    hedgehog_init x the identity (LoLCATs' start), weights phi(q_i).phi(k_j) / sum_j phi(q_i).phi(k_j), no
    1/sqrt(d)."""
    w_h = opts.get("hedgehog_init", 1.0) * torch.eye(D, dtype=F64)

    def phi(x):
        y = x @ w_h
        return torch.cat([torch.softmax(y, -1), torch.softmax(-y, -1)], -1)

    w = torch.zeros(B, H, L, L, dtype=F64)
    for b, h, i, idx, qi, kv in _rows(q, k, keep):
        a = phi(kv) @ phi(qi)
        w[b, h, i, idx] = a / a.sum()
    return w


def _asentmax(q, k, keep, opts):
    """Vasylenko et al. 2025: alpha-entmax(theta_i s_i), theta_i = delta + softplus(w . q_i) (ln n_i)^gamma on the raw
    q_i (w = 0 here: softplus(0) = ln 2)."""
    delta, gamma = opts.get("asentmax_delta", 1.0), opts.get("asentmax_gamma", 1.0)
    alpha = opts.get("entmax_alpha", 1.5)
    w = torch.zeros(B, H, L, L, dtype=F64)
    for b, h, i, idx, qi, kv in _rows(q, k, keep):
        theta = delta + math.log(2.0) * math.log(len(idx)) ** gamma
        w[b, h, i, idx] = _alpha_entmax(theta * (kv @ qi) / math.sqrt(D), alpha)
    return w


def _selective(q, k, keep, opts):
    """Leviathan, Kalman & Matias 2024, section 3: with S the selecting head's scores, R_kj = relu(S_kj) except
    R = 0 for j = BOS (the first live key) and j = k (a query never masks itself); F_ij = sum_{k < i} R_kj;
    w_i = softmax_j(s_ij - F_ij) over the visible keys, for every head."""
    sel = opts.get("selective_head", 0)
    w = torch.zeros(B, H, L, L, dtype=F64)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    for b in range(B):
        live_keys = keep[b, 0].any(0).nonzero().flatten()
        bos = int(live_keys[0])
        R = torch.zeros(L, L, dtype=F64)
        for kq in range(L):
            if not keep[b, 0, kq, kq]:  # a query whose own key is dead selects nothing
                continue
            for j in keep[b, 0, kq].nonzero().flatten().tolist():
                if j != bos and j != kq:
                    R[kq, j] = torch.relu(s[b, sel, kq, j])
        F = torch.cumsum(R, 0) - R  # exclusive: sum over k < i
        for h in range(H):
            for i in range(L):
                idx = keep[b, 0, i].nonzero().flatten()
                if len(idx):
                    w[b, h, i, idx] = _softmax(s[b, h, i, idx] - F[i, idx])
    return w


def _stickbreaking(q, k, keep, opts):
    """Tan et al. 2024: beta_ij = sigmoid(z_ij - c), A_ij = beta_ij prod_{j < k < i} (1 - beta_ik) over the visible
    keys j < i, nearest first (attend_current: j <= i, the query's own key breaks the stick too); the remainder
    prod_k (1 - beta_ik) goes to the query's own key when ``stickbreaking_remainder``; c = ``stickbreaking_offset``
    (0 in the paper; a converted model's per-head start)."""
    current = opts.get("stickbreaking_attend_current", False)
    remainder = opts.get("stickbreaking_remainder", True)
    offset = opts.get("stickbreaking_offset", 0.0)
    w = torch.zeros(B, H, L, L, dtype=F64)
    for b, h, i, idx, qi, kv in _rows(q, k, keep):
        z = kv @ qi / math.sqrt(D)
        beta = torch.sigmoid(z - offset)
        own = len(idx) - 1  # the last visible key is the query's own (causal)
        breakers = list(range(own, -1, -1)) if current else list(range(own - 1, -1, -1))
        left = torch.ones((), dtype=F64)
        row = torch.zeros(len(idx), dtype=F64)
        for j in breakers:  # nearest first
            row[j] = beta[j] * left
            left = left * (1 - beta[j])
        if remainder:
            row[own] = row[own] + left
        w[b, h, i, idx] = row
    return w


def _fox(q, k, keep, opts):
    """Lin et al. 2025, forgetting attention: softmax_j(s_ij + sum_{l=j+1..i} log f_l), f_l = sigmoid(w . x_l + b)
    per head; the gate reads position l's value vector (the test passes v = k) with every entry of w equal to
    fox_weight_init and b = fox_bias_init."""
    w_entry, bias = opts.get("fox_weight_init", 0.0), opts.get("fox_bias_init", 0.0)
    w = torch.zeros(B, H, L, L, dtype=F64)
    for b, h, i, idx, qi, kv in _rows(q, k, keep):
        s = kv @ qi / math.sqrt(D)
        f = torch.sigmoid(w_entry * k[b, h].sum(-1) + bias)  # the gate of every position
        decay = torch.stack([torch.log(f[j + 1:i + 1]).sum() for j in idx.tolist()])
        w[b, h, i, idx] = _softmax(s + decay)
    return w


#: differential attention's halves of a head's D = 4 query/key dims: rotary pairs (i, i + D/2) kept whole
DIFF_HALVES = ([0, 2], [1, 3])
DIFF_OPTIONS = {"diff_lambda_init": 0.5, "diff_lambda_std": 0.3, "diff_norm_init": 1.5}


def _diff_lambda(opts: dict) -> tuple[torch.Tensor, float]:
    """(lambda per head [H], lambda_init) of Ye et al. 2025: exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init,
    lambda_init = 0.8 - 0.6 exp(-0.3 l) at layer l = 0 unless given. The re-parameterisation vectors are parameters
    drawn at random (N(0, std^2)), so their values are read from the library's initial values."""
    heads = constant_heads(resolve_settings("diff", opts), H, head_dim=D)
    init = opts.get("diff_lambda_init")
    init = 0.8 - 0.6 * math.exp(-0.3 * 0) if init is None else init
    vec = {n: heads[f"diff_lambda_{n}"].to(F64) for n in ("q1", "k1", "q2", "k2")}
    lam = torch.exp((vec["q1"] * vec["k1"]).sum(-1)) - torch.exp((vec["q2"] * vec["k2"]).sum(-1)) + init
    return lam, init


def _diff(q, k, keep, opts):
    """Ye et al. 2025, differential attention: softmax(Q1 K1^T / sqrt(d)) - lambda softmax(Q2 K2^T / sqrt(d)), d the
    halves' dims (D/2)."""
    lam, _ = _diff_lambda(opts)
    first, second = DIFF_HALVES
    w = torch.zeros(B, H, L, L, dtype=F64)
    for b, h, i, idx, qi, kv in _rows(q, k, keep):
        s1 = kv[:, first] @ qi[first] / math.sqrt(D / 2)
        s2 = kv[:, second] @ qi[second] / math.sqrt(D / 2)
        w[b, h, i, idx] = _softmax(s1) - lam[h] * _softmax(s2)
    return w


NORMALIZER_FORMULAS: dict[str, tuple[Callable, dict]] = {
    # name: (formula, one non-default option set; {} where the normalizer has no options)
    "softmax": (_per_row(lambda s, o, n: _softmax(s)), {}),
    "softmax_n": (_per_row(lambda s, o, n: torch.exp(s) / (o.get("n_extra", 1.0) + torch.exp(s).sum())),
                  {"n_extra": 3.0}),  # Miller 2023, "Attention is off by one"
    "sink": (_per_row(lambda s, o, n: torch.exp(s) / (math.exp(o.get("sink_init", 0.0)) + torch.exp(s).sum())),
             {"sink_init": 0.7}),  # gpt-oss's per-head sink logit
    "symax": (_per_row(lambda s, o, n: s.abs() / (o.get("eta", 1.0) + s.abs().sum())), {"eta": 0.25}),
    "squared": (_per_row(lambda s, o, n: s**2 / (s**2).sum()), {}),
    # Ramapuram et al. 2024: sigmoid(s + b), b = -ln n by default
    "sigmoid": (_per_row(lambda s, o, n: torch.sigmoid(s + o.get("sigmoid_bias", -math.log(n)))),
                {"sigmoid_bias": -2.0}),
    "relu_len": (_per_row(lambda s, o, n: torch.relu(s) / n), {}),  # Wortsman et al. 2023
    "softpick": (_per_row(_softpick_row), {}),
    # Lv et al. 2024 (Cog attention): sign(s) softmax(|s|)
    "cog": (_per_row(lambda s, o, n: torch.sign(s) * _softmax(s.abs())), {}),
    "fox": (_fox, {"fox_weight_init": 0.4, "fox_bias_init": 1.5}),
    "gated": (_per_row(lambda s, o, n: _softmax(s)), {}),  # its weights are softmax's; the gate: OUTPUT_FORMULAS
    "diff": (_diff, DIFF_OPTIONS),
    "stablemax": (_per_row(lambda s, o, n: _stablemax_g(s) / _stablemax_g(s).sum()), {}),  # Prieto et al. 2025
    "sparsemax": (_per_row(_sparsemax_row), {}),
    "entmax15": (_per_row(_entmax15_row), {}),
    "entmax_alpha": (_per_row(lambda s, o, n: _alpha_entmax(s, o.get("entmax_alpha", 1.5))), {"entmax_alpha": 1.25}),
    "asentmax": (_asentmax, {"asentmax_delta": 0.5, "asentmax_gamma": 2.0, "entmax_alpha": 1.3}),
    "power": (_per_row(lambda s, o, n: s.abs() ** o.get("power_p", 2.0) / (s.abs() ** o.get("power_p", 2.0)).sum()),
              {"power_p": 3.0}),
    # Gao et al. 2025: softplus(s) / sum softplus(s)
    "softplus": (_per_row(lambda s, o, n: torch.nn.functional.softplus(s) / torch.nn.functional.softplus(s).sum()),
                 {}),
    "cosine": (_cosine, {"cosine_temperature": 2.0}),
    "linear": (_linear, {}),
    "hedgehog": (_hedgehog, {"hedgehog_init": 0.5}),
    "selective": (_selective, {"selective_head": 1}),
    "stickbreaking": (_stickbreaking, {"stickbreaking_attend_current": True, "stickbreaking_remainder": False,
                                       "stickbreaking_offset": 0.7}),
}


# ------------------------------------------------------------------------------------------------ scale formulas


@functools.cache
def _max_gradient_alpha(n: float, dist: str, d: int | None = None) -> float:
    """Su (kexue.fm/archives/9812): alpha* maximises alpha (1 - sum p^2), sum p^2 = E[e^{2 alpha s}] / (n E[e^{alpha
    s}]^2) for i.i.d. scores; s ~ N(0, 1) (E[e^{a s}] = e^{a^2/2}) or s = cos of unit vectors in d dims (density
    proportional to (1 - s^2)^((d-3)/2) on [-1, 1]). Maximised by golden-section search; 0 for n <= 1."""
    if n <= 1:
        return 0.0
    if dist == "normal":
        def ratio(a):
            return math.exp(a * a)
    else:
        theta = torch.linspace(0, math.pi, 20001, dtype=F64)
        s, dens = torch.cos(theta), torch.sin(theta) ** (d - 2)  # ds = sin(theta) dtheta

        def mgf(a):
            return float(torch.trapezoid(torch.exp(a * (s - 1)) * dens, theta))  # e^{-a} factored out

        norm = float(torch.trapezoid(dens, theta))

        def ratio(a):  # E[e^{2 a s}] / E[e^{a s}]^2 with E = (1 / norm) integral
            return mgf(2 * a) * norm / mgf(a) ** 2

    def objective(a):
        return a * (1 - ratio(a) / n)

    lo, hi = 0.0, (math.sqrt(math.log(n)) + 1.0) if dist == "normal" else 60.0 * math.log(n + 1) + 5
    gr = (math.sqrt(5) - 1) / 2
    for _ in range(90):
        a, c = hi - gr * (hi - lo), lo + gr * (hi - lo)
        if objective(a) > objective(c):
            hi = c
        else:
            lo = a
    return (lo + hi) / 2


def _yarn(n, o):
    s = o["yarn_factor"] if "yarn_factor" in o else max(1.0, n / o.get("train_length", MODULE_INFO["max_positions"]))
    return (0.1 * math.log(s) + 1) ** 2 if s > 1 else 1.0  # Peng et al. 2023, sqrt(1/t) = 0.1 ln s + 1


def _sparse_target(n, o):
    """k = 0.5 ln((1 - eps)(n - m) / (eps m)), m = c sqrt(n) (or c), at least the floor (the floor where n <= m)."""
    eps, c, floor = o.get("sparse_eps", 0.1), o.get("sparse_m", 1.0), o.get("sparse_floor", 1.0)
    m = c * math.sqrt(n) if o.get("sparse_m_rule", "sqrt") == "sqrt" else c
    if n <= m:
        return floor
    return max(floor, 0.5 * math.log((1 - eps) * (n - m) / (eps * m)))


def _empirical(n, o):
    """The measured table, linear in ln n between its points, clamped outside; the normal-model alpha* without one."""
    table = o.get("empirical_alpha_table")
    if table is None:
        return _max_gradient_alpha(n, "normal")
    xs, ys = [math.log(x) for x in table["n"]], table["alpha"]
    x = min(max(math.log(n), xs[0]), xs[-1])
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0]


#: name: (multiplier(n, 0-based query position, options), one non-default option set). The Llama 4 / Qwen / SSMax
#: forms follow the design notes (section 4) and the sources their files cite.
SCALE_FORMULAS: dict[str, tuple[Callable[[int, int, dict], float], dict]] = {
    "standard": (lambda n, pos, o: 1.0, {}),
    "log_n": (lambda n, pos, o: math.log(n), {}),  # Chiang & Cholak 2022
    # Nakanishi 2025: s ln n (+ b, the paper's bias variant); the anchor a mixes softmax's 1 in
    "ssmax": (lambda n, pos, o: (1 - o.get("ssmax_anchor", 0.0)) * (o.get("ssmax_s", 1.0) * math.log(n)
                                                                    + o.get("ssmax_bias", 0.0))
              + o.get("ssmax_anchor", 0.0), {"ssmax_s": 0.5, "ssmax_bias": 0.2, "ssmax_anchor": 0.25}),
    "log_train_n": (lambda n, pos, o: math.log(n) / math.log(o.get("train_length", MODULE_INFO["max_positions"])),
                    {"train_length": 3}),  # Su 2021, log_{L_train} n
    "qwen_logn": (lambda n, pos, o: max(1.0, math.log(n) / math.log(o.get("train_length",
                                                                          MODULE_INFO["max_positions"]))),
                  {"train_length": 2}),
    "llama4": (lambda n, pos, o: 1 + o.get("llama4_attn_scale", 0.1)
               * math.log(1 + math.floor(n / o.get("llama4_floor_scale", 8192.0))),
               {"llama4_attn_scale": 0.5, "llama4_floor_scale": 2.0}),
    "llama4_pos": (lambda n, pos, o: 1 + o.get("llama4_pos_beta", 0.1)
                   * math.log(1 + math.floor(pos / o.get("train_length", MODULE_INFO["max_positions"]))),
                   {"llama4_pos_beta": 0.3, "train_length": 2}),
    "yarn": (lambda n, pos, o: _yarn(n, o), {"yarn_factor": 3.0}),
    "sparse_target": (lambda n, pos, o: _sparse_target(n, o),
                      {"sparse_eps": 0.2, "sparse_m_rule": "const", "sparse_m": 1.0}),
    "max_gradient": (lambda n, pos, o: _max_gradient_alpha(n, o.get("max_gradient_dist", "normal"), D),
                     {"max_gradient_dist": "cosine"}),
    "empirical_max_gradient": (lambda n, pos, o: _empirical(n, o),
                               {"empirical_alpha_table": {"n": [2, 4], "alpha": [1.5, 2.5]},
                                "empirical_extrapolation": "clamp"}),
}


# ------------------------------------------------------------------------------------ formulas of the output
# For normalizers whose output is more than weights @ v. Each: (q, k, v, keep, options) -> out [B, H, L, Dv].


def _gated_output(q, k, v, keep, opts):
    """Qiu et al. 2025, gated attention (G1): Y' = softmax(s) V (.) sigmoid(x W_theta), per head and output dim; the
    gate reads the query vector q_i, W with every entry gated_weight_init, b = gated_bias_init."""
    w_entry, bias = opts.get("gated_weight_init", 0.0), opts.get("gated_bias_init", 0.0)
    out = torch.zeros(B, H, L, v.shape[-1], dtype=F64)
    for b, h, i, idx, qi, kv in _rows(q, k, keep):
        attended = _softmax(kv @ qi / math.sqrt(D)) @ v[b, h, idx]
        gate = torch.sigmoid(w_entry * qi.sum() + bias)  # q_i W_h: every output dim gets sum_d q_id W_dc
        out[b, h, i] = attended * gate
    return out


def _diff_output(q, k, v, keep, opts):
    """Ye et al. 2025: RMSNorm((A1 - lambda A2) V) x (1 - lambda_init) per head, eps 1e-5, the norm's weight
    diff_norm_init in every entry."""
    lam, init = _diff_lambda(opts)
    first, second = DIFF_HALVES
    out = torch.zeros(B, H, L, v.shape[-1], dtype=F64)
    for b, h, i, idx, qi, kv in _rows(q, k, keep):
        a1 = _softmax(kv[:, first] @ qi[first] / math.sqrt(D / 2))
        a2 = _softmax(kv[:, second] @ qi[second] / math.sqrt(D / 2))
        o = (a1 - lam[h] * a2) @ v[b, h, idx]
        out[b, h, i] = o / torch.sqrt((o**2).mean() + 1e-5) * opts.get("diff_norm_init", 1.0) * (1 - init)
    return out


OUTPUT_FORMULAS: dict[str, tuple[Callable, dict]] = {
    "gated": (_gated_output, {"gated_weight_init": 0.2, "gated_bias_init": -0.5}),
    "diff": (_diff_output, DIFF_OPTIONS),
}


def test_every_normalizer_with_an_output_gate_has_an_output_transcription():
    """Normalizers whose output is more than weights @ v (an output gate, differential halves) each have one."""
    special = {name for name, norm in NORMALIZERS.items()
               if type(norm).output_gate is not Normalizer.output_gate or norm.differential}
    missing = sorted(special - set(OUTPUT_FORMULAS))
    assert special and not missing, f"normalizers transforming their output without a transcription here: {missing}"


@pytest.mark.parametrize("options", ["default", "non-default"])
@pytest.mark.parametrize("name", sorted(OUTPUT_FORMULAS))
def test_output_is_its_published_formula(name, options):
    formula, other = OUTPUT_FORMULAS[name]
    opts = other if options == "non-default" else {}
    q, k, keep = _inputs(seed=2)
    v = torch.randn(B, H, L, D + 1, generator=torch.Generator().manual_seed(5), dtype=F64)
    settings = resolve_settings(name, opts)
    heads = {n: t.to(F64) for n, t in constant_heads(settings, H, head_dim=D, value_dim=D + 1).items()}
    call = make_call(q, k, v, settings, heads, keep, False, None, module_info=MODULE_INFO)
    got, _, _ = attend(call, "reference")
    want = formula(q, k, v, keep, opts)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} {opts}: {m}")


def _library_weights(name: str, q, k, keep, opts: dict) -> torch.Tensor:
    settings = resolve_settings(name, opts)
    heads = {n: t.to(F64) for n, t in constant_heads(settings, H, head_dim=D).items()}
    call = make_call(q, k, k, settings, heads, keep, False, None, module_info=MODULE_INFO)
    return reference_weights(call).to(F64)


def test_every_registered_normalizer_has_a_transcription():
    missing = sorted(set(NORMALIZERS) - set(NORMALIZER_FORMULAS))
    assert not missing, f"normalizers without a transcription of their paper's formula here: {missing}"


def test_every_registered_scale_has_a_transcription():
    missing = sorted(set(SCALES) - set(SCALE_FORMULAS))
    assert not missing, f"scales without a transcription of their paper's formula here: {missing}"


@pytest.mark.parametrize("options", ["default", "non-default"])
@pytest.mark.parametrize("name", sorted(NORMALIZER_FORMULAS))
def test_normalizer_reference_is_its_published_formula(name, options):
    if name not in NORMALIZERS:
        pytest.skip(f"{name} is not registered")
    formula, other = NORMALIZER_FORMULAS[name]
    if options == "non-default" and not other:
        pytest.skip(f"{name} has no options")
    opts = other if options == "non-default" else {}
    q, k, keep = _inputs()
    got = _library_weights(name, q, k, keep, opts)
    want = formula(q, k, keep, opts)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} {opts}: {m}")


@pytest.mark.parametrize("options", ["default", "non-default"])
@pytest.mark.parametrize("name", sorted(SCALE_FORMULAS))
def test_scale_is_its_published_formula(name, options):
    """softmax with the scale: softmax(m(n_i) q.k / sqrt(d)) with the transcribed multiplier m."""
    if name not in SCALES:
        pytest.skip(f"{name} is not registered")
    multiplier, other = SCALE_FORMULAS[name]
    if options == "non-default" and not other:
        pytest.skip(f"{name} has no options")
    opts = other if options == "non-default" else {}
    q, k, keep = _inputs(seed=1)
    got = _library_weights("softmax", q, k, keep, {"scale": name, **opts})
    want = torch.zeros_like(got)
    for b, h, i, idx, qi, kv in _rows(q, k, keep):
        m = multiplier(len(idx), i, opts)  # (queries are keys 0..L-1: position i)
        want[b, h, i, idx] = _softmax(m * (kv @ qi) / math.sqrt(D))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} {opts}: {m}")
