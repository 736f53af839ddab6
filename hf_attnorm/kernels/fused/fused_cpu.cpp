// Fused blocked CPU attention for the non-exponential normalizers of hf_attnorm (see cpu.py beside it).
//
// No [Lq, Lk] tensor is ever formed: a block of queries meets a block of keys, scores S = Q K^T go through the
// normalizer's map and are accumulated into the output O += A V and the row denominator D += sum A, all in a few
// cache-resident buffers. Sum-normalised and non-normalised maps need no running max (softpick keeps one, like
// flash softmax). The backward pass recomputes the blocks: with P = A / D and delta_i = dO_i . out_i,
//   dA_ij = (dO_i . v_j - delta_i) / D_i,  dS = dA * f'(S),  dV += P^T dO,  dK += dS^T Q,  dQ += dS K.
// The threshold maps (sparsemax, entmax-1.5) use two passes per query block in the forward: the scores of the block
// against every visible key (a [block, Lk] row buffer, O(n) memory), the exact threshold tau per row (on the keys
// within 1 of the row max, compacted: Newton from below, then the closed form on the settled support), then P V.
// Their Jacobian needs only dO_i . sum_j h(p_ij) v_j, which the forward computes as a second output U
// (h = sqrt p for entmax-1.5, [p > 0] for sparsemax), so the backward is the same single blocked pass as the
// others. Their supports are usually tiny: sparse blocks are accumulated entry by entry (forward and backward).
//
// Shapes: q [B, H, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (last dim contiguous, any other strides; head h
// uses kv head h / (H / Hkv)); keep: optional bool mask broadcast to [B, H, Lq, Lk] (strides may be 0); causal:
// query i sees keys j <= i (upper-left, as SDPA's is_causal); row_value [B, H, Lq]: the map's per-row value
// (symax: eta, sigmoid: bias, relu_len: 1/n, the others: n). q is already multiplied by every scale factor.
// Score modifiers (optional), applied to each score tile right after Q K^T, before the map: soft-cap
// s = cap tanh(s / cap), then an additive bias [B|1, H|1, Lq|1, Lk|1] read through its strides (broadcast dims
// never materialised), then ALiBi -slope_h |(Lk - Lq + i) - j|. The backward pass applies the same to the
// recomputed tiles, adds dS (w.r.t. the modified scores) into dbias, reduced over the broadcast dims, and
// multiplies dS by the cap's derivative 1 - tanh^2 before dQ and dK.
// Matmuls go to the BLAS inside libtorch_cpu (MKL sgemm_ in the x86 wheels), as SDPA's CPU flash kernel does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

namespace {

// Every per-map difference comes from the map's declaration in maps.py (FusedMap): its form and the form's numbers,
// by the names maps.FACTS shares with the Triton kernels (map_form(K), map_normalised(K), map_running_shift(K),
// map_threshold_exponent(K), map_row_value_use(K), map_single_key(K) and the constants FORM_THRESHOLD,
// RUNNING_SHIFT_MAX_SCORE, ROW_VALUE_USE_ALPHA, ...), in the generated hf_map_facts_generated.h
// (maps.cpp_facts_header; tests/test_fused_maps.py reads them back through map_facts), and its per-entry code
// (FusedMap.code) with the id list, in the generated hf_maps_generated.h (maps.cpp_header) included below.
// Nothing here names a map.
#include "hf_map_facts_generated.h"

inline bool is_declared(int64_t map_id) { return map_declared(map_id); }
// the forward driver of map K (FusedMap.driver): 0 forward_tiles, 1 forward_threshold (threshold exponent 1 or 2),
// 2 forward_alpha (the exponent 1 / (alpha - 1) from the row value)
constexpr int64_t driver_of(int64_t K) {
  return map_form(K) != FORM_THRESHOLD ? 0 : map_row_value_use(K) == ROW_VALUE_USE_ALPHA ? 2 : 1;
}
// alpha-entmax's U holds [U (Dv) | A = sum_j (d p_j / d alpha) v_j (Dv) | Z | H | M] per row (see forward_alpha)
inline int64_t u_width(int64_t map_id, int64_t Dv) {
  return map_row_value_use(map_id) == ROW_VALUE_USE_ALPHA ? 2 * Dv + 3 : Dv;
}

// ------------------------------------------------------------------------------------------------ elementwise math

// vexp (a vectorisable expf): cpu_common.h

// ln x for normal x > 0 that GCC vectorises (Cephes logf: mantissa in [sqrt(1/2), sqrt(2)), degree-8 polynomial,
// ~1 ulp); callers select away x <= 0 and subnormal x (treated as 0 by the power map).
inline float vlog(float x) {
  const int32_t bits = __builtin_bit_cast(int32_t, x);
  int32_t e = ((bits >> 23) & 0xff) - 126;
  float m = __builtin_bit_cast(float, (bits & 0x007fffff) | 0x3f000000);  // [0.5, 1)
  const bool small = m < 0.707106781186547524f;
  e = small ? e - 1 : e;
  m = small ? m + m - 1.0f : m - 1.0f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  const float fe = static_cast<float>(e);
  y += -2.12194440e-4f * fe - 0.5f * z;
  return m + y + 0.693359375f * fe;
}
inline double vlog(double x) { return std::log(x); }

// exp and ln in double that GCC vectorises, for alpha-entmax's x^y with non-integer y in float64 calls (its threshold
// search took one glibc pow per candidate per Newton step: 10% of its fwd+bwd). Both are plain series after range reduction, so
// the coefficients are exact: e^r = sum_k r^k / k! (k <= 13, |r| <= ln2 / 2: truncation < 4e-18) and
// ln m = 2 atanh(s) = 2 s sum_k s^2k / (2k + 1) (k <= 11, s = (m - 1)/(m + 1), |s| <= 0.172: < 1e-19); within a
// few ulp of std::exp / std::log. vexpd clamps to [-708, 708] (0 below); vlogd wants a normal x > 0.
inline __attribute__((always_inline)) double vexpd(double x) {
  x = std::min(std::max(x, -708.0), 708.0);
  const double n = std::floor(x * 1.4426950408889634 + 0.5);
  const double r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;  // fdlibm ln2 hi/lo
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const double scale = __builtin_bit_cast(double, (static_cast<int64_t>(n) + 1023) << 52);
  return x <= -708.0 ? 0.0 : p * scale;
}
inline __attribute__((always_inline)) double vlogd(double x) {
  const int64_t bits = __builtin_bit_cast(int64_t, x);
  int64_t e = ((bits >> 52) & 0x7ff) - 1022;
  double m = __builtin_bit_cast(double, (bits & 0x000fffffffffffffLL) | 0x3fe0000000000000LL);  // [0.5, 1)
  const bool small = m < 0.70710678118654752;
  e = small ? e - 1 : e;
  m = small ? m + m : m;
  const double s = (m - 1.0) / (m + 1.0), z = s * s;
  double q = 1.0 / 23.0;
  q = q * z + 1.0 / 21.0;
  q = q * z + 1.0 / 19.0;
  q = q * z + 1.0 / 17.0;
  q = q * z + 1.0 / 15.0;
  q = q * z + 1.0 / 13.0;
  q = q * z + 1.0 / 11.0;
  q = q * z + 1.0 / 9.0;
  q = q * z + 1.0 / 7.0;
  q = q * z + 1.0 / 5.0;
  q = q * z + 1.0 / 3.0;
  const double fe = static_cast<double>(e);
  return fe * 6.93147180369123816490e-01 + (2.0 * s + (2.0 * s * z * q + fe * 1.90821492927058770002e-10));
}
// e^x, ln x (normal x > 0) and x^y (normal x > 0) in T, vectorisable
inline __attribute__((always_inline)) float vexp_any(float x) { return vexp(x); }
inline __attribute__((always_inline)) double vexp_any(double x) { return vexpd(x); }
inline __attribute__((always_inline)) float vlog_any(float x) { return vlog(x); }
inline __attribute__((always_inline)) double vlog_any(double x) { return vlogd(x); }
inline __attribute__((always_inline)) float vpow_pos(float x, float y) { return vexp(y * vlog(x)); }
inline __attribute__((always_inline)) double vpow_pos(double x, double y) { return vexpd(y * vlogd(x)); }

// log1p(u) / u for u in [0, 1] (1 at u = 0): a degree-8 least-squares polynomial, relative error 1.5e-7 in fp32
// (no log, no division: softplus costs one exp and a polynomial)
inline float log1p_ratio(float u) {
  float r = 5.25345779702369e-3f;
  r = r * u - 2.9588507393099962e-2f;
  r = r * u + 7.836166801950378e-2f;
  r = r * u - 1.3674769705644496e-1f;
  r = r * u + 1.9111431080665497e-1f;
  r = r * u - 2.4844369892502244e-1f;
  r = r * u + 3.3319271342508355e-1f;
  r = r * u - 4.9999501516787836e-1f;
  return r * u + 9.999999705406568e-1f;
}
inline double log1p_ratio(double u) { return u > 0.0 ? std::log1p(u) / (u > 0.0 ? u : 1.0) : 1.0; }

// 1 / (1 + u) for u in [0, 1] without a division (softplus' backward: the divide was its costliest op): a
// quadratic seed (relative error 1.0e-2) and two Newton steps, r += r (1 - d r) (error ~1e-8, under fp32 rounding)
inline float inv_one_plus(float u) {
  const float d = 1.0f + u;
  float r = (3.2321503e-1f * u - 8.0803889e-1f) * u + 9.898825e-1f;
  r = r + r * (1.0f - d * r);
  return r + r * (1.0f - d * r);
}
inline double inv_one_plus(double u) { return 1.0 / (1.0 + u); }

// softplus in units of e^shift, shift = min(0, row max) <= 0 (the row's running shift, as softpick's): softplus(x) e^-shift
// with u = e^-|x|: (max(x, 0) + u r(u)) e^-shift, r(u) = log1p(u) / u. Rows whose every score is below SP_SLOW (where
// e^-shift would overflow and softplus(x) ~ e^x underflows) use e^(x - shift) r(u) (then x <= shift < 0, u = e^x), so they
// get softmax-like weights, not 0.
template <typename T>
constexpr T SP_SLOW = sizeof(T) == 4 ? T(-60) : T(-650);

template <typename T, bool SLOW>
inline T softplus_shifted(T x, T shift, T e_neg_shift) {
  const T u = vexp(-std::abs(x)), r = log1p_ratio(u);
  if constexpr (SLOW) return vexp(x - shift) * r;
  return (std::max(x, T(0)) + u * r) * e_neg_shift;
}

// s[j] <- f(j) for j < nb; returns the sum. The lanes accumulate in a vector-sized array, summed as a tree once:
// an `omp simd reduction` ends every call with a sequential sum over its lanes, about 10% of a 256-key row map.
constexpr int64_t LANES = 16;
template <typename T, typename F>
inline __attribute__((always_inline)) T map_sum(T* __restrict s, int64_t nb, const F& f) {
  T acc[LANES] = {};
  int64_t j = 0;
  for (; j + LANES <= nb; j += LANES) {
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l) {
      const T a = f(j + l);
      s[j + l] = a;
      acc[l] += a;
    }
  }
  T tail = 0;
  for (; j < nb; ++j) {
    const T a = f(j);
    s[j] = a;
    tail += a;
  }
  for (int64_t w = LANES / 2; w > 0; w /= 2) {
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0] + tail;
}

// softplus: s[j] <- softplus(s_j) e^-shift (0 where invisible); returns the sum. The slow form only on slow rows.
template <typename T, bool MASKED, bool SLOW>
T softplus_row(T* __restrict s, int64_t nb, const bool* __restrict keep, T shift, T e_neg_shift) {
  return map_sum(s, nb, [&](int64_t j) __attribute__((always_inline)) {
    const T a = softplus_shifted<T, SLOW>(s[j], shift, e_neg_shift);
    return MASKED ? (keep[j] ? a : T(0)) : a;
  });
}

// power map, log domain: "minus infinity" for |s| = 0 (kept finite: l - m stays finite) and its test threshold
template <typename T>
constexpr T POW_NEG = T(-1e30);

template <typename T>
inline T sgn(T x) {
  return T(x > T(0)) - T(x < T(0));
}

// HF_MAPS_FOR_EACH (the declared ids) and MapEntry<T, id> (the declared per-entry code), generated by cpu.py
#include "hf_maps_generated.h"

// ------------------------------------------------------------------------------------------------ row-major gemm

// sgemm_/dgemm_, blas_available and the row-major mm_abt / mm_ab / mm_atb wrappers: cpu_common.h

// ------------------------------------------------------------------------------------------------ problem

template <typename T>
struct Problem {
  int64_t map_id, B, H, Hkv, G, Lq, Lk, D, Dv, BQ, BK;
  const T *q, *k, *v, *row_value;
  int64_t qsb, qsh, qsl, ksb, ksh, ksl, vsb, vsh, vsl;
  const bool* keep;  // nullptr: no mask
  int64_t msb, msh, msl;
  bool causal;
  // score modifiers: bias (nullptr: none; strides 0 on broadcast dims; bsk 0: one value per row), ALiBi slopes [H]
  // (nullptr: none), soft-cap (0: none); dbias (backward, nullptr: not needed) has the bias's shape, contiguous
  const T *bias, *slopes;
  int64_t bsb, bsh, bsl, bsk, qoff;
  T cap;
  T* dbias;
  int64_t dsb, dsh, dsl, dsk;
  bool mods() const { return bias != nullptr || slopes != nullptr || cap != T(0); }

  const T* qrow(int64_t b, int64_t h, int64_t i) const { return q + b * qsb + h * qsh + i * qsl; }
  const T* krow(int64_t b, int64_t g, int64_t j) const { return k + b * ksb + g * ksh + j * ksl; }
  const T* vrow(int64_t b, int64_t g, int64_t j) const { return v + b * vsb + g * vsh + j * vsl; }
  const bool* mrow(int64_t b, int64_t h, int64_t i) const { return keep + b * msb + h * msh + i * msl; }
  // keys [0, key_end(i)) are causally visible to query i
  int64_t key_end(int64_t i) const { return causal ? std::min(Lk, i + 1) : Lk; }

  // Visibility of the tile queries [i0, i0+m) x keys [j0, j0+nb): 0 none, 1 all, 2 mixed.
  int tile(int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t nb) const {
    if (causal && j0 >= i0 + m) return 0;
    bool all = !causal || j0 + nb <= i0 + 1;
    if (keep == nullptr) return all ? 1 : 2;
    bool any = false;
    for (int64_t r = 0; r < m; ++r) {
      const bool* row = mrow(b, h, i0 + r) + j0;
      int64_t len = std::min(nb, key_end(i0 + r) - j0);
      if (len <= 0) continue;
      if (!any && std::memchr(row, 1, len) != nullptr) any = true;
      if (all && std::memchr(row, 0, nb) != nullptr) all = false;
      if (any && !all) return 2;
    }
    return any ? (all ? 1 : 2) : 0;
  }
};

template <typename T>
Problem<T> make_problem(int64_t map_id, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& keep, bool causal, const at::Tensor& row_value, int64_t block_q,
                        int64_t block_k, const std::optional<at::Tensor>& bias = std::nullopt,
                        const std::optional<at::Tensor>& slopes = std::nullopt, double cap = 0.0,
                        at::Tensor* dbias = nullptr) {
  Problem<T> p;
  p.map_id = map_id;
  p.B = q.size(0);
  p.H = q.size(1);
  p.Lq = q.size(2);
  p.D = q.size(3);
  p.Hkv = k.size(1);
  p.Lk = k.size(2);
  p.Dv = v.size(3);
  p.G = p.H / p.Hkv;
  p.BQ = block_q;
  p.BK = block_k;
  p.q = q.data_ptr<T>();
  p.k = k.data_ptr<T>();
  p.v = v.data_ptr<T>();
  p.row_value = row_value.data_ptr<T>();
  p.qsb = q.stride(0), p.qsh = q.stride(1), p.qsl = q.stride(2);
  p.ksb = k.stride(0), p.ksh = k.stride(1), p.ksl = k.stride(2);
  p.vsb = v.stride(0), p.vsh = v.stride(1), p.vsl = v.stride(2);
  p.causal = causal;
  if (keep.has_value()) {
    const at::Tensor& m = *keep;
    p.keep = m.data_ptr<bool>();
    p.msb = m.stride(0), p.msh = m.stride(1), p.msl = m.stride(2);
  } else {
    p.keep = nullptr;
    p.msb = p.msh = p.msl = 0;
  }
  // a size-1 dim is read with stride 0 (broadcast)
  auto bstride = [](const at::Tensor& x, int64_t d) { return x.size(d) == 1 ? int64_t(0) : x.stride(d); };
  p.bias = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  p.bsb = p.bsh = p.bsl = p.bsk = 0;
  if (bias.has_value()) {
    p.bsb = bstride(*bias, 0), p.bsh = bstride(*bias, 1), p.bsl = bstride(*bias, 2), p.bsk = bstride(*bias, 3);
  }
  p.slopes = slopes.has_value() ? slopes->data_ptr<T>() : nullptr;
  p.qoff = p.Lk - p.Lq;
  p.cap = static_cast<T>(cap);
  p.dbias = dbias != nullptr ? dbias->data_ptr<T>() : nullptr;
  p.dsb = p.dsh = p.dsl = p.dsk = 0;
  if (dbias != nullptr) {
    p.dsb = bstride(*dbias, 0), p.dsh = bstride(*dbias, 1), p.dsl = bstride(*dbias, 2), p.dsk = bstride(*dbias, 3);
  }
  return p;
}

void check_inputs(int64_t map_id, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& keep, const at::Tensor& row_value, int64_t block_q, int64_t block_k) {
  TORCH_CHECK(is_declared(map_id), "hf_attnorm fused_cpu: unknown fused map id ", map_id,
              " (not declared in kernels/fused/maps.py)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "fused_cpu: q, k, v must be 4-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "fused_cpu: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == row_value.scalar_type(),
              "fused_cpu: q, k, v, row_value must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, "fused_cpu: float32/float64 only");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "fused_cpu: last dim must be contiguous");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(3) == q.size(3) &&
                  v.size(1) == k.size(1) && v.size(2) == k.size(2) && q.size(1) % k.size(1) == 0,
              "fused_cpu: incompatible q, k, v shapes");
  TORCH_CHECK(row_value.is_contiguous() && row_value.dim() == 3 && row_value.size(0) == q.size(0) &&
                  row_value.size(1) == q.size(1) && row_value.size(2) == q.size(2),
              "fused_cpu: row_value must be contiguous [B, H, Lq]");
  TORCH_CHECK(block_q > 0 && block_k > 0, "fused_cpu: block sizes must be positive");
  TORCH_CHECK(blas_available(), "fused_cpu: this torch build exports no sgemm_/dgemm_");
  if (keep.has_value()) {
    const at::Tensor& m = *keep;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(0) == q.size(0) && m.size(1) == q.size(1) &&
                    m.size(2) == q.size(2) && m.size(3) == k.size(2) && m.stride(3) == 1,
                "fused_cpu: keep must be bool, expanded to [B, H, Lq, Lk] with a contiguous last dim");
  }
}

void check_mods(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& bias,
                const std::optional<at::Tensor>& slopes, double cap) {
  TORCH_CHECK(cap >= 0.0, "fused_cpu: softcap must be > 0 (0: none), got ", cap);
  if (bias.has_value()) {
    const at::Tensor& x = *bias;
    const int64_t full[4] = {q.size(0), q.size(1), q.size(2), k.size(2)};
    bool ok = x.dim() == 4 && x.scalar_type() == q.scalar_type();
    for (int d = 0; ok && d < 4; ++d) ok = x.size(d) == 1 || x.size(d) == full[d];
    TORCH_CHECK(ok && (x.size(3) == 1 || x.stride(3) == 1),
                "fused_cpu: bias must have q's dtype, shape [B|1, H|1, Lq|1, Lk|1] and a contiguous last dim");
  }
  if (slopes.has_value()) {
    TORCH_CHECK(slopes->dim() == 1 && slopes->size(0) == q.size(1) && slopes->is_contiguous() &&
                    slopes->scalar_type() == q.scalar_type(),
                "fused_cpu: ALiBi slopes must be contiguous [H] in q's dtype");
  }
}

// Runs fn(item, thread) for item in [0, n) on all intra-op threads, handing items out dynamically (causal query
// blocks differ in cost, so a static split would leave threads idle).
template <typename F>
void dynamic_for(int64_t n, int64_t nthreads, const F& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nthreads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t item = next.fetch_add(1); item < n; item = next.fetch_add(1)) fn(item, t);
    }
  });
}

// ------------------------------------------------------------------------------------------------ score modifiers

// tanh that GCC vectorises (Cephes tanhf: odd polynomial below 0.625, else from vexp; ~2 ulp)
inline float vtanh(float x) {
  const float ax = std::abs(x), z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float e = vexp(-2.0f * ax);
  const float big = (1.0f - e) / (1.0f + e);
  return ax < 0.625f ? p * z * x + x : (x < 0.0f ? -big : big);
}
inline double vtanh(double x) { return std::tanh(x); }

// Scores S[r * ld + j] of queries i0 + r (r < m) and keys j0 + j (j < nb) -> the modified scores (see the top);
// capd (optional, [m, nb]) receives 1 - tanh^2 for the backward pass.
template <typename T>
void modify_tile(const Problem<T>& p, T* S, int64_t ld, int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0,
                 int64_t nb, T* capd) {
  const T cap = p.cap, inv = cap != T(0) ? T(1) / cap : T(0);
  const T slope = p.slopes != nullptr ? p.slopes[h] : T(0);
  for (int64_t r = 0; r < m; ++r) {
    T* __restrict s = S + r * ld;
    if (cap != T(0)) {
      T* __restrict cd = capd != nullptr ? capd + r * nb : nullptr;
      if (cd != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < nb; ++j) {
          const T t = vtanh(s[j] * inv);
          s[j] = cap * t;
          cd[j] = T(1) - t * t;
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < nb; ++j) s[j] = cap * vtanh(s[j] * inv);
      }
    }
    if (p.bias != nullptr) {
      const T* __restrict br = p.bias + b * p.bsb + h * p.bsh + (i0 + r) * p.bsl;
      if (p.bsk == 0) {
        const T x = br[0];
#pragma omp simd
        for (int64_t j = 0; j < nb; ++j) s[j] += x;
      } else {
        br += j0;  // last dim contiguous (checked)
#pragma omp simd
        for (int64_t j = 0; j < nb; ++j) s[j] += br[j];
      }
    }
    if (p.slopes != nullptr) {
      const T pos = static_cast<T>(p.qoff + i0 + r - j0);  // query position relative to key j0
#pragma omp simd
      for (int64_t j = 0; j < nb; ++j) s[j] -= slope * std::abs(pos - static_cast<T>(j));
    }
  }
}

// dbias += dS of one tile ([m, nb], w.r.t. the modified scores), summed over the bias's broadcast dims. Tiles of
// different work items can meet in one dbias entry (bias shared across batch or heads): ``lock`` serialises them.
template <typename T>
void add_dbias(const Problem<T>& p, const T* dS, int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0,
               int64_t nb, std::mutex& lock) {
  std::lock_guard<std::mutex> guard(lock);
  for (int64_t r = 0; r < m; ++r) {
    T* __restrict dr = p.dbias + b * p.dsb + h * p.dsh + (i0 + r) * p.dsl;
    const T* __restrict g = dS + r * nb;
    if (p.dsk == 0) {
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < nb; ++j) acc += g[j];
      dr[0] += acc;
    } else {
      dr += j0;
#pragma omp simd
      for (int64_t j = 0; j < nb; ++j) dr[j] += g[j];
    }
  }
}

// ------------------------------------------------------------------------------------------------ forward: tiles

// The loops below are written branch-free (selects, no short-circuit conditions) so that GCC vectorises every
// instantiation; MASKED rows read keep[j] over keys the caller already limited to the causal range.

// the declared weight (FusedMap.code); ROW_VALUE_USE_WEIGHT_FACTOR maps: weight(s, 1), the row being scaled by r once
template <typename T, int64_t MAP>
inline T fmap(T x, T row_value) {
  if constexpr (MapEntry<T, MAP>::declared)
    return MapEntry<T, MAP>::weight(x, map_row_value_use(MAP) == ROW_VALUE_USE_WEIGHT_FACTOR ? T(1) : row_value);
  else static_assert(MAP < 0, "fmap: this fused map declares no per-entry code (fwd_tile_row sends it here)");
}

// s[j] <- A_j = f(s_j) (0 where invisible); returns sum_j A_j
template <typename T, int64_t MAP, bool MASKED>
T map_row(T* __restrict s, int64_t nb, const bool* __restrict keep, T row_value) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < nb; ++j) {
    T a = fmap<T, MAP>(s[j], row_value);
    if constexpr (MASKED) a = keep[j] ? a : T(0);
    s[j] = a;
    acc += a;
  }
  return acc;
}

template <typename T, bool MASKED>
T row_max(const T* __restrict s, int64_t nb, const bool* __restrict keep, T mx) {
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < nb; ++j) {
    T x = s[j];
    if constexpr (MASKED) x = keep[j] ? x : mx;
    mx = std::max(mx, x);
  }
  return mx;
}

// softpick: s[j] <- relu(e^{s_j - m} - e^{-m}); returns sum_j |e^{s_j - m} - e^{-m}|
template <typename T, bool MASKED>
T softpick_row(T* __restrict s, int64_t nb, const bool* __restrict keep, T m, T em) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < nb; ++j) {
    T u = vexp(s[j] - m) - em;
    if constexpr (MASKED) u = keep[j] ? u : T(0);
    acc += std::abs(u);
    s[j] = std::max(u, T(0));
  }
  return acc;
}

// cog: s[j] <- sign(s_j) e^{|s_j| - m}; returns sum_j e^{|s_j| - m} (m: the running max of |s|, from 0)
template <typename T, bool MASKED>
T cog_row(T* __restrict s, int64_t nb, const bool* __restrict keep, T m) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < nb; ++j) {
    const T x = s[j];
    T e = vexp(std::abs(x) - m);
    if constexpr (MASKED) e = keep[j] ? e : T(0);
    acc += e;
    s[j] = sgn(x) * e;
  }
  return acc;
}

// power and cog: the largest visible |s_j| (0 if none)
template <typename T, bool MASKED>
T abs_max_row(const T* __restrict s, int64_t nb, const bool* __restrict keep) {
  T mx = 0;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < nb; ++j) mx = std::max(mx, MASKED ? (keep[j] ? std::abs(s[j]) : T(0)) : std::abs(s[j]));
  return mx;
}

// x^NP for a small integer NP >= 0, by multiplications
template <int NP, typename T>
inline __attribute__((always_inline)) T ipow(T x) {
  if constexpr (NP == 0) return T(1);
  if constexpr (NP == 1) return x;
  if constexpr (NP == 2) return x * x;
  if constexpr (NP == 3) return x * x * x;
  if constexpr (NP == 4) {
    const T x2 = x * x;
    return x2 * x2;
  }
}

// 1 / M for a power row's shift m = p ln M (M: the row's largest |s|); 0 for rows with no nonzero score
template <typename T>
inline T power_inv_max(T m, T pw) {
  return m > T(0.5) * POW_NEG<T> ? static_cast<T>(std::exp(-static_cast<double>(m) / static_cast<double>(pw)))
                                 : T(0);
}

// power: s[j] <- |s_j|^p e^-m = (|s_j| / M)^p, m = p ln M (0 for |s_j| 0 or subnormal and invisible keys); returns
// the sum. NP > 0: p is that integer and the power is NP - 1 multiplications (no log, no exp); NP = 0: any real p,
// e^(p ln|s_j| - m).
template <typename T, bool MASKED, int NP>
T power_row(T* __restrict s, int64_t nb, const bool* __restrict keep, T pw, T m) {
  const T tiny = std::numeric_limits<T>::min(), inv = power_inv_max(m, pw);
  return map_sum(s, nb, [&](int64_t j) __attribute__((always_inline)) {
    const T ax = std::abs(s[j]);
    T a;
    if constexpr (NP > 0) {  // in double: one rounding (fp32 products lost ~2x in dq / dk / dp accuracy at p = 3)
      a = static_cast<T>(ipow<NP>(static_cast<double>(ax) * static_cast<double>(inv)));
    } else {
      a = ax >= tiny ? vexp(pw * vlog(std::max(ax, tiny)) - m) : T(0);
    }
    return MASKED ? (keep[j] ? a : T(0)) : a;
  });
}

// which integer fast path of the power map p takes (0: none)
template <typename T>
inline int power_int(T pw) {
  return pw == T(1) ? 1 : pw == T(2) ? 2 : pw == T(3) ? 3 : pw == T(4) ? 4 : 0;
}

template <typename T, bool MASKED>
T power_row_any(T* s, int64_t nb, const bool* keep, T pw, T m) {
  switch (power_int(pw)) {
    case 1: return power_row<T, MASKED, 1>(s, nb, keep, pw, m);
    case 2: return power_row<T, MASKED, 2>(s, nb, keep, pw, m);
    case 3: return power_row<T, MASKED, 3>(s, nb, keep, pw, m);
    case 4: return power_row<T, MASKED, 4>(s, nb, keep, pw, m);
    default: return power_row<T, MASKED, 0>(s, nb, keep, pw, m);
  }
}

// One row of keys [0, nb) of a tile: visible are keys < lim (causality) that keep allows (keep nullptr: all).
// Maps the scores in place to the numerator and adds to the row's denominator (softpick: with its running max).
template <typename T, int64_t MAP>
inline void fwd_tile_row(const bool* kr, int64_t lim, T* s, int64_t nb, T row_value, T& den, T& mrow, T* orow,
                         int64_t Dv) {
  lim = std::max<int64_t>(0, std::min(lim, nb));
  if constexpr (map_running_shift(MAP) == RUNNING_SHIFT_MAX_SCORE) {
    T mx = kr ? row_max<T, true>(s, lim, kr, mrow) : row_max<T, false>(s, lim, nullptr, mrow);
    if (mx > mrow) {  // rescale what was accumulated under the old shift (flash-softmax style)
      const T sc = vexp(mrow - mx);
      for (int64_t d = 0; d < Dv; ++d) orow[d] *= sc;
      den *= sc;
      mrow = mx;
    }
    const T em = vexp(-mrow);
    den += kr ? softpick_row<T, true>(s, lim, kr, mrow, em) : softpick_row<T, false>(s, lim, nullptr, mrow, em);
  } else if constexpr (map_running_shift(MAP) == RUNNING_SHIFT_MAX_ABS_EXP) {
    // cog: sign(s) e^{|s|} over sum e^{|s|}, relative to the running max of |s| (from 0), rescaled like softpick
    const T mx = kr ? abs_max_row<T, true>(s, lim, kr) : abs_max_row<T, false>(s, lim, nullptr);
    if (mx > mrow) {
      const T sc = vexp(mrow - mx);
      for (int64_t d = 0; d < Dv; ++d) orow[d] *= sc;
      den *= sc;
      mrow = mx;
    }
    den += kr ? cog_row<T, true>(s, lim, kr, mrow) : cog_row<T, false>(s, lim, nullptr, mrow);
  } else if constexpr (map_running_shift(MAP) == RUNNING_SHIFT_LOG_ABS_MAX) {
    // |s|^p relative to the row's running largest |s| = M (shift m = p ln M, rescaled like softpick when it grows),
    // so large |s| or p cannot overflow: (|s| / M)^p, by multiplications for integer p; row_value = +-p (the sign only marks
    // single-key rows for the backward pass). The max is of |s| (one cheap pass), its log taken once per row.
    const T pw = std::abs(row_value);
    const T amax = kr ? abs_max_row<T, true>(s, lim, kr) : abs_max_row<T, false>(s, lim, nullptr);
    if (amax >= std::numeric_limits<T>::min()) {
      const T mx = pw * static_cast<T>(std::log(static_cast<double>(amax)));
      if (mx > mrow) {
        const T sc = vexp(mrow - mx);
        for (int64_t d = 0; d < Dv; ++d) orow[d] *= sc;
        den *= sc;
        mrow = mx;
      }
    }
    if (mrow > T(0.5) * POW_NEG<T>) {
      den += kr ? power_row_any<T, true>(s, lim, kr, pw, mrow) : power_row_any<T, false>(s, lim, nullptr, pw, mrow);
    } else {
      std::fill(s, s + lim, T(0));  // no nonzero score yet: weights 0
    }
  } else if constexpr (map_running_shift(MAP) == RUNNING_SHIFT_MAX_SCORE_BELOW_ZERO) {
    // shift shift = min(0, running max), rescaled like softpick when it rises; once 0 (a score >= 0 was seen: most
    // rows after their first tile) it stays, and the max pass is skipped
    const T mx = mrow >= T(0) ? mrow
                 : std::min(kr ? row_max<T, true>(s, lim, kr, mrow) : row_max<T, false>(s, lim, nullptr, mrow), T(0));
    if (mx > mrow) {
      const T sc = vexp(mrow - mx);
      for (int64_t d = 0; d < Dv; ++d) orow[d] *= sc;
      den *= sc;
      mrow = mx;
    }
    const T shift = mrow, e_neg_shift = vexp(-std::max(shift, SP_SLOW<T>));
    if (shift < SP_SLOW<T>) {
      den += kr ? softplus_row<T, true, true>(s, lim, kr, shift, e_neg_shift)
                : softplus_row<T, false, true>(s, lim, nullptr, shift, e_neg_shift);
    } else {
      den += kr ? softplus_row<T, true, false>(s, lim, kr, shift, e_neg_shift)
                : softplus_row<T, false, false>(s, lim, nullptr, shift, e_neg_shift);
    }
  } else {
    den += kr ? map_row<T, MAP, true>(s, lim, kr, row_value)
       : map_row<T, MAP, false>(s, lim, nullptr, row_value);
  }
  for (int64_t j = lim; j < nb; ++j) s[j] = T(0);
}

constexpr int64_t MAX_BQ = 512;
// threshold maps: a block whose support covers at most 1/SPARSE_RATIO of its scores is accumulated entry by entry
// instead of with dense matmuls (entmax/sparsemax rows typically keep a few dozen keys out of thousands)
constexpr int64_t SPARSE_RATIO = 16;

// Few queries (a decode step: Lq rows per head in one query block): the G query heads of a kv head are one block of
// G * Lq rows, so Q K^T and A V are one matrix product per kv head and key block instead of G thin ones (q and out
// are contiguous [B, H, Lq, *], so those rows are consecutive). Only where there are at least as many kv heads as
// threads, so that grouping costs no parallelism.
template <typename T>
inline bool group_heads(const Problem<T>& p, int64_t nthreads) {
  return p.G > 1 && p.Lq <= p.BQ && p.G * p.Lq <= MAX_BQ && (p.Lq == 1 || p.qsh == p.Lq * p.qsl) &&
         p.B * p.Hkv >= nthreads;
}

template <typename T, int64_t MAP>
void forward_tiles(const Problem<T>& p, T* out, T* r1, T* r2) {
  const int64_t nthreads = at::get_num_threads();
  const bool grouped = group_heads(p, nthreads);
  const int64_t hg = grouped ? p.G : 1;  // query heads per work item
  const int64_t bq = std::min(p.BQ, p.Lq), nqb = (p.Lq + bq - 1) / bq;
  const int64_t BHg = p.B * (p.H / hg);
  // grouped rows of q are consecutive: at stride qsh for one query, qsl for a whole [Lq, D] head
  const int64_t lda = grouped && p.Lq == 1 ? p.qsh : p.qsl;
  std::vector<std::vector<T>> sbuf(nthreads), obuf(nthreads);
  dynamic_for(BHg * nqb, nthreads, [&](int64_t item, int64_t t) {
    const int64_t qb = nqb - 1 - item / BHg, bhg = item % BHg, b = bhg / (p.H / hg), h0 = (bhg % (p.H / hg)) * hg;
    const int64_t g = h0 / p.G;
    const int64_t i0 = qb * bq, m = std::min(bq, p.Lq - i0), rows = hg * m;
    auto& S = sbuf[t];
    auto& O = obuf[t];
    if (S.empty()) {
      S.resize(hg * bq * p.BK);
      O.resize(hg * bq * p.Dv);
    }
    T den[MAX_BQ], mrow[MAX_BQ];
    // row r is head h0 + r / m, query i0 + r % m; grouped (m = Lq, i0 = 0) or not (hg = 1), its per-row values sit
    // at base + r
    const int64_t base = (b * p.H + h0) * p.Lq + i0;
    const T* row_values = p.row_value + base;
    for (int64_t r = 0; r < rows; ++r) {
      den[r] = (map_row_value_use(MAP) == ROW_VALUE_USE_DEN_OFFSET) ? row_values[r] : T(0);
      mrow[r] = map_running_shift(MAP) == RUNNING_SHIFT_LOG_ABS_MAX ||
                        map_running_shift(MAP) == RUNNING_SHIFT_MAX_SCORE_BELOW_ZERO
                    ? POW_NEG<T>
                    : T(0);
    }
    std::fill(O.begin(), O.begin() + rows * p.Dv, T(0));
    const int64_t jend = p.causal ? std::min(p.Lk, i0 + m) : p.Lk;
    const T* qi = p.qrow(b, h0, i0);
    for (int64_t j0 = 0; j0 < jend; j0 += p.BK) {
      const int64_t nb = std::min(p.BK, jend - j0);
      int st = p.tile(b, h0, i0, m, j0, nb);
      for (int64_t hh = 1; hh < hg && p.keep != nullptr; ++hh) {  // (without a mask every head's tile is alike)
        const int sh = p.tile(b, h0 + hh, i0, m, j0, nb);
        st = st == sh ? st : 2;
      }
      if (st == 0) continue;
      mm_abt<T>(rows, nb, p.D, qi, lda, p.krow(b, g, j0), p.ksl, T(0), S.data(), nb);
      for (int64_t hh = 0; hh < hg && p.mods(); ++hh)
        modify_tile(p, S.data() + hh * m * nb, nb, b, h0 + hh, i0, m, j0, nb, static_cast<T*>(nullptr));
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = h0 + r / m, i = i0 + r % m;
        const bool* kr = st == 2 && p.keep ? p.mrow(b, h, i) + j0 : nullptr;
        fwd_tile_row<T, MAP>(kr, st == 1 ? nb : p.key_end(i) - j0, S.data() + r * nb, nb, row_values[r], den[r],
                              mrow[r], O.data() + r * p.Dv, p.Dv);
      }
      mm_ab<T>(rows, p.Dv, nb, S.data(), nb, p.vrow(b, g, j0), p.vsl, T(1), O.data(), p.Dv);
    }
    T* orow = out + base * p.Dv;
    for (int64_t r = 0; r < rows; ++r) {
      T scale = T(1);
      if (map_normalised(MAP)) scale = den[r] != T(0) ? T(1) / den[r] : T(0);
      if (map_row_value_use(MAP) == ROW_VALUE_USE_WEIGHT_FACTOR) scale = row_values[r];
      for (int64_t d = 0; d < p.Dv; ++d) orow[r * p.Dv + d] = O[r * p.Dv + d] * scale;
      r1[base + r] = den[r];
      r2[base + r] = mrow[r];
    }
  });
}

// ------------------------------------------------------------------------------------------------ forward: thresholds

// tau with sum_j [y_j - tau]_+^POW = 1 (POW 2: entmax-1.5, 1: sparsemax); y has max 0, invisible keys -inf.
// Newton from tau = -1 approaches tau* from below (the map is convex and decreasing) and never overshoots; each
// step also tries the closed form on the current support {y > t}, which is exact once that support is the true one
// (checked: every support element must stay >= the candidate tau). Computed in T (fp32 for fp32 / fp16 / bf16
// inputs): the sums are of positive terms, and entmax-1.5's closed form is taken in centred moments, where the raw
// form (the discriminant s1^2 - cnt (s2 - 1)) cancels to a relative error of cnt x eps on long dense rows.
template <typename T, bool ENTMAX>
T find_threshold(const T* y, int64_t L) {
  constexpr T inf = std::numeric_limits<T>::infinity();
  T t = T(-1);
  bool refined = false;
  for (int it = 0; it < 200; ++it) {
    T cnt = 0, s1 = 0, s2 = 0, ymin = inf;
#pragma omp simd reduction(+ : cnt, s1, s2) reduction(min : ymin)
    for (int64_t j = 0; j < L; ++j) {
      const T d = y[j] - t;
      const bool in = d > T(0);
      const T dd = in ? d : T(0);
      cnt += in ? T(1) : T(0);
      s1 += dd;
      s2 += dd * dd;
      ymin = std::min(ymin, in ? d : inf);
    }
    if (cnt == T(0)) return t;  // unreachable for t < 0 = max y; kept for safety
    T u, step;
    if constexpr (ENTMAX) {
      // sum_S (d_j - u)^2 = m2 + cnt (mean - u)^2 = 1 over the support S, m2 = sum_S (d_j - mean)^2: the smaller
      // root u = mean - sqrt((1 - m2) / cnt); m2 > 1: no root, this support is still too wide. (On the true support
      // 1 - m2 = cnt rbar^2 may be small, but its rounding moves u by about eps: absolute, at the scale of y.)
      const T mean = s1 / cnt;
      T m2 = 0;
#pragma omp simd reduction(+ : m2)
      for (int64_t j = 0; j < L; ++j) {
        const T d = y[j] - t;
        const T e = d > T(0) ? d - mean : T(0);
        m2 += e * e;
      }
      u = m2 <= T(1) ? mean - std::sqrt((T(1) - m2) / cnt) : inf;
      // Newton on sqrt(f) = ||[y - t]_+||_2: convex and decreasing as well (a monotone norm of convex functions), so
      // from below it never overshoots either, and far from tau* it is nearly linear where f is quadratic (f's own
      // Newton step only halves the distance there): fewer passes on dense rows
      step = (s2 - std::sqrt(s2)) / s1;
    } else {
      u = (s1 - T(1)) / cnt;
      step = u;
    }
    if (u <= ymin) {
      // exact on this support; solved once more from t + u (entmax-1.5), where the support's d_j are the small
      // [y_j - tau]_+ themselves: from t far below, mean ~ 1 left u with an absolute rounding of eps, a relative
      // error of eps / r_j in each r_j = y_j - tau (1e-5 in the weights of a near-uniform row of 1,024 keys)
      if (!ENTMAX || refined) return t + u;
      refined = true;
      t += u;
      continue;
    }
    if (!(t + step > t)) return t;  // no progress left at this precision
    t += step;
  }
  return t;
}

// uout nullptr: U is not wanted (no backward pass will run, e.g. inference): its buffer and matmul are skipped
template <typename T, int64_t MAP>
void forward_threshold(const Problem<T>& p, T* out, T* r1, T* r2, T* uout) {
  constexpr bool ENTMAX = (map_threshold_exponent(MAP) == 2);
  const T half = ENTMAX ? T(0.5) : T(1);
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t nqb = (p.Lq + p.BQ - 1) / p.BQ;
  const int64_t nthreads = at::get_num_threads();
  const int64_t BH = p.B * p.H;
  struct Buffers {
    std::vector<T> S, Hb, cand, pv, hv;
    std::vector<int32_t> cidx, ix;
  };
  std::vector<Buffers> bufs(nthreads);
  dynamic_for(BH * nqb, nthreads, [&](int64_t item, int64_t t) {
    const int64_t qb = nqb - 1 - item / BH, bh = item % BH, b = bh / p.H, h = bh % p.H, g = h / p.G;
    const int64_t i0 = qb * p.BQ, m = std::min(p.BQ, p.Lq - i0);
    const int64_t L = p.causal ? std::min(p.Lk, i0 + m) : p.Lk;
    T* orow = out + (bh * p.Lq + i0) * p.Dv;
    T* urow = uout != nullptr ? uout + (bh * p.Lq + i0) * p.Dv : nullptr;
    const bool want_u = urow != nullptr;
    if (L == 0) {
      std::fill(orow, orow + m * p.Dv, T(0));
      if (want_u) std::fill(urow, urow + m * p.Dv, T(0));
      for (int64_t r = 0; r < m; ++r) r1[bh * p.Lq + i0 + r] = r2[bh * p.Lq + i0 + r] = T(0);
      return;
    }
    Buffers& buf = bufs[t];
    if (buf.S.empty()) {
      const int64_t rows = std::min(p.BQ, p.Lq);  // (a decode step: one row, not a block's)
      buf.S.resize(rows * p.Lk);
      if (want_u) buf.Hb.resize(rows * p.Lk);
      buf.cand.resize(p.Lk);
      buf.cidx.resize(p.Lk);
      const size_t cap = rows * p.Lk / SPARSE_RATIO + 1;
      buf.pv.resize(cap);
      buf.hv.resize(cap);
      buf.ix.resize(cap);
    }
    const int64_t cap = m * L / SPARSE_RATIO;  // support entries the sparse accumulation takes
    int64_t support[MAX_BQ + 1];
    support[0] = 0;
    bool sparse = true;
    T* S = buf.S.data();
    T* Hb = buf.Hb.data();
    mm_abt<T>(m, L, p.D, p.qrow(b, h, i0), p.qsl, p.krow(b, g, 0), p.ksl, T(0), S, L);
    if (p.mods()) modify_tile(p, S, L, b, h, i0, m, 0, L, static_cast<T*>(nullptr));
    for (int64_t r = 0; r < m; ++r) {
      const int64_t i = i0 + r, lim = std::min(L, p.key_end(i));
      const bool* kr = p.keep ? p.mrow(b, h, i) : nullptr;
      T* srow = S + r * L;
      T* hrow = want_u ? Hb + r * L : nullptr;
      T zmax = ninf;
      if (kr != nullptr) {
#pragma omp simd reduction(max : zmax)
        for (int64_t j = 0; j < lim; ++j) zmax = std::max(zmax, kr[j] ? srow[j] * half : ninf);
      } else {
#pragma omp simd reduction(max : zmax)
        for (int64_t j = 0; j < lim; ++j) zmax = std::max(zmax, srow[j] * half);
      }
      T tau = T(0), hs = T(0);
      int64_t cnt = support[r];
      if (zmax != ninf) {
        // tau >= zmax - 1 (the top key alone reaches 1), so only keys above it can be in the support: compact
        // them once (usually a small fraction) and solve on those
        const T thr = zmax - T(1);
        int64_t nc = 0;
        T* cv = buf.cand.data();
        int32_t* ci = buf.cidx.data();
        for (int64_t j = 0; j < lim; ++j) {
          const T y = srow[j] * half;
          if (y > thr && (kr == nullptr || kr[j])) {
            cv[nc] = y - zmax;
            ci[nc++] = static_cast<int32_t>(j);
          }
        }
        tau = find_threshold<T, ENTMAX>(cv, nc);
        if (!sparse) {
          std::fill(srow, srow + L, T(0));
          if (want_u) std::fill(hrow, hrow + L, T(0));
        }
        for (int64_t e = 0; e < nc; ++e) {
          const T d = cv[e] - tau;
          if (d > T(0)) {
            const T pj = ENTMAX ? d * d : d, hj = ENTMAX ? d : T(1);
            hs += hj;
            if (sparse && cnt == cap) {  // too many for entry-by-entry: densify the rows done so far
              sparse = false;
              for (int64_t rr = 0; rr <= r; ++rr) {
                std::fill(S + rr * L, S + (rr + 1) * L, T(0));
                if (want_u) std::fill(Hb + rr * L, Hb + (rr + 1) * L, T(0));
                const int64_t end = rr < r ? support[rr + 1] : cnt;
                for (int64_t x = support[rr]; x < end; ++x) {
                  S[rr * L + buf.ix[x]] = buf.pv[x];
                  if (want_u) Hb[rr * L + buf.ix[x]] = buf.hv[x];
                }
              }
            }
            if (sparse) {
              buf.pv[cnt] = pj;
              buf.hv[cnt] = hj;
              buf.ix[cnt++] = ci[e];
            } else {
              srow[ci[e]] = pj;
              if (want_u) hrow[ci[e]] = hj;
            }
          }
        }
        tau += zmax;  // stored unshifted: p = [half * s - tau]_+^POW
      } else if (!sparse) {
        std::fill(srow, srow + L, T(0));
        if (want_u) std::fill(hrow, hrow + L, T(0));
      }
      support[r + 1] = cnt;
      r1[bh * p.Lq + i] = tau;
      r2[bh * p.Lq + i] = hs;
    }
    if (sparse) {  // out_i = sum_supp p_ij v_j, U_i = sum_supp h_ij v_j, entry by entry
      std::fill(orow, orow + m * p.Dv, T(0));
      if (want_u) std::fill(urow, urow + m * p.Dv, T(0));
      for (int64_t r = 0; r < m; ++r) {
        T* o = orow + r * p.Dv;
        T* u = want_u ? urow + r * p.Dv : nullptr;
        for (int64_t e = support[r]; e < support[r + 1]; ++e) {
          const T pj = buf.pv[e], hj = buf.hv[e];
          const T* vj = p.vrow(b, g, buf.ix[e]);
          if (want_u) {
#pragma omp simd
            for (int64_t d = 0; d < p.Dv; ++d) {
              o[d] += pj * vj[d];
              u[d] += hj * vj[d];
            }
          } else {
#pragma omp simd
            for (int64_t d = 0; d < p.Dv; ++d) o[d] += pj * vj[d];
          }
        }
      }
    } else {
      mm_ab<T>(m, p.Dv, L, S, L, p.vrow(b, g, 0), p.vsl, T(0), orow, p.Dv);
      if (want_u) mm_ab<T>(m, p.Dv, L, Hb, L, p.vrow(b, g, 0), p.vsl, T(0), urow, p.Dv);
    }
  });
}

// alpha-entmax (dispatch "alpha", alpha_i = row_value_i > 1 per row): p_j = [x_j - tau]_+^(1/(alpha-1)) / Z with
// x = (alpha - 1)(s - max s), candidates x > -1 as above. tau by Newton on h(t) = ||[x - t]_+||_P, P = 1/(alpha-1):
// for alpha <= 2 (P >= 1) h is a monotone norm of convex functions, so convex and decreasing, and Newton from
// t = -1 never overshoots (for P = 2 this is the entmax-1.5 step above); for alpha > 2 bisection. The weights are
// renormalised by Z = sum_j [x_j - tau]_+^P (1 up to rounding), like the reference. Rows are accumulated entry by
// entry over their support; U gets g = p^(2 - alpha), A the alpha-derivative of each weight, then Z and the entropy
// H = sum p ln p (see backward).
template <typename T>
T alpha_threshold(T* y, int32_t* idx, int64_t& n, T alpha) {
  // computed in T (fp32 for fp32 / fp16 / bf16 inputs), as the reference's bisection: the weights are formed from
  // the same T differences y_j - tau and renormalised by their sum, so a wider search would buy nothing
  const T P = T(1) / (alpha - T(1)), Pm1 = P - T(1);
  constexpr T tiny = std::numeric_limits<T>::min();
  T t = T(-1);
  if (alpha <= T(2)) {
    for (int it = 0; it < 100; ++it) {
      T S = 0, D1 = 0;
      // d^(P-1) as e^((P-1) ln d), vectorised (d > 0: the candidates are kept above t)
#pragma omp simd reduction(+ : S, D1)
      for (int64_t j = 0; j < n; ++j) {
        const T d = std::max(y[j] - t, tiny);
        const T dp = vexp_any(Pm1 * vlog_any(d));
        S += dp * d;
        D1 += dp;
      }
      if (S <= T(1) || D1 <= T(0)) break;  // at (rounding of) the root
      const T step = (S - std::pow(S, T(1) - T(1) / P)) / D1;
      if (!(t + step > t)) break;  // below t's rounding
      t += step;
      int64_t w = 0;
      for (int64_t j = 0; j < n; ++j) {  // branch-free compaction (the keep/drop pattern is unpredictable)
        const T yj = y[j];
        const int32_t ij = idx[j];
        y[w] = yj;
        idx[w] = ij;
        w += yj - t > T(0) ? 1 : 0;
      }
      n = w;
    }
    return t;
  }
  // alpha > 2: bisection over [-1, -(1/n)^(alpha-1)], halvings = the mantissa bits of T plus 4 (as the reference)
  constexpr int halvings = std::numeric_limits<T>::digits + 4;
  T lo = T(-1), width = T(1) - std::pow(T(1) / static_cast<T>(std::max<int64_t>(n, 1)), alpha - T(1));
  for (int it = 0; it < halvings; ++it) {
    width /= 2;
    const T mid = lo + width;
    T S = 0;
#pragma omp simd reduction(+ : S)
    for (int64_t j = 0; j < n; ++j) {
      const T d = y[j] - mid;
      S += d > T(0) ? vexp_any(P * vlog_any(std::max(d, tiny))) : T(0);
    }
    if (S >= T(1)) lo = mid;
  }
  return lo;
}

// alpha-entmax's candidates: y_j = (s_j - zmax)(alpha - 1) > -1 over visible keys j < lim, compacted into cv / ci
// (cv, ci hold lim entries); returns their count. Branch-free scalar (a store per key, a conditional advance), and
// 8 keys per step with AVX-512 compress where the CPU has it (this scan was the forward's largest own cost).
template <typename T>
int64_t compact_candidates(const T* srow, int64_t lim, const bool* kr, T zmax, T am1, T* cv, int32_t* ci) {
  int64_t nc = 0, j = 0;
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, double>) {
    const __m512d vz = _mm512_set1_pd(zmax), va = _mm512_set1_pd(am1), vm1 = _mm512_set1_pd(-1.0);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i v8 = _mm256_set1_epi32(8);
    for (; j + 8 <= lim; j += 8) {
      const __m512d y = _mm512_mul_pd(_mm512_sub_pd(_mm512_loadu_pd(srow + j), vz), va);
      __mmask8 k = _mm512_cmp_pd_mask(y, vm1, _CMP_GT_OQ);
      if (kr != nullptr) {
        const __m128i keep8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kr + j));
        k &= static_cast<__mmask8>(_mm_test_epi8_mask(keep8, _mm_set1_epi8(1)));
      }
      // full-width stores at nc <= j (the buffers hold lim >= j + 8 entries): only the first popcount(k) count
      _mm512_storeu_pd(cv + nc, _mm512_maskz_compress_pd(k, y));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + nc), _mm256_maskz_compress_epi32(k, vidx));
      nc += __builtin_popcount(static_cast<unsigned>(k));
      vidx = _mm256_add_epi32(vidx, v8);
    }
  }
#endif
  for (; j < lim; ++j) {
    const T y = (srow[j] - zmax) * am1;
    cv[nc] = y;
    ci[nc] = static_cast<int32_t>(j);
    nc += (y > T(-1) && (kr == nullptr || kr[j])) ? 1 : 0;
  }
  return nc;
}

template <typename T>
void forward_alpha(const Problem<T>& p, T* out, T* r1, T* r2, T* uout) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t nqb = (p.Lq + p.BQ - 1) / p.BQ;
  const int64_t nthreads = at::get_num_threads();
  const int64_t BH = p.B * p.H, UW = 2 * p.Dv + 3;  // u_width of an alpha map
  struct Buffers {
    std::vector<T> S, cand, w, g, lp;
    std::vector<int32_t> cidx;
  };
  std::vector<Buffers> bufs(nthreads);
  dynamic_for(BH * nqb, nthreads, [&](int64_t item, int64_t t) {
    const int64_t qb = nqb - 1 - item / BH, bh = item % BH, b = bh / p.H, h = bh % p.H, g = h / p.G;
    const int64_t i0 = qb * p.BQ, m = std::min(p.BQ, p.Lq - i0);
    const int64_t L = p.causal ? std::min(p.Lk, i0 + m) : p.Lk;
    std::fill(out + (bh * p.Lq + i0) * p.Dv, out + (bh * p.Lq + i0 + m) * p.Dv, T(0));
    if (uout != nullptr) std::fill(uout + (bh * p.Lq + i0) * UW, uout + (bh * p.Lq + i0 + m) * UW, T(0));
    for (int64_t r = 0; r < m; ++r) r1[bh * p.Lq + i0 + r] = r2[bh * p.Lq + i0 + r] = T(0);
    if (L == 0) return;
    Buffers& buf = bufs[t];
    if (buf.S.empty()) {
      buf.S.resize(std::min(p.BQ, p.Lq) * p.Lk);  // (a decode step: one row, not a block's)
      buf.cand.resize(p.Lk);
      buf.w.resize(p.Lk);
      buf.g.resize(p.Lk);
      buf.lp.resize(p.Lk);
      buf.cidx.resize(p.Lk);
    }
    T* S = buf.S.data();
    mm_abt<T>(m, L, p.D, p.qrow(b, h, i0), p.qsl, p.krow(b, g, 0), p.ksl, T(0), S, L);
    // soft-cap, bias, ALiBi as for every map: tau, M, the weights and U / A all see the modified scores, which the
    // backward tiles recompute the same way
    if (p.mods()) modify_tile(p, S, L, b, h, i0, m, 0, L, static_cast<T*>(nullptr));
    for (int64_t r = 0; r < m; ++r) {
      const int64_t i = i0 + r, row = bh * p.Lq + i, lim = std::min(L, p.key_end(i));
      const bool* kr = p.keep ? p.mrow(b, h, i) : nullptr;
      const T* srow = S + r * L;
      const T alpha = p.row_value[row], am1 = alpha - T(1);
      // shifted before scaling, x = (s - max s)(alpha - 1), as the reference: (alpha - 1) s - (alpha - 1) max s would
      // round (alpha - 1) s first and lose the small differences that P = 1/(alpha-1) then amplifies
      // (max: vectorised; candidates: compacted branch-free, a store per key and a conditional advance; these two
      // scans were scalar and branchy, 60% of the forward's own time)
      T zmax = ninf;
      if (kr == nullptr) {
#pragma omp simd reduction(max : zmax)
        for (int64_t j = 0; j < lim; ++j) zmax = std::max(zmax, srow[j]);
      } else {
#pragma omp simd reduction(max : zmax)
        for (int64_t j = 0; j < lim; ++j) zmax = std::max(zmax, kr[j] ? srow[j] : ninf);
      }
      if (zmax == ninf) continue;  // no visible key: zeros
      T* cv = buf.cand.data();
      int32_t* ci = buf.cidx.data();
      int64_t nc = compact_candidates(srow, lim, kr, zmax, am1, cv, ci);
      // tau in T, as the backward pass recomputes r = (s - M)(alpha - 1) - tau in T from the stored M = max s and
      // tau: it gets bit-identical r (P = 1/(alpha-1) amplifies any difference)
      const T tau = alpha_threshold<T>(cv, ci, nc, alpha);
      const T P = T(1) / am1;
      T Z = 0;
      T* w = buf.w.data();
      // the same x^P (vpow_pos) as the backward's recomputation
#pragma omp simd reduction(+ : Z)
      for (int64_t e = 0; e < nc; ++e) {
        const T d = cv[e] - tau;
        const T wj = d > T(0) ? vpow_pos(std::max(d, std::numeric_limits<T>::min()), P) : T(0);
        w[e] = wj;
        Z += wj;
      }
      const T invz = Z > T(0) ? T(1) / Z : T(0);
      T* o = out + row * p.Dv;
      T* u = uout != nullptr ? uout + row * UW : nullptr;
      T G = 0, Hs = 0;
      int64_t support = 0;
      T* gw = buf.g.data();
      T* lw = buf.lp.data();
      const T tma = T(2) - alpha;
#pragma omp simd reduction(+ : G, Hs, support)
      for (int64_t e = 0; e < nc; ++e) {  // p_j, g_j = p_j^(2 - alpha), ln p_j (0 off the support)
        const T pj = w[e] * invz;
        const bool in = pj > std::numeric_limits<T>::min();
        const T lp = in ? vlog_any(pj) : T(0);
        const T gj = in ? vexp_any(tma * lp) : T(0);
        w[e] = in ? pj : T(0);
        gw[e] = gj;
        lw[e] = lp;
        G += gj;
        Hs += pj * lp;
        support += in ? 1 : 0;
      }
      if (u == nullptr) {
        for (int64_t e = 0; e < nc; ++e) {
          const T pj = w[e];
          if (!(pj > T(0))) continue;
          const T* vj = p.vrow(b, g, ci[e]);
#pragma omp simd
          for (int64_t d = 0; d < p.Dv; ++d) o[d] += pj * vj[d];
        }
        G = 0;
      } else if (G > T(0)) {
        // out, U = sum g_j v_j and A = sum a_j v_j in one pass over the support, with a_j the alpha-derivative
        // coefficient of p_j, formed per entry so that d alpha_i = dO_i . A_i has no cancellation
        // between row sums
        const T invg = T(1) / G;
        for (int64_t e = 0; e < nc; ++e) {
          const T pj = w[e];
          if (!(pj > T(0))) continue;
          const T pt = gw[e] * invg;
          const T aj = (pj - pt) / (am1 * am1) - (pj * lw[e] - pt * Hs) / am1;
          const T gt = gw[e];
          const T* vj = p.vrow(b, g, ci[e]);
#pragma omp simd
          for (int64_t d = 0; d < p.Dv; ++d) {
            o[d] += pj * vj[d];
            u[d] += gt * vj[d];
            u[p.Dv + d] += aj * vj[d];
          }
        }
      }
      r1[row] = tau;  // shifted: p = [(s - M)(alpha - 1) - tau]_+^P / Z, M = max s in U
      // a support of one key: the weights are one-hot and stay so under small changes of the scores (the other keys
      // are strictly outside), so their gradient is exactly 0; -G tells the backward, which would otherwise form
      // dS = g (dp - dO . U / G), rounding noise (dp from the backward's product, U summed here) times |s| in the
      // gradient of a score scale
      r2[row] = support == 1 ? -G : G;
      if (u != nullptr) {
        u[2 * p.Dv] = Z;
        u[2 * p.Dv + 1] = Hs;
        u[2 * p.Dv + 2] = zmax;
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------ backward

template <typename T>
struct RowConstants {
  T invd, delta, row_value, m, em, tau, live;
};

// Maps whose weights are constant on a row with a single visible key (sum-normalised without an extra constant:
// P = 1, or softpick's 0/1) declare how such rows are found (FusedMap.single_key). Their gradient there is exactly
// 0, but dS = f'(s) (dP - delta) / D would be rounding noise amplified by f'/D (2/s for squared): such rows get
// dS = 0. Whether a row's value marks it: SINGLE_KEY_N_EQ_1 (row_value = n == 1) or SINGLE_KEY_NEGATIVE (power: -p
// there, +p elsewhere)
template <typename T>
inline bool single_key_row(int64_t map_id, T row_value) {
  return map_single_key(map_id) == SINGLE_KEY_NEGATIVE ? row_value < T(0) : row_value == T(1);
}

// d/ds of one entry: P and dS from the score x and g = dO_i . v_j (branch-free, see the forward); dr: the entry's
// term of the gradient of the row value (sigmoid: dS; power: d/dp)
template <typename T, int64_t MAP, bool SLOW = false, int NP = 0>
inline void dmap(T x, T g, const RowConstants<T>& rc, T& pp, T& ds, T& dr) {
  const T invd = rc.invd, delta = rc.delta;
  if constexpr (MapEntry<T, MAP>::declared) {  // the declared weight and slope (FusedMap.code)
    const T w = MapEntry<T, MAP>::weight(x, rc.row_value);
    const T slope = MapEntry<T, MAP>::slope(x, rc.row_value, w);
    if constexpr (map_normalised(MAP)) {
      pp = w * invd;
      ds = (g - delta) * invd * slope;
    } else {
      pp = w;
      ds = g * slope;
    }
  } else if constexpr (map_running_shift(MAP) == RUNNING_SHIFT_MAX_SCORE) {
    // softpick: u = e^{s-M} - e^{-M}: P = relu(u)/D, d|u| = sign(u) e^{s-M}
    const T e = vexp(x - rc.m), u = e - rc.em;
    const T pos = u > T(0) ? T(1) : T(0), neg = u < T(0) ? T(1) : T(0);
    pp = u * pos * invd;
    ds = (g * pos - delta * (pos - neg)) * e * invd;
  } else if constexpr (map_running_shift(MAP) == RUNNING_SHIFT_MAX_ABS_EXP) {
    // cog: P = sign(s) e^{|s|-M} / D, d/ds of the numerator [s != 0] e^{|s|-M}, of the denominator term
    // sign(s) e^{|s|-M}: dS = (g [s != 0] - delta sign(s)) e^{|s|-M} / D
    const T e = vexp(std::abs(x) - rc.m), sg = sgn(x);
    pp = sg * e * invd;
    ds = (g * sg * sg - delta * sg) * e * invd;
  } else if constexpr (map_threshold_exponent(MAP) == 2) {
    // entmax-1.5: p = r^2 with r = [s/2 - tau]_+: dS = r (g - delta)
    const T r = std::max(x * T(0.5) - rc.tau, T(0));
    pp = r * r;
    ds = r * (g - delta);
  } else if constexpr (map_row_value_use(MAP) == ROW_VALUE_USE_ALPHA) {
    // alpha-entmax: p = r^P / Z, r = [(alpha-1) s - tau]_+, dS = p^(2-alpha) (g - delta)
    // rc.m: M, as in the forward; powers through vpow_pos as there (vectorised; glibc pow was scalar)
    const T tiny = std::numeric_limits<T>::min();
    const T r = std::max((x - rc.m) * (rc.row_value - T(1)) - rc.tau, T(0));
    const T pr = r > T(0) ? vpow_pos(std::max(r, tiny), T(1) / (rc.row_value - T(1))) * invd : T(0);
    pp = pr;
    ds = pr > tiny ? vpow_pos(std::max(pr, tiny), T(2) - rc.row_value) * (g - delta) : T(0);
  } else if constexpr (map_form(MAP) == FORM_THRESHOLD) {  // sparsemax: [x - tau]_+
    const T r = x - rc.tau;
    const T pos = r > T(0) ? T(1) : T(0);
    pp = r * pos;
    ds = (g - delta) * pos;
  } else if constexpr (map_row_value_use(MAP) == ROW_VALUE_USE_EXPONENT) {
    // power: A = |s|^p e^-m: dA/ds = p A / s, dA/dp = A ln|s|
    const T pw = std::abs(rc.row_value), ax = std::abs(x), tiny = std::numeric_limits<T>::min();
    const bool nz = ax >= tiny;
    const T lx = nz ? vlog(std::max(ax, tiny)) : T(0);  // (only the p-gradient needs it)
    // e1 = A / |s| = |s|^(p-1) e^-m, so that dA/ds = p e1 sign(s) takes no division; integer p (NP): by
    // multiplications from u = |s| / M (rc.em = 1/M, m = p ln M), as the forward
    T e1;
    if constexpr (NP > 0) {
      const double inv = rc.em;
      e1 = static_cast<T>(ipow<NP - 1>(static_cast<double>(ax) * inv) * inv);
    } else {
      e1 = vexp((pw - T(1)) * lx - rc.m);
    }
    pp = nz ? e1 * ax * invd : T(0);
    const T gp = (g - delta) * pp;
    ds = nz ? (g - delta) * invd * pw * e1 * sgn(x) : T(0);
    // sum_j P_j (g_j - delta) = 0, so ln|s| may be centred at the row's largest ln|s| (m / p): this keeps the
    // rounding of delta = dO . out from being amplified by large |ln|s|| (fp16 inputs: 4x closer to fp64)
    dr = gp * (lx - rc.m / pw);
  } else if constexpr (map_running_shift(MAP) == RUNNING_SHIFT_MAX_SCORE_BELOW_ZERO) {
    // softplus: softplus(s) e^-shift, shift = rc.m: d/ds = sigmoid(s) e^-shift (SLOW: below SP_SLOW)
    const T shift = rc.m;
    const T u = vexp(-std::abs(x)), r = log1p_ratio(u);
    if constexpr (SLOW) {
      const T e = vexp(x - shift);
      pp = e * r * invd;
      ds = (g - delta) * invd * e * inv_one_plus(u);
    } else {
      const T e_neg_shift = rc.em;  // e^-shift, shift in [SP_SLOW, 0]
      pp = (std::max(x, T(0)) + u * r) * e_neg_shift * invd;
      ds = (g - delta) * invd * e_neg_shift * (x >= T(0) ? T(1) : u) * inv_one_plus(u);
    }
  } else {
    static_assert(MAP < 0, "dmap: no derivative for this fused map id: add its block above");
  }
  if constexpr (!(map_row_value_use(MAP) == ROW_VALUE_USE_EXPONENT)) dr = ds;
}

// One row of a tile: s (scores) becomes P, dp (dO . v_j) becomes dS; returns sum_j dr (the row value's gradient:
// sigmoid's bias sum_j dS, power's dp).
template <typename T, int64_t MAP, bool MASKED, bool SLOW = false, int NP = 0>
T bwd_row(T* __restrict s, T* __restrict dp, int64_t nb, const bool* __restrict keep, const RowConstants<T>& rcr) {
  const RowConstants<T> rc = rcr;
  const T live = rc.live;
  T d_row_value = 0;
#pragma omp simd reduction(+ : d_row_value)
  for (int64_t j = 0; j < nb; ++j) {
    T pp, ds, dr;
    dmap<T, MAP, SLOW, NP>(s[j], dp[j], rc, pp, ds, dr);
    ds *= live;
    dr *= live;
    if constexpr (MASKED) {
      pp = keep[j] ? pp : T(0);
      ds = keep[j] ? ds : T(0);
      dr = keep[j] ? dr : T(0);
    }
    d_row_value += dr;
    s[j] = pp;
    dp[j] = ds;
  }
  return d_row_value;
}

template <typename T, int64_t MAP>
inline T bwd_tile_row(const bool* kr, int64_t lim, T* s, T* dp, int64_t nb, const RowConstants<T>& rc) {
  lim = std::max<int64_t>(0, std::min(lim, nb));
  T acc;
  if constexpr (map_row_value_use(MAP) == ROW_VALUE_USE_EXPONENT) {  // integer p: its own instantiation (see power_row)
    const int np = power_int(std::abs(rc.row_value));
    auto run = [&](auto npc) {
      constexpr int NP = decltype(npc)::value;
      return kr ? bwd_row<T, MAP, true, false, NP>(s, dp, lim, kr, rc)
                : bwd_row<T, MAP, false, false, NP>(s, dp, lim, nullptr, rc);
    };
    acc = np == 1   ? run(std::integral_constant<int, 1>{})
          : np == 2 ? run(std::integral_constant<int, 2>{})
          : np == 3 ? run(std::integral_constant<int, 3>{})
          : np == 4 ? run(std::integral_constant<int, 4>{})
                    : run(std::integral_constant<int, 0>{});
  } else if ((map_running_shift(MAP) == RUNNING_SHIFT_MAX_SCORE_BELOW_ZERO) && rc.m < SP_SLOW<T>) {
    // softplus rows of very negative scores only
    acc = kr ? bwd_row<T, MAP, true, true>(s, dp, lim, kr, rc)
             : bwd_row<T, MAP, false, true>(s, dp, lim, nullptr, rc);
  } else {
    acc = kr ? bwd_row<T, MAP, true>(s, dp, lim, kr, rc) : bwd_row<T, MAP, false>(s, dp, lim, nullptr, rc);
  }
  for (int64_t j = lim; j < nb; ++j) s[j] = dp[j] = T(0);
  return acc;
}

// Threshold maps in the backward pass: the tile's support entries (visible, [half s - tau]_+ > 0) are usually a
// small fraction, and only they carry gradient. If so, update dV, dK (tile-local) and dQ entry by entry and return
// true; otherwise return false and the caller runs the dense tile.
template <typename T, int64_t MAP>
bool sparse_tile(const Problem<T>& p, int st, int64_t b, int64_t h, int64_t g, int64_t i0, int64_t m, int64_t j0,
                 int64_t nb, const T* S, int32_t* E, T* dQb, T* dK, T* dV, const T* dout, const T* r1,
                 const T* delta, const T* invd, const T* shift, const T* live_row, T* dq, std::mutex* lock, const T* capd) {
  if (p.dbias != nullptr) return false;  // the dense tile forms dS for dbias
  constexpr bool ENTMAX = (map_threshold_exponent(MAP) == 2), ALPHA = (map_row_value_use(MAP) == ROW_VALUE_USE_ALPHA);
  const int64_t bh = b * p.H + h;
  // the score factor of the map: 1/2 (entmax-1.5), 1 (sparsemax), alpha_i - 1 (alpha-entmax)
  auto factor = [&](int64_t row) { return ALPHA ? p.row_value[row] - T(1) : (ENTMAX ? T(0.5) : T(1)); };
  int64_t ns = 0;
  for (int64_t r = 0; r < m; ++r) {
    const T tau = r1[bh * p.Lq + i0 + r], sh = shift[bh * p.Lq + i0 + r];
    const T half = factor(bh * p.Lq + i0 + r);
    const int64_t lim = st == 1 ? nb : std::max<int64_t>(0, std::min(nb, p.key_end(i0 + r) - j0));
    const bool* kr = st == 2 && p.keep ? p.mrow(b, h, i0 + r) + j0 : nullptr;
    const T* srow = S + r * nb;
    // branch-free (a store per entry, a conditional advance: E holds m * nb); the bound is checked per row
    for (int64_t j = 0; j < lim; ++j) {
      const T y = ALPHA ? (srow[j] - sh) * half : half * srow[j];
      E[ns] = static_cast<int32_t>(r * nb + j);
      ns += (y - tau > T(0) && (kr == nullptr || kr[j])) ? 1 : 0;
    }
    if (ns * SPARSE_RATIO > m * nb) return false;
  }
  if (ns == 0) return true;
  std::fill(dQb, dQb + m * p.D, T(0));
  for (int64_t e = 0; e < ns; ++e) {
    const int64_t r = E[e] / nb, j = E[e] % nb, row = bh * p.Lq + i0 + r;
    const T rr = (ALPHA ? (S[E[e]] - shift[row]) * factor(row) : factor(row) * S[E[e]]) - r1[row];
    T pp, hh;
    if constexpr (ALPHA) {
      const T tiny = std::numeric_limits<T>::min();
      pp = vpow_pos(std::max(rr, tiny), T(1) / (p.row_value[row] - T(1))) * invd[row];
      hh = pp > tiny ? vpow_pos(pp, T(2) - p.row_value[row]) : T(0);
    } else {
      pp = ENTMAX ? rr * rr : rr;
      hh = ENTMAX ? rr : T(1);
    }
    const T live = live_row[row];  // 0 where the weights are constant (see backward)
    const T* go = dout + row * p.Dv;
    const T* vj = p.vrow(b, g, j0 + j);
    T dpv = 0;
#pragma omp simd reduction(+ : dpv)
    for (int64_t d = 0; d < p.Dv; ++d) dpv += go[d] * vj[d];
    const T ds = live * hh * (dpv - delta[row]) * (capd != nullptr ? capd[E[e]] : T(1));
    T* dvj = dV + j * p.Dv;
#pragma omp simd
    for (int64_t d = 0; d < p.Dv; ++d) dvj[d] += pp * go[d];
    const T* qr = p.qrow(b, h, i0 + r);
    const T* kjr = p.krow(b, g, j0 + j);
    T* dkj = dK + j * p.D;
    T* dqr = dQb + r * p.D;
#pragma omp simd
    for (int64_t d = 0; d < p.D; ++d) {
      dkj[d] += ds * qr[d];
      dqr[d] += ds * kjr[d];
    }
  }
  auto add = [&]() {
    T* dst = dq + (bh * p.Lq + i0) * p.D;
#pragma omp simd
    for (int64_t x = 0; x < m * p.D; ++x) dst[x] += dQb[x];
  };
  if (lock == nullptr) {
    add();
  } else {
    std::lock_guard<std::mutex> guard(*lock);
    add();
  }
  return true;
}

template <typename T, int64_t MAP>
void backward(const Problem<T>& p, const T* dout, const T* out, const T* r1, const T* r2, const T* uout, T* dq,
              T* dk, T* dv, T* d_row_value) {
  const int64_t BH = p.B * p.H, rows = BH * p.Lq;
  // per-row constants: delta_i = dO_i . out_i (or dO_i . U_i / Hs_i), 1 / D_i
  std::vector<T> delta(rows), invd(rows), shift(rows, T(0));  // shift: alpha-entmax's M
  // 0 on rows whose weights are constant, so their score gradient is exactly 0: one visible key (maps declaring
  // constant_on_single_key) or alpha-entmax's support of one key (see forward_alpha); 1 elsewhere
  std::vector<T> live_row(rows);
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      live_row[i] = (map_single_key(MAP) != SINGLE_KEY_NONE) && single_key_row(MAP, p.row_value[i]) ? T(0) : T(1);
      const T* go = dout + i * p.Dv;
      const T* x = (map_form(MAP) == FORM_THRESHOLD) ? uout + i * u_width(MAP, p.Dv) : out + i * p.Dv;
      T dot = 0;
      for (int64_t d = 0; d < p.Dv; ++d) dot += go[d] * x[d];
      if (map_row_value_use(MAP) == ROW_VALUE_USE_ALPHA) {
        // d alpha_i = sum_j dp_j [(p_j - pt_j) / (alpha-1)^2 - (p_j ln p_j - pt_j H) / (alpha-1)], pt = g / G
        // (Correia et al. 2019), with dp_j = dO_i . v_j: = dO_i . A_i, A formed per entry in the forward
        T dot_a = 0;
        for (int64_t d = 0; d < p.Dv; ++d) dot_a += go[d] * x[p.Dv + d];
        const T z = x[2 * p.Dv];
        shift[i] = x[2 * p.Dv + 2];
        invd[i] = z != T(0) ? T(1) / z : T(0);
        delta[i] = r2[i] != T(0) ? dot / std::abs(r2[i]) : T(0);
        if (r2[i] < T(0)) live_row[i] = T(0);
        d_row_value[i] = r2[i] < T(0) ? T(0) : dot_a;
      } else if (map_normalised(MAP)) {
        invd[i] = r1[i] != T(0) ? T(1) / r1[i] : T(0);
        delta[i] = dot;
        // d out_i / d r = -out_i / D_i
        d_row_value[i] = (map_row_value_use(MAP) == ROW_VALUE_USE_DEN_OFFSET) ? -dot * invd[i] : T(0);
      } else if (map_form(MAP) == FORM_THRESHOLD) {
        invd[i] = T(1);
        delta[i] = r2[i] != T(0) ? dot / r2[i] : T(0);
        d_row_value[i] = T(0);
      } else {
        invd[i] = T(1);
        delta[i] = T(0);
        // out_i = c_i O_i
        d_row_value[i] = map_row_value_use(MAP) == ROW_VALUE_USE_WEIGHT_FACTOR && p.row_value[i] != T(0)
                             ? dot / p.row_value[i]
                             : T(0);
      }
    }
  });
  std::fill(dq, dq + rows * p.D, T(0));
  const int64_t nqb = (p.Lq + p.BQ - 1) / p.BQ, nkb = (p.Lk + p.BK - 1) / p.BK;
  const int64_t nthreads = at::get_num_threads();
  const int64_t BG = p.B * p.Hkv;
  // Whole (batch, kv head) items write dq without sharing (deterministic) when they balance the threads;
  // otherwise items are single key blocks and dq / d_row_value updates of a query block take that block's lock.
  const bool per_head = nthreads == 1 || BG % nthreads == 0 || BG >= 4 * nthreads;
  const int64_t nitems = per_head ? BG : BG * nkb;
  std::vector<std::mutex> locks(per_head ? 0 : BH * nqb);
  // dbias: one lock per (batch, head, query block, key block) region of the bias (broadcast dims collapsed)
  const int64_t nlh = p.dsh ? p.H : 1, nlq = p.dsl ? nqb : 1, nlk = p.dsk ? nkb : 1;
  std::vector<std::mutex> dlocks(p.dbias != nullptr ? (p.dsb ? p.B : 1) * nlh * nlq * nlk : 0);
  struct Buffers {
    std::vector<T> S, dP, dK, dV, dQ, Cd;
    std::vector<int32_t> E;
  };
  std::vector<Buffers> bufs(nthreads);
  dynamic_for(nitems, nthreads, [&](int64_t item, int64_t t) {
    Buffers& buf = bufs[t];
    if (buf.S.empty()) {
      buf.S.resize(p.BQ * p.BK);
      buf.dP.resize(p.BQ * p.BK);
      buf.dK.resize(p.BK * p.D);
      buf.dV.resize(p.BK * p.Dv);
      buf.dQ.resize(p.BQ * p.D);
      buf.E.resize(p.BQ * p.BK);
      if (p.cap != T(0)) buf.Cd.resize(p.BQ * p.BK);
    }
    const int64_t bg = per_head ? item : item % BG, b = bg / p.Hkv, g = bg % p.Hkv;
    const int64_t kb_begin = per_head ? 0 : item / BG, kb_end = per_head ? nkb : kb_begin + 1;
    for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
      const int64_t j0 = kb * p.BK, nb = std::min(p.BK, p.Lk - j0);
      std::fill(buf.dK.begin(), buf.dK.begin() + nb * p.D, T(0));
      std::fill(buf.dV.begin(), buf.dV.begin() + nb * p.Dv, T(0));
      const T* kj = p.krow(b, g, j0);
      const T* vj = p.vrow(b, g, j0);
      for (int64_t h = g * p.G; h < (g + 1) * p.G; ++h) {
        const int64_t bh = b * p.H + h;
        for (int64_t qb = p.causal ? j0 / p.BQ : 0; qb < nqb; ++qb) {
          const int64_t i0 = qb * p.BQ, m = std::min(p.BQ, p.Lq - i0);
          const int st = p.tile(b, h, i0, m, j0, nb);
          if (st == 0) continue;
          const T* qi = p.qrow(b, h, i0);
          const T* doi = dout + (bh * p.Lq + i0) * p.Dv;
          mm_abt<T>(m, nb, p.D, qi, p.qsl, kj, p.ksl, T(0), buf.S.data(), nb);
          T* capd = p.cap != T(0) ? buf.Cd.data() : nullptr;
          if (p.mods()) modify_tile(p, buf.S.data(), nb, b, h, i0, m, j0, nb, capd);
          if constexpr (map_form(MAP) == FORM_THRESHOLD) {
            if (sparse_tile<T, MAP>(p, st, b, h, g, i0, m, j0, nb, buf.S.data(), buf.E.data(), buf.dQ.data(),
                                     buf.dK.data(), buf.dV.data(), dout, r1, delta.data(), invd.data(), shift.data(),
                                     live_row.data(), dq, per_head ? nullptr : &locks[bh * nqb + qb], capd)) {
              continue;
            }
          }
          mm_abt<T>(m, nb, p.Dv, doi, p.Dv, vj, p.vsl, T(0), buf.dP.data(), nb);
          T d_row_values[MAX_BQ];
          for (int64_t r = 0; r < m; ++r) {
            const int64_t row = bh * p.Lq + i0 + r;
            // em: e^-m (softpick, softplus), 1/M (power)
            const T em = map_running_shift(MAP) == RUNNING_SHIFT_LOG_ABS_MAX
                             ? power_inv_max(r2[row], std::abs(p.row_value[row]))
                             : vexp(-r2[row]);
            RowConstants<T> rc{invd[row], delta[row], p.row_value[row],
                               map_row_value_use(MAP) == ROW_VALUE_USE_ALPHA ? shift[row] : r2[row], em, r1[row],
                       live_row[row]};
            const bool* kr = st == 2 && p.keep ? p.mrow(b, h, i0 + r) + j0 : nullptr;
            d_row_values[r] = bwd_tile_row<T, MAP>(kr, st == 1 ? nb : p.key_end(i0 + r) - j0, buf.S.data() + r * nb,
                                             buf.dP.data() + r * nb, nb, rc);
          }
          if (p.dbias != nullptr) {
            const int64_t lb = p.dsb ? b : 0, lh = p.dsh ? h : 0, lq = p.dsl ? qb : 0, lk = p.dsk ? kb : 0;
            add_dbias(p, buf.dP.data(), b, h, i0, m, j0, nb, dlocks[((lb * nlh + lh) * nlq + lq) * nlk + lk]);
          }
          if (capd != nullptr) {  // dS w.r.t. the capped score -> w.r.t. q k^T
#pragma omp simd
            for (int64_t x = 0; x < m * nb; ++x) buf.dP[x] *= capd[x];
          }
          mm_atb<T>(nb, p.Dv, m, buf.S.data(), nb, doi, p.Dv, T(1), buf.dV.data(), p.Dv);
          mm_atb<T>(nb, p.D, m, buf.dP.data(), nb, qi, p.qsl, T(1), buf.dK.data(), p.D);
          auto update = [&]() {
            mm_ab<T>(m, p.D, nb, buf.dP.data(), nb, kj, p.ksl, T(1), dq + (bh * p.Lq + i0) * p.D, p.D);
            if (map_row_value_use(MAP) == ROW_VALUE_USE_SCORE_OFFSET || map_row_value_use(MAP) == ROW_VALUE_USE_EXPONENT)
              for (int64_t r = 0; r < m; ++r) d_row_value[bh * p.Lq + i0 + r] += d_row_values[r];
          };
          if (per_head) {
            update();
          } else {
            std::lock_guard<std::mutex> guard(locks[bh * nqb + qb]);
            update();
          }
        }
      }
      std::memcpy(dk + ((b * p.Hkv + g) * p.Lk + j0) * p.D, buf.dK.data(), sizeof(T) * nb * p.D);
      std::memcpy(dv + ((b * p.Hkv + g) * p.Lk + j0) * p.Dv, buf.dV.data(), sizeof(T) * nb * p.Dv);
    }
  });
}

// ------------------------------------------------------------------------------------------------ dispatch

template <typename F>
void dispatch_map(int64_t map_id, const F& f) {
  switch (map_id) {
#define HF_MAP_CASE(ID)                          \
  case ID:                                       \
    f(std::integral_constant<int64_t, ID>{});    \
    break;
    HF_MAPS_FOR_EACH(HF_MAP_CASE)
#undef HF_MAP_CASE
    default:
      TORCH_CHECK(false, "hf_attnorm fused_cpu: unknown fused map id ", map_id,
                  " (not declared in kernels/fused/maps.py)");
  }
}

// What this build says about map ``map_id``, for tests/test_fused_maps.py: its facts in the order of maps.FACTS
// (form, normalised, running_shift, threshold_exponent, row_value_use, single_key), then the forward driver
// fused_forward picks through dispatch_map (0 forward_tiles, 1 forward_threshold, 2 forward_alpha). Raises for an
// unknown id.
std::vector<int64_t> map_facts(int64_t map_id) {
  TORCH_CHECK(is_declared(map_id), "hf_attnorm fused_cpu: unknown fused map id ", map_id,
              " (not declared in kernels/fused/maps.py)");
  int64_t driver = -1;
  dispatch_map(map_id, [&](auto kc) {
    constexpr int64_t K = decltype(kc)::value;
    driver = driver_of(K);
  });
  return {map_form(map_id), map_normalised(map_id), map_running_shift(map_id), map_threshold_exponent(map_id),
          map_row_value_use(map_id), map_single_key(map_id), driver};
}

// forward -> [out, den_or_tau, shift_or_gsum, hv_sum], per row (all [B, H, Lq] but hv_sum):
//   den_or_tau: the denominator D (tiles maps) or the threshold tau (threshold maps);
//   shift_or_gsum: the running shift m the weights are computed relative to (softpick: max(0, row max); power:
//     p ln max|s|; softplus: min(0, row max); else 0), or, for threshold maps, sum_j g_j (g = p^(2 - alpha));
//   hv_sum: threshold maps' sum_j h(p_ij) v_j ([B, H, Lq, u_width]; empty otherwise or when need_u is false).
// row_value [B, H, Lq]: the map's per-row value (FusedMap.row_value); backward returns its gradient drow_value.
std::vector<at::Tensor> fused_forward(int64_t map_id, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const std::optional<at::Tensor>& keep, bool causal, const at::Tensor& row_value,
                                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& slopes,
                                      double cap, int64_t block_q, int64_t block_k, bool need_u) {
  check_inputs(map_id, q, k, v, keep, row_value, block_q, block_k);
  check_mods(q, k, bias, slopes, cap);
  TORCH_CHECK(block_q <= MAX_BQ, "fused_cpu: block_q must be <= ", MAX_BQ);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Dv = v.size(3);
  auto out = at::empty({B, H, Lq, Dv}, q.options());
  auto den_or_tau = at::empty({B, H, Lq}, q.options());
  auto shift_or_gsum = at::empty({B, H, Lq}, q.options());
  // U (threshold maps) only feeds the backward pass: need_u false (inference) skips it and returns it empty
  auto hv_sum = (map_form(map_id) == FORM_THRESHOLD) && need_u ? at::empty({B, H, Lq, u_width(map_id, Dv)}, q.options())
                                        : at::empty({0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "hf_attnorm_fused_forward", [&] {
    auto p = make_problem<scalar_t>(map_id, q, k, v, keep, causal, row_value, block_q, block_k, bias, slopes, cap);
    dispatch_map(map_id, [&](auto kc) {
      constexpr int64_t K = decltype(kc)::value;
      if constexpr (driver_of(K) == 2) {
        forward_alpha<scalar_t>(p, out.data_ptr<scalar_t>(), den_or_tau.data_ptr<scalar_t>(),
                                shift_or_gsum.data_ptr<scalar_t>(), need_u ? hv_sum.data_ptr<scalar_t>() : nullptr);
      } else if constexpr (driver_of(K) == 1) {
        forward_threshold<scalar_t, K>(p, out.data_ptr<scalar_t>(), den_or_tau.data_ptr<scalar_t>(),
                                       shift_or_gsum.data_ptr<scalar_t>(),
                                       need_u ? hv_sum.data_ptr<scalar_t>() : nullptr);
      } else {
        forward_tiles<scalar_t, K>(p, out.data_ptr<scalar_t>(), den_or_tau.data_ptr<scalar_t>(),
                                   shift_or_gsum.data_ptr<scalar_t>());
      }
    });
  });
  return {out, den_or_tau, shift_or_gsum, hv_sum};
}

// The row values of a decode step, [B, H, 1] in q's dtype: every row sees all n = Lk keys, so r is one number per
// head, from the normalizer's declared row form (normalizers/base.py RowForm): r = head_map(T(h)) + n_term(n),
// negated on a single-key row when negate_single -- the operations of RowForm.evaluate, in the same order and
// precision, so the value is the one the forward op is given for the same call. head: the per-head value, fp32 [H].
at::Tensor decode_row_values(const at::Tensor& q, const std::optional<at::Tensor>& head, int64_t head_map,
                             double floor, int64_t n_term, bool negate_single, int64_t n) {
  const int64_t B = q.size(0), H = q.size(1);
  TORCH_CHECK(head_map >= ROW_HEAD_MAP_VALUE && head_map <= ROW_HEAD_MAP_AT_LEAST && n_term >= ROW_N_TERM_NONE &&
                  n_term <= ROW_N_TERM_INVERSE_N,
              "fused_cpu decode: unknown row form (head_map ", head_map, ", n_term ", n_term,
              "; normalizers/base.py HEAD_MAP_IDS / N_TERM_IDS)");
  TORCH_CHECK(head.has_value() || n_term != ROW_N_TERM_NONE, "fused_cpu decode: a row form needs a head or an n term");
  const float* h = nullptr;
  if (head.has_value()) {
    TORCH_CHECK(head->device().is_cpu() && head->scalar_type() == at::kFloat && head->is_contiguous() &&
                    head->numel() == H,
                "fused_cpu decode: the row form's per-head value must be a contiguous fp32 CPU tensor of H = ", H,
                " values (got ", head->sizes(), " ", head->scalar_type(), ")");
    h = head->data_ptr<float>();
  }
  auto rv = at::empty({B, H, 1}, q.options());
  // ln n by torch's own log kernel (what RowForm.evaluate calls; not std::log, which rounds differently on a few
  // values of n), once per call
  const at::Tensor log_n =
      n_term == ROW_N_TERM_MINUS_LOG_N ? at::log(at::full({1}, static_cast<double>(n), q.options())) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "hf_attnorm_decode_row_values", [&] {
    using T = scalar_t;
    T* r = rv.data_ptr<T>();
    const T nt = static_cast<T>(n);
    const T ln = log_n.defined() ? log_n.data_ptr<T>()[0] : T(0);
    for (int64_t i = 0; i < H; ++i) {
      T x = T(0);
      if (h != nullptr) {
        x = static_cast<T>(h[i]);
        if (head_map == ROW_HEAD_MAP_ABS) x = std::abs(x);
        if (head_map == ROW_HEAD_MAP_AT_LEAST) x = x + std::max(static_cast<T>(floor) - x, T(0));
      }
      if (n_term == ROW_N_TERM_MINUS_LOG_N) {
        x = h != nullptr ? x - ln : -ln;
      } else if (n_term != ROW_N_TERM_NONE) {
        const T term = n_term == ROW_N_TERM_N ? nt : T(1) / nt;
        x = h != nullptr ? x + term : term;
      }
      if (negate_single && n == 1) x = -x;
      for (int64_t b = 0; b < B; ++b) r[b * H + i] = x;
    }
  });
  return rv;
}

// decode -> out: a call without autograd, mask, causality or score modifier (a cached decode step), with q's score
// scale ``scale`` applied here (q is multiplied into a copy, as the callers of forward do before it) and the row
// values from the normalizer's row form (decode_row_values): one op call and one output, for the direct entry of a
// plain decode step (cpu.py's ``direct``). Same kernels as forward.
at::Tensor fused_decode(int64_t map_id, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& head, int64_t head_map, double floor, int64_t n_term,
                        bool negate_single, double scale, int64_t block_q, int64_t block_k) {
  const at::Tensor qs = (q * scale).contiguous();
  const at::Tensor rv = decode_row_values(q, head, head_map, floor, n_term, negate_single, k.size(2));
  return fused_forward(map_id, qs, k, v, std::nullopt, false, rv, std::nullopt, std::nullopt, 0.0, block_q,
                       block_k, false)[0];
}

std::vector<at::Tensor> fused_backward(int64_t map_id, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::optional<at::Tensor>& keep, bool causal, const at::Tensor& row_value,
                                       const std::optional<at::Tensor>& bias,
                                       const std::optional<at::Tensor>& slopes, double cap, bool bias_grad,
                                       const at::Tensor& out, const at::Tensor& den_or_tau,
                                       const at::Tensor& shift_or_gsum, const at::Tensor& hv_sum,
                                       const at::Tensor& dout, int64_t block_q,
                                       int64_t block_k) {
  check_inputs(map_id, q, k, v, keep, row_value, block_q, block_k);
  check_mods(q, k, bias, slopes, cap);
  TORCH_CHECK(!bias_grad || bias.has_value(), "fused_cpu: bias_grad without a bias");
  TORCH_CHECK(block_q <= MAX_BQ, "fused_cpu: block_q must be <= ", MAX_BQ);
  TORCH_CHECK(out.is_contiguous() && dout.is_contiguous() && den_or_tau.is_contiguous() &&
                  shift_or_gsum.is_contiguous(),
              "fused_cpu: out, dout, den_or_tau, shift_or_gsum must be contiguous");
  TORCH_CHECK(dout.sizes() == out.sizes() && dout.scalar_type() == q.scalar_type(), "fused_cpu: bad dout");
  TORCH_CHECK(!(map_form(map_id) == FORM_THRESHOLD) || (hv_sum.is_contiguous() && hv_sum.dim() == 4 &&
                                      hv_sum.size(3) == u_width(map_id, v.size(3)) && hv_sum.size(2) == out.size(2)),
              "fused_cpu: bad hv_sum");
  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::empty(k.sizes(), k.options());
  auto dv = at::empty(v.sizes(), v.options());
  auto drow_value = at::empty(row_value.sizes(), row_value.options());
  // dbias has the bias's (broadcast) shape, contiguous; empty when not needed
  auto dbias = bias_grad ? at::zeros(bias->sizes(), q.options()) : at::empty({0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "hf_attnorm_fused_backward", [&] {
    auto p = make_problem<scalar_t>(map_id, q, k, v, keep, causal, row_value, block_q, block_k, bias, slopes, cap,
                                    bias_grad ? &dbias : nullptr);
    dispatch_map(map_id, [&](auto kc) {
      constexpr int64_t K = decltype(kc)::value;
      backward<scalar_t, K>(p, dout.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), den_or_tau.data_ptr<scalar_t>(),
                            shift_or_gsum.data_ptr<scalar_t>(),
                            (map_form(map_id) == FORM_THRESHOLD) ? hv_sum.data_ptr<scalar_t>() : nullptr,
                            dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
                            drow_value.data_ptr<scalar_t>());
    });
  });
  return {dq, dk, dv, drow_value, dbias};
}

}  // namespace

// the ops' namespace (HF_ATTNORM_NATIVE_NS): hf_attnorm_native, or another for a build of another map table
// (cpu.build_ops), so that both can be loaded in one process
HF_TORCH_LIBRARY(HF_ATTNORM_NATIVE_NS, m) {
  m.def("blas_available() -> bool", &blas_available);
  m.def("map_facts(int map_id) -> int[]", &map_facts);
  m.def(
      "forward(int map_id, Tensor q, Tensor k, Tensor v, Tensor? keep, bool causal, Tensor row_value, Tensor? bias, "
      "Tensor? slopes, float cap, int block_q, int block_k, bool need_u=True) -> Tensor[]");
  m.def("decode(int map_id, Tensor q, Tensor k, Tensor v, Tensor? head, int head_map, float floor, int n_term, "
        "bool negate_single, float scale, int block_q, int block_k) -> Tensor");
  m.def("decode_row_values(Tensor q, Tensor? head, int head_map, float floor, int n_term, bool negate_single, "
        "int n) -> Tensor");
  m.def(
      "backward(int map_id, Tensor q, Tensor k, Tensor v, Tensor? keep, bool causal, Tensor row_value, Tensor? bias, "
      "Tensor? slopes, float cap, bool bias_grad, Tensor out, Tensor den_or_tau, Tensor shift_or_gsum, "
      "Tensor hv_sum, Tensor dout, "
      "int block_q, int block_k) -> Tensor[]");
}

HF_TORCH_LIBRARY_IMPL(HF_ATTNORM_NATIVE_NS, CPU, m) {
  m.impl("forward", &fused_forward);
  m.impl("decode", &fused_decode);
  m.impl("decode_row_values", &decode_row_values);
  m.impl("backward", &fused_backward);
}
