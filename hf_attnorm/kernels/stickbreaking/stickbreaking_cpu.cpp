// Fused CPU stick-breaking attention (see scan.py for the math and cpu.py for the
// Python side). Compiled as this family's own extension (kernels/native.py); its ops are hf_attnorm_fused::sb_forward
// and hf_attnorm_fused::sb_backward.
//
// Per (batch, head, query block) the key blocks are visited from the block's last own key backwards. The scores of a
// tile are formed transposed, ZT[key][query] = K Q^T, so that the row-wise reverse scan runs over keys with the queries
// as the vector lanes (m independent running values, no dependency chain along a vector). The scan is in product
// form: e_i = what is left of row i's stick (exp(-c_i), c_i the softplus sum of the log-space form), A_ij =
// beta_ij e_i, then e_i *= 1 - beta_ij (see scan_tile). O^T += V^T A^T by BLAS. The forward saves e at each key
// block's edge (e_all [B, H, Lq, nkb + 1], the last slot the row's remainder r_i), so that the backward recomputes
// block b exactly while visiting the blocks left to right:
//   dz_ij = A_ij g_ij - beta_ij (P_ij + R_i),  g = dO V^T,  P_ij = sum_{k <= j} A_ik g_ik (a prefix sum from the far
//   keys, which keeps its relative precision), R_i = r_i dO_i . v_own(i) (the remainder sits on the own key when that
//   option is on), dQ += dz K, dK += dz^T Q, dV += A^T dO, dv_own += r_i dO_i.
// Work items: forward (b, h, query block), largest causal blocks first, handed out dynamically. Backward: a kv head
// (b, hkv) split into P parts (query blocks dealt round-robin, P = threads / (B Hkv) rounded up) with a private
// dK/dV buffer per part summed in a fixed order: deterministic, no locks.
//
// Shapes: q [B, H, Lq, D] contiguous (already scaled); k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (last dim contiguous);
// keep: optional bool [B, H, Lq, Lk] (strides may be 0, last dim contiguous); own int64 [B, H, Lq] contiguous: each
// query's own key (its last visible one, -1 for none); keys j with j < own + attend_current (and keep) break the stick.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "cpu_common.h"

namespace {

// sgemm_/dgemm_, mm_abt / mm_ab / mm_atb and vexp: cpu_common.h (shared with fused_cpu.cpp)

// exp and log1p that GCC vectorises (Cephes expf / logf polynomials, ~1 ulp; the same expf as fused_cpu.cpp),
// forced inline: an out-of-line call in the scan loop stops its vectorisation (measured 5x slower)
#define SB_INLINE inline __attribute__((always_inline))


// log(1 + t) for 0 <= t <= 1: 1 + t lies in [1, 2], one range halving puts it in [sqrt(1/2), sqrt(2)) for the logf
// polynomial; below 1e-4 the series t - t^2/2 (1 + t would round away t's low bits).
SB_INLINE float vlog1p01(float t) {
  const float y = 1.0f + t;
  const bool big = y > 1.41421356f;
  const float e = big ? 1.0f : 0.0f;
  const float x = (big ? y * 0.5f : y) - 1.0f;
  const float z = x * x;
  float p = 7.0376836292e-2f;
  p = p * x - 1.1514610310e-1f;
  p = p * x + 1.1676998740e-1f;
  p = p * x - 1.2420140846e-1f;
  p = p * x + 1.4249322787e-1f;
  p = p * x - 1.6668057665e-1f;
  p = p * x + 2.0000714765e-1f;
  p = p * x - 2.4999993993e-1f;
  p = p * x + 3.3333331174e-1f;
  float r = p * x * z + e * -2.12194440e-4f - 0.5f * z;
  r = x + r + e * 0.693359375f;
  return t < 1e-4f ? t * (1.0f - 0.5f * t) : r;
}
SB_INLINE double vlog1p01(double t) { return std::log1p(t); }

// softplus(z), logsigmoid(z) = z - softplus(z) and sigmoid(z) from one exp and one log
template <typename T>
SB_INLINE void sb_elem(T z, T& sp, T& ls, T& sig) {
  const T t = vexp(-std::abs(z));
  const T l = vlog1p01(t);
  sp = std::max(z, T(0)) + l;
  ls = std::min(z, T(0)) - l;
  const T inv = T(1) / (T(1) + t);
  sig = z >= T(0) ? inv : t * inv;
}

// The reverse scan of one tile, nearest key first, in product form: e_i = prod_{k visited} (1 - beta_ik) is what is
// left of row i's stick (exp(-c_i) of the log-space form), A_ij = beta_ij e_i, then e_i *= 1 - beta_ij. One exp and
// one division per score instead of log-space's two exps and a log (the scan was the largest part of the forward);
// beta and 1 - beta both come from t = exp(-|z|) in (0, 1] (no cancellation, no overflow), and e only shrinks, to 0
// at worst (flushed), where the log-space weight exp(logsigmoid - c) is below fp32's range too.
// zt[key][query]: scores in, A out; lim[r] = own + attend_current (keys j < lim break the stick); mt: the mask,
// transposed; sg (backward only): beta, 0 off the stick-breaking keys.
template <typename T, bool Masked, bool Backward>
void scan_tile(T* __restrict zt, const T* __restrict mt, const T* __restrict lim, T* __restrict e,
               T* __restrict at, T* __restrict sg, int64_t j0, int64_t nb, int64_t m) {
  for (int64_t jj = nb - 1; jj >= 0; --jj) {
    const T jf = T(j0 + jj);
    const T* __restrict zr = zt + jj * m;
    const T* __restrict mr = mt + jj * m;
    T* __restrict ar = (Backward ? at : zt) + jj * m;
#pragma omp simd
    for (int64_t r = 0; r < m; ++r) {
      const T z = zr[r];
      const T t = vexp(-std::abs(z));
      const T inv = T(1) / (T(1) + t);
      bool part = jf < lim[r];
      if constexpr (Masked) part = part & (mr[r] > T(0));
      const T beta = part ? (z >= T(0) ? inv : t * inv) : T(0);
      const T keep = part ? (z >= T(0) ? t * inv : inv) : T(1);
      ar[r] = beta * e[r];
      if constexpr (Backward) sg[jj * m + r] = beta;
      e[r] *= keep;
    }
  }
}

// dst[c][r] = src[r][c] for src [rows][cols], in 16 x 16 tiles
template <typename T>
void transpose(const T* __restrict src, int64_t rows, int64_t cols, T* __restrict dst) {
  constexpr int64_t TB = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += TB) {
    const int64_t r1 = std::min(rows, r0 + TB);
    for (int64_t c0 = 0; c0 < cols; c0 += TB) {
      const int64_t c1 = std::min(cols, c0 + TB);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * cols + c];
    }
  }
}

template <typename T>
struct SB {
  int64_t B, H, Hkv, G, Lq, Lk, D, Dv, BQ, BK, nqb, nkb;
  const T *q, *k, *v;
  int64_t ksb, ksh, ksl, vsb, vsh, vsl;
  const bool* keep;
  int64_t msb, msh, msl;
  const int64_t* own;
  bool attend_current, remainder;

  const T* qrow(int64_t b, int64_t h, int64_t i) const { return q + ((b * H + h) * Lq + i) * D; }
  const T* krow(int64_t b, int64_t g, int64_t j) const { return k + b * ksb + g * ksh + j * ksl; }
  const T* vrow(int64_t b, int64_t g, int64_t j) const { return v + b * vsb + g * vsh + j * vsl; }
  const int64_t* ownrow(int64_t b, int64_t h, int64_t i) const { return own + (b * H + h) * Lq + i; }

  // own + attend_current as T per row of the block (keys j < that break the stick); returns the keys to visit
  int64_t limits(int64_t b, int64_t h, int64_t i0, int64_t m, T* lim) const {
    const int64_t* o = ownrow(b, h, i0);
    int64_t end = 0;
    for (int64_t r = 0; r < m; ++r) {
      lim[r] = T(o[r] + (attend_current ? 1 : 0));
      end = std::max(end, o[r] + 1);
    }
    return std::min(end, Lk);
  }

  // whether the mask lets any query of the block see a key of the tile: a tile it hides from all of them neither
  // breaks a stick nor adds to O, dQ, dK or dV, so it is skipped (a packed block-diagonal mask, as continuous
  // batching passes, hides most tiles of a query block from the earlier sequences' keys)
  bool tile_visible(int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t nb) const {
    for (int64_t r = 0; r < m; ++r)
      if (std::memchr(keep + b * msb + h * msh + (i0 + r) * msl + j0, 1, nb) != nullptr) return true;
    return false;
  }

  // the mask tile, transposed to MT[key][query] as 0/1
  void mask_tile(int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t nb, T* mt) const {
    for (int64_t r = 0; r < m; ++r) {
      const bool* row = keep + b * msb + h * msh + (i0 + r) * msl + j0;
      for (int64_t jj = 0; jj < nb; ++jj) mt[jj * m + r] = row[jj] ? T(1) : T(0);
    }
  }
};

template <typename T>
SB<T> make_sb(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& keep,
              const at::Tensor& own, bool attend_current, bool remainder, int64_t block_q, int64_t block_k) {
  SB<T> p;
  bind_qkv<T>(p, q, k, v, keep, "stickbreaking");
  TORCH_CHECK(own.is_contiguous(), "stickbreaking: own must be contiguous");
  p.BQ = block_q;
  p.BK = block_k;
  p.nqb = (p.Lq + p.BQ - 1) / p.BQ;
  p.nkb = (p.Lk + p.BK - 1) / p.BK;
  p.own = own.data_ptr<int64_t>();
  p.attend_current = attend_current;
  p.remainder = remainder;
  return p;
}

// run fn(item) for items [0, n) on torch's threads, handed out dynamically. Denormals are flushed to zero meanwhile
// (and the caller's mode restored): the weights of far keys run down to e^-87 and their products with v or dO into
// the subnormal range, which made the BLAS calls about 20% slower (measured); such values are below fp32's
// resolution of any output anyway.
template <typename F>
void run_items(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
#if defined(__SSE__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);  // FTZ | DAZ
#endif
    for (int64_t it = next.fetch_add(1); it < n; it = next.fetch_add(1)) fn(it);
#if defined(__SSE__)
    _mm_setcsr(csr);
#endif
  });
}

template <typename T>
void sb_forward_impl(const SB<T>& p, T* out, T* call) {
  const int64_t BQ = p.BQ, BK = p.BK, NC = p.nkb + 1;
  const int64_t n_items = p.B * p.H * p.nqb;
  run_items(n_items, [&](int64_t it) {
    // largest query blocks (most keys under causality) first
    const int64_t qb = p.nqb - 1 - it / (p.B * p.H);
    const int64_t bh = it % (p.B * p.H), b = bh / p.H, h = bh % p.H, g = h / p.G;
    const int64_t i0 = qb * BQ, m = std::min(BQ, p.Lq - i0);
    thread_local std::vector<T> buf;
    buf.resize(2 * BQ + 2 * BK * BQ + p.Dv * BQ);
    T *lim = buf.data(), *e = lim + BQ, *zt = e + BQ, *mt = zt + BK * BQ, *ot = mt + BK * BQ;
    const int64_t end = p.limits(b, h, i0, m, lim);
    std::fill(e, e + m, T(1));
    std::fill(ot, ot + p.Dv * m, T(0));
    T* cs = call + ((b * p.H + h) * p.Lq + i0) * NC;
    for (int64_t kb = (end + BK - 1) / BK - 1; kb >= 0; --kb) {
      const int64_t j0 = kb * BK, nb = std::min(BK, end - j0);
      for (int64_t r = 0; r < m; ++r) cs[r * NC + kb] = e[r];
      if (p.keep && !p.tile_visible(b, h, i0, m, j0, nb)) continue;  // (e unchanged: the edge value stays right)
      mm_abt<T>(nb, m, p.D, p.krow(b, g, j0), p.ksl, p.qrow(b, h, i0), p.D, T(0), zt, m);
      if (p.keep) {
        p.mask_tile(b, h, i0, m, j0, nb, mt);
        scan_tile<T, true, false>(zt, mt, lim, e, nullptr, nullptr, j0, nb, m);
      } else {
        scan_tile<T, false, false>(zt, mt, lim, e, nullptr, nullptr, j0, nb, m);
      }
      // O^T [Dv][m] += V^T A^T: the scan's A is key-major (A^T), so no transpose per tile
      mm_atb<T>(p.Dv, m, nb, p.vrow(b, g, j0), p.vsl, zt, m, T(1), ot, m);
    }
    T* o = out + ((b * p.H + h) * p.Lq + i0) * p.Dv;
    transpose(ot, p.Dv, m, o);
    const int64_t* ow = p.ownrow(b, h, i0);
    for (int64_t r = 0; r < m; ++r) {
      cs[r * NC + p.nkb] = e[r];
      if (p.remainder && ow[r] >= 0) {  // what is left of the stick goes to the own key's value
        const T* vo = p.vrow(b, g, ow[r]);
        for (int64_t d = 0; d < p.Dv; ++d) o[r * p.Dv + d] += e[r] * vo[d];
      }
    }
  });
}

template <typename T>
void sb_backward_impl(const SB<T>& p, const T* call, const T* dout, T* dq, T* dk, T* dv, int64_t parts) {
  // dk: [B, Hkv, parts, Lk, D], dv: [B, Hkv, parts, Lk, Dv] (summed over parts by the caller)
  const int64_t BQ = p.BQ, BK = p.BK, NC = p.nkb + 1;
  const int64_t n_items = p.B * p.Hkv * parts;
  run_items(n_items, [&](int64_t it) {
    const int64_t part = it % parts, bg = it / parts, b = bg / p.Hkv, g = bg % p.Hkv;
    T* dkp = dk + (bg * parts + part) * p.Lk * p.D;
    T* dvp = dv + (bg * parts + part) * p.Lk * p.Dv;
    thread_local std::vector<T> buf;
    buf.resize(4 * BQ + 5 * BK * BQ);
    T *lim = buf.data(), *e = lim + BQ, *pre = e + BQ, *rr = pre + BQ;
    T *zt = rr + BQ, *gt = zt + BK * BQ, *at = gt + BK * BQ, *sg = at + BK * BQ, *mt = sg + BK * BQ;
    for (int64_t h = g * p.G; h < (g + 1) * p.G; ++h) {
      for (int64_t qb = p.nqb - 1 - part; qb >= 0; qb -= parts) {
        const int64_t i0 = qb * BQ, m = std::min(BQ, p.Lq - i0);
        const int64_t end = p.limits(b, h, i0, m, lim);
        const T* dor = dout + ((b * p.H + h) * p.Lq + i0) * p.Dv;
        const T* cs = call + ((b * p.H + h) * p.Lq + i0) * NC;
        const int64_t* ow = p.ownrow(b, h, i0);
        for (int64_t r = 0; r < m; ++r) {
          pre[r] = T(0);
          rr[r] = T(0);
          if (p.remainder && ow[r] >= 0) {
            const T* vo = p.vrow(b, g, ow[r]);
            T dot = 0;
            for (int64_t d = 0; d < p.Dv; ++d) dot += dor[r * p.Dv + d] * vo[d];
            rr[r] = cs[r * NC + p.nkb] * dot;
          }
        }
        T* dqr = dq + ((b * p.H + h) * p.Lq + i0) * p.D;
        const int64_t nk = (end + BK - 1) / BK;
        for (int64_t kb = 0; kb < nk; ++kb) {
          const int64_t j0 = kb * BK, nb = std::min(BK, end - j0);
          if (p.keep && !p.tile_visible(b, h, i0, m, j0, nb)) continue;  // (A = beta = 0: no dz, no prefix)
          mm_abt<T>(nb, m, p.D, p.krow(b, g, j0), p.ksl, p.qrow(b, h, i0), p.D, T(0), zt, m);
          mm_abt<T>(nb, m, p.Dv, p.vrow(b, g, j0), p.vsl, dor, p.Dv, T(0), gt, m);
          if (p.keep) p.mask_tile(b, h, i0, m, j0, nb, mt);
          for (int64_t r = 0; r < m; ++r) e[r] = cs[r * NC + kb];
          if (p.keep) {  // A and beta, nearest key first (from the forward's e at this block's edge)
            scan_tile<T, true, true>(zt, mt, lim, e, at, sg, j0, nb, m);
          } else {
            scan_tile<T, false, true>(zt, mt, lim, e, at, sg, j0, nb, m);
          }
          for (int64_t jj = 0; jj < nb; ++jj) {  // the prefix P from the far keys, dz into zt
            const T* ar = at + jj * m;
            const T* sr = sg + jj * m;
            const T* gr = gt + jj * m;
            T* dz = zt + jj * m;
#pragma omp simd
            for (int64_t r = 0; r < m; ++r) {
              const T ag = ar[r] * gr[r];
              pre[r] += ag;
              dz[r] = ag - sr[r] * (pre[r] + rr[r]);
            }
          }
          mm_atb<T>(m, p.D, nb, zt, m, p.krow(b, g, j0), p.ksl, T(1), dqr, p.D);
          mm_ab<T>(nb, p.D, m, zt, m, p.qrow(b, h, i0), p.D, T(1), dkp + j0 * p.D, p.D);
          mm_ab<T>(nb, p.Dv, m, at, m, dor, p.Dv, T(1), dvp + j0 * p.Dv, p.Dv);
        }
        if (p.remainder) {  // dv_own += r_i dO_i
          for (int64_t r = 0; r < m; ++r) {
            if (ow[r] < 0) continue;
            const T rem = cs[r * NC + p.nkb];
            T* d = dvp + ow[r] * p.Dv;
            for (int64_t e = 0; e < p.Dv; ++e) d[e] += rem * dor[r * p.Dv + e];
          }
        }
      }
    }
  });
}

std::vector<at::Tensor> sb_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::optional<at::Tensor>& keep, const at::Tensor& own, bool attend_current,
                                   bool remainder, int64_t block_q, int64_t block_k) {
  const int64_t nkb = (k.size(2) + block_k - 1) / block_k;
  auto out = at::zeros({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  auto call = at::zeros({q.size(0), q.size(1), q.size(2), nkb + 1}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sb_forward", [&] {
    auto p = make_sb<scalar_t>(q, k, v, keep, own, attend_current, remainder, block_q, block_k);
    sb_forward_impl<scalar_t>(p, out.data_ptr<scalar_t>(), call.data_ptr<scalar_t>());
  });
  return {out, call};
}

std::vector<at::Tensor> sb_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& keep, const at::Tensor& own,
                                    bool attend_current, bool remainder, const at::Tensor& call,
                                    const at::Tensor& dout, int64_t block_q, int64_t block_k) {
  TORCH_CHECK(dout.is_contiguous() && call.is_contiguous(), "stickbreaking: dout and c must be contiguous");
  const int64_t B = q.size(0), Hkv = k.size(1), Lk = k.size(2), D = q.size(3), Dv = v.size(3);
  const int64_t nqb = (q.size(2) + block_q - 1) / block_q;
  const int64_t nthreads = at::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(nqb, (nthreads + B * Hkv - 1) / (B * Hkv)));
  auto dq = at::zeros_like(q);
  auto dkp = at::zeros({B, Hkv, parts, Lk, D}, q.options());
  auto dvp = at::zeros({B, Hkv, parts, Lk, Dv}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sb_backward", [&] {
    auto p = make_sb<scalar_t>(q, k, v, keep, own, attend_current, remainder, block_q, block_k);
    sb_backward_impl<scalar_t>(p, call.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(),
                               dkp.data_ptr<scalar_t>(), dvp.data_ptr<scalar_t>(), parts);
  });
  auto dk = parts == 1 ? dkp.squeeze(2) : dkp.sum(2);
  auto dv = parts == 1 ? dvp.squeeze(2) : dvp.sum(2);
  return {dq, dk, dv};
}

}  // namespace

// the ops' namespace: HF_ATTNORM_NATIVE_NS, this family's own (kernels/native.py)
HF_TORCH_LIBRARY(HF_ATTNORM_NATIVE_NS, m) {
  m.def("blas_available() -> bool", &blas_available);
  m.def(
      "sb_forward(Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor own, bool attend_current, bool remainder, "
      "int block_q, int block_k) -> Tensor[]");
  m.def(
      "sb_backward(Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor own, bool attend_current, bool remainder, "
      "Tensor c, Tensor dout, int block_q, int block_k) -> Tensor[]");
}

HF_TORCH_LIBRARY_IMPL(HF_ATTNORM_NATIVE_NS, CPU, m) {
  m.impl("sb_forward", &sb_forward);
  m.impl("sb_backward", &sb_backward);
}
