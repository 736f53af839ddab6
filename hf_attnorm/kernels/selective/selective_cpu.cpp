// Fused CPU selective attention (Leviathan et al., arXiv 2410.02703; the math is ../../normalizers/selective.py, the
// Python side cpu.py beside it). Compiled as this family's own extension (kernels/native.py); its ops are
// hf_attnorm_fused::sel_forward and hf_attnorm_fused::sel_backward.
//
// With S the selecting head's scores, R = relu(S) on the selecting entries (visible, not BOS, not the query's own
// key, the query's own key live), F_ij = sum_{k < i} R_kj, and for every head w_i = softmax_j(s_ij - F_ij).
// F of a query block [i0, i1) and a key tile is carry_j + the exclusive cumsum of R over the block's rows, where
// carry_j = sum_{k < i0} R_kj: each column is independent, so a block's F is formed tile by tile from its own scores.
//
// Forward, two parallel passes (in one parallel region, the second starting when the first is done):
//   1. per (b, query block): the column sums of R over the block's rows (one head's Q K^T), colsums [B, nqb, Lk]
//      (saved for the backward: O(n^2 / block_q) numbers); a block's carry is carry0 + the sum of the column sums
//      of the blocks before it, formed tile by tile where it is used (in block order, the same in the backward);
//   2. per (b, query block), every head: key tiles from the diagonal back, the F tile from the selecting head's
//      scores (formed once, reused as that head's own scores), then per head a flash-style online softmax of
//      s - F (row max and sum, O += P V by BLAS). Saves the row logsumexp lse [B, H, Lq].
// Backward, two parallel passes (items: (b, part), each part owning a set of query blocks, balanced by cost, and
// private dK/dV buffers summed in a fixed order: deterministic):
//   A. per block and key tile: recompute F and every head's P = exp(s - F - lse); dP = dO V^T, dS = P (dP - delta),
//      dV += P^T dO, dQ += dS K, dK += dS^T Q, dF = -sum_h dS; the selecting head comes last, so that the penalty's
//      in-block part dR_kj = sum_{i > k in block} dF_ij joins its dS before its dQ/dK matmuls (where R selects and
//      S > 0). Writes the column sums of dF per block.
//   B. (after every item of A) the gradient leaving each block's carry, g = the sum of those column sums over the
//      later blocks, reaches the selecting head's scores of every row of the block where R selects and S > 0: per
//      block one more Q K^T of that head and dQ += G K, dK += G^T Q (G = g on those entries). d carry0 = the sum of
//      all column sums.
//
// Shapes: q [B, H, Lq, D] contiguous (already scaled); k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (last dim contiguous;
// head h uses kv head h / (H / Hkv)); keep: optional bool [B, H, Lq, Lk] (strides may be 0, last dim contiguous);
// causal (with keep None): query i sees keys j <= i (upper-left); starts bool [B, Lk]: the BOS keys (every
// document's first key under packing), which no query selects; selrow bool
// [B, Lq]: the row may select (its own key, i + Lk - Lq, is live or outside the keys); carry0: optional [B, Lk],
// column sums carried in from earlier queries (cached decoding).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <thread>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "cpu_common.h"

namespace {

// run fn1(item) for items [0, n1), then, once all of them are done, fn2(item) for items [0, n2), then likewise fn3,
// on torch's threads in one parallel region (items handed out dynamically; one region rather than two: on a loaded machine each region's
// start and end waits for every thread to be scheduled). Denormals are flushed meanwhile: the weights of heavily
// penalised keys run into the subnormal range, which slows the BLAS calls (see ../stickbreaking/stickbreaking_cpu.cpp). No deadlock when
// the region gets fewer threads than asked: a thread waits only for items that running threads have taken.
template <typename F1, typename F2, typename F3>
void sel_run_phases(int64_t n1, const F1& fn1, int64_t n2, const F2& fn2, int64_t n3, const F3& fn3) {
  std::atomic<int64_t> next1{0}, done1{0}, next2{0}, done2{0}, next3{0};
  const int64_t most = std::max(n1, std::max(n2, n3));
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), most));
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
#if defined(__SSE__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);  // FTZ | DAZ
#endif
    for (int64_t it = next1.fetch_add(1); it < n1; it = next1.fetch_add(1)) {
      fn1(it);
      done1.fetch_add(1, std::memory_order_release);
    }
    while (done1.load(std::memory_order_acquire) < n1) std::this_thread::yield();
    for (int64_t it = next2.fetch_add(1); it < n2; it = next2.fetch_add(1)) {
      fn2(it);
      done2.fetch_add(1, std::memory_order_release);
    }
    if (n3 > 0) {
      while (done2.load(std::memory_order_acquire) < n2) std::this_thread::yield();
      for (int64_t it = next3.fetch_add(1); it < n3; it = next3.fetch_add(1)) fn3(it);
    }
#if defined(__SSE__)
    _mm_setcsr(csr);
#endif
  });
}

// BLAS with a factor on the product (the call's scale, so that q needs no scaled copy: one pass and one parallel
// region less per call, which on a loaded machine costs as much as a short attention call). sgemm_/dgemm_: cpu_common.h
inline void sel_gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                     const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int im = m, in = n, ik = k, ila = lda, ilb = ldb, ilc = ldc;
  sgemm_(&ta, &tb, &im, &in, &ik, &alpha, a, &ila, b, &ilb, &beta, c, &ilc);
}
inline void sel_gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
                     const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  const int im = m, in = n, ik = k, ila = lda, ilb = ldb, ilc = ldc;
  dgemm_(&ta, &tb, &im, &in, &ik, &alpha, a, &ila, b, &ilb, &beta, c, &ilc);
}
// row-major, as cpu_common.h's mm_abt (C = alpha A B^T + beta C), mm_ab (alpha A B) and mm_atb (alpha A^T B)
template <typename T>
inline void smm_abt(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
                    int64_t ldc, T alpha = T(1)) {
  sel_gemm('T', 'N', n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
}
template <typename T>
inline void smm_ab(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
                   int64_t ldc, T alpha = T(1)) {
  sel_gemm('N', 'N', n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
}
template <typename T>
inline void smm_atb(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
                    int64_t ldc, T alpha = T(1)) {
  sel_gemm('N', 'T', n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
}

template <typename T>
struct Sel {
  int64_t B, H, Hkv, G, Lq, Lk, D, Dv, BQ, BK, nqb, hs;
  T scale;  // scores are scale * q k^T
  const T *q, *k, *v;
  int64_t ksb, ksh, ksl, vsb, vsh, vsl;
  const bool* keep;
  int64_t msb, msh, msl;
  bool causal;
  const bool* starts;
  const bool* selrow;
  std::vector<int64_t> kend;  // [B * nqb]: the block's rows see keys < kend only

  const T* qrow(int64_t b, int64_t h, int64_t i) const { return q + ((b * H + h) * Lq + i) * D; }
  const T* krow(int64_t b, int64_t g, int64_t j) const { return k + b * ksb + g * ksh + j * ksl; }
  const T* vrow(int64_t b, int64_t g, int64_t j) const { return v + b * vsb + g * vsh + j * vsl; }

  // the last visible key + 1 over the rows of query block qb (and every head with a per-head mask)
  int64_t block_end(int64_t b, int64_t qb) const {
    const int64_t i0 = qb * BQ, m = std::min(BQ, Lq - i0);
    if (!keep) return causal ? std::min(Lk, i0 + m) : Lk;
    int64_t e = 0;
    const int64_t nh = msh == 0 ? 1 : H;
    for (int64_t h = 0; h < nh && e < Lk; ++h)
      for (int64_t r = 0; r < m && e < Lk; ++r) {
        const bool* row = keep + b * msb + h * msh + (i0 + r) * msl;
        for (int64_t j = Lk - 1; j >= e; --j)
          if (row[j]) {
            e = j + 1;
            break;
          }
      }
    return e;
  }

  // additive visibility of head h on the tile (0 visible, -inf masked) into ma [m][nb]; false when every entry is
  // visible (ma untouched)
  bool mask_tile(int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t nb, T* ma) const {
    const T ninf = -std::numeric_limits<T>::infinity();
    if (!keep) {
      if (!causal || j0 + nb - 1 <= i0) return false;
      for (int64_t r = 0; r < m; ++r)
        for (int64_t jj = 0; jj < nb; ++jj) ma[r * nb + jj] = j0 + jj > i0 + r ? ninf : T(0);
      return true;
    }
    for (int64_t r = 0; r < m; ++r) {
      const bool* row = keep + b * msb + h * msh + (i0 + r) * msl + j0;
      for (int64_t jj = 0; jj < nb; ++jj) ma[r * nb + jj] = row[jj] ? T(0) : ninf;
    }
    return true;
  }

  // the carry entering query block qb on keys [j0, j0 + nb): carry0 + the column sums of the blocks before it,
  // summed in block order (the forward and the backward form the same numbers)
  void carry_tile(const T* carry0, const T* colsums, int64_t b, int64_t qb, int64_t j0, int64_t nb, T* run) const {
    if (carry0)
      std::copy(carry0 + b * Lk + j0, carry0 + b * Lk + j0 + nb, run);
    else
      std::fill(run, run + nb, T(0));
    for (int64_t c = 0; c < qb; ++c) {
      const T* cs = colsums + (b * nqb + c) * Lk + j0;
#pragma omp simd
      for (int64_t jj = 0; jj < nb; ++jj) run[jj] += cs[jj];
    }
  }

  // Walk the rows of the selecting head's score tile s [m][nb]: before row r is added, run holds the column sums of
  // R over the rows above it (plus the carry it started from). Writes F (when f != null) and leaves the block's
  // total in run. ma: the selecting head's visibility (null: all visible). Where dr != null, the entries where R
  // selects and s > 0 (the relu's derivative) are written as 1, the others 0 (the backward's selection mask).
  void penalty_tile(int64_t b, int64_t i0, int64_t m, int64_t j0, int64_t nb, const T* s, const T* ma, T* run, T* f,
                    T* dr) const {
    const bool* st = starts + b * Lk + j0;
    const bool* sr = selrow + b * Lq + i0;
    for (int64_t r = 0; r < m; ++r) {
      const T* s_r = s + r * nb;
      const T* ma_r = ma ? ma + r * nb : nullptr;
      T* f_r = f ? f + r * nb : nullptr;
      T* d_r = dr ? dr + r * nb : nullptr;
      if (f_r) std::copy(run, run + nb, f_r);
      if (!sr[r]) {
        if (d_r) std::fill(d_r, d_r + nb, T(0));
        continue;
      }
      const int64_t oj = i0 + r + Lk - Lq - j0;  // the row's own key in tile coordinates
#pragma omp simd
      for (int64_t jj = 0; jj < nb; ++jj) {
        bool on = s_r[jj] > T(0) && jj != oj && !st[jj];
        if (ma_r) on = on && ma_r[jj] == T(0);
        run[jj] += on ? s_r[jj] : T(0);
        if (d_r) d_r[jj] = on ? T(1) : T(0);
      }
    }
  }
};

template <typename T>
Sel<T> make_sel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& keep,
                bool causal, int64_t head, double scale, const at::Tensor& starts, const at::Tensor& selrow,
                int64_t block_q, int64_t block_k) {
  Sel<T> p;
  p.scale = static_cast<T>(scale);
  bind_qkv<T>(p, q, k, v, keep, "selective");
  TORCH_CHECK(head >= 0 && head < p.H, "selective: selecting head ", head, " out of range 0..", p.H - 1);
  TORCH_CHECK(starts.scalar_type() == at::kBool && starts.is_contiguous() && starts.numel() == p.B * p.Lk,
              "selective: starts must be bool [B, Lk]");
  TORCH_CHECK(selrow.scalar_type() == at::kBool && selrow.is_contiguous() && selrow.numel() == p.B * p.Lq,
              "selective: selrow must be bool [B, Lq]");
  TORCH_CHECK(block_q > 0 && block_k > 0, "selective: block sizes must be positive");
  p.BQ = block_q;
  p.BK = block_k;
  p.nqb = (p.Lq + p.BQ - 1) / p.BQ;
  p.hs = head;
  p.causal = causal;
  p.starts = starts.data_ptr<bool>();
  p.selrow = selrow.data_ptr<bool>();
  p.kend.resize(p.B * p.nqb);
  // a mask is scanned (from each row's end) in parallel; without one each block's end is a formula
  const auto ends = [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) p.kend[it] = p.block_end(it / p.nqb, it % p.nqb);
  };
  if (p.keep)
    at::parallel_for(0, p.B * p.nqb, 1, ends);
  else
    ends(0, p.B * p.nqb);
  return p;
}

// pass 1, item (b, qb < nqb - 1): colsums[b][qb] = the column sums of R over the rows of block qb (the last block's
// are not needed)
template <typename T>
auto colsum_items(const Sel<T>& p, T* colsums) {
  return [&p, colsums](int64_t it) {
    const int64_t BQ = p.BQ, BK = p.BK, Lk = p.Lk;
    const int64_t b = it / (p.nqb - 1), qb = it % (p.nqb - 1);
    const int64_t i0 = qb * BQ, m = std::min(BQ, p.Lq - i0), ke = p.kend[b * p.nqb + qb];
    thread_local std::vector<T> buf;
    buf.resize(2 * BQ * BK);
    T *s = buf.data(), *ma = s + BQ * BK;
    T* run = colsums + (b * p.nqb + qb) * Lk;
    std::fill(run, run + Lk, T(0));
    for (int64_t j0 = 0; j0 < ke; j0 += BK) {
      const int64_t nb = std::min(BK, ke - j0);
      smm_abt<T>(m, nb, p.D, p.qrow(b, p.hs, i0), p.D, p.krow(b, p.hs / p.G, j0), p.ksl, T(0), s, nb, p.scale);
      const bool masked = p.mask_tile(b, p.hs, i0, m, j0, nb, ma);
      p.penalty_tile(b, i0, m, j0, nb, s, masked ? ma : nullptr, run + j0, nullptr, nullptr);
    }
  };
}

// z = s - f (+ ma) into z (which may be s), returning the max
template <typename T>
inline T shifted_max(const T* s, const T* __restrict f, const T* __restrict ma, T* z, int64_t nb) {
  T mx = -std::numeric_limits<T>::infinity();
  if (ma) {
#pragma omp simd reduction(max : mx)
    for (int64_t jj = 0; jj < nb; ++jj) {
      const T x = s[jj] - f[jj] + ma[jj];
      z[jj] = x;
      mx = std::max(mx, x);
    }
  } else {
#pragma omp simd reduction(max : mx)
    for (int64_t jj = 0; jj < nb; ++jj) {
      const T x = s[jj] - f[jj];
      z[jj] = x;
      mx = std::max(mx, x);
    }
  }
  return mx;
}

// pass 1 (colsum_items), then pass 2: out [B, H, Lq, Dv], lse [B, H, Lq] (+inf on rows that see no key)
template <typename T>
void forward_impl(const Sel<T>& p, const T* carry0, T* colsums, T* out, T* lse) {
  const int64_t BQ = p.BQ, BK = p.BK, H = p.H, Dv = p.Dv;
  const T ninf = -std::numeric_limits<T>::infinity();
  // largest blocks (most keys) first
  std::vector<int64_t> order(p.B * p.nqb);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return p.kend[a] > p.kend[c]; });
  const auto item = [&](int64_t it) {
    const int64_t bq = order[it], b = bq / p.nqb, qb = bq % p.nqb;
    const int64_t i0 = qb * BQ, m = std::min(BQ, p.Lq - i0), ke = p.kend[bq];
    thread_local std::vector<T> buf;
    buf.resize(5 * BQ * BK + BK + H * BQ * (Dv + 2));
    T *ssel = buf.data(), *f = ssel + BQ * BK, *z = f + BQ * BK, *mah = z + BQ * BK, *mas = mah + BQ * BK;
    T *run = mas + BQ * BK, *acc = run + BK, *rmax = acc + H * BQ * Dv, *rsum = rmax + H * BQ;
    std::fill(acc, acc + H * BQ * Dv, T(0));
    std::fill(rmax, rmax + H * BQ, ninf);
    std::fill(rsum, rsum + H * BQ, T(0));
    const bool shared_mask = p.keep == nullptr || p.msh == 0;
    for (int64_t j0 = ((ke + BK - 1) / BK - 1) * BK; j0 >= 0; j0 -= BK) {  // from the diagonal back
      const int64_t nb = std::min(BK, ke - j0);
      smm_abt<T>(m, nb, p.D, p.qrow(b, p.hs, i0), p.D, p.krow(b, p.hs / p.G, j0), p.ksl, T(0), ssel, nb, p.scale);
      const bool masked = p.mask_tile(b, p.hs, i0, m, j0, nb, mas);
      p.carry_tile(carry0, colsums, b, qb, j0, nb, run);
      p.penalty_tile(b, i0, m, j0, nb, ssel, masked ? mas : nullptr, run, f, nullptr);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = h / p.G;
        const T* s = ssel;
        if (h != p.hs) {
          smm_abt<T>(m, nb, p.D, p.qrow(b, h, i0), p.D, p.krow(b, g, j0), p.ksl, T(0), z, nb, p.scale);
          s = z;
        }
        const T* ma = masked ? mas : nullptr;
        if (!shared_mask && h != p.hs) ma = p.mask_tile(b, h, i0, m, j0, nb, mah) ? mah : nullptr;
        T* o = acc + h * BQ * Dv;
        for (int64_t r = 0; r < m; ++r) {
          T* zr = z + r * nb;
          const T mx = shifted_max(s + r * nb, f + r * nb, ma ? ma + r * nb : nullptr, zr, nb);
          T& rm = rmax[h * BQ + r];
          const T mn = std::max(rm, mx);
          if (mn == ninf) {  // nothing visible in this row yet
            std::fill(zr, zr + nb, T(0));
            continue;
          }
          T sum = 0;
#pragma omp simd reduction(+ : sum)
          for (int64_t jj = 0; jj < nb; ++jj) {
            const T e = vexp(zr[jj] - mn);
            zr[jj] = e;
            sum += e;
          }
          if (mn != rm) {
            const T alpha = vexp(rm - mn);  // 0 when rm = -inf
            rsum[h * BQ + r] *= alpha;
            T* orow = o + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) orow[d] *= alpha;
            rm = mn;
          }
          rsum[h * BQ + r] += sum;
        }
        smm_ab<T>(m, Dv, nb, z, nb, p.vrow(b, g, j0), p.vsl, T(1), o, Dv);
      }
    }
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < m; ++r) {
        T* dst = out + ((b * H + h) * p.Lq + i0 + r) * Dv;
        const T l = rsum[h * BQ + r];
        const T* src = acc + (h * BQ + r) * Dv;
        if (l > T(0)) {
          const T inv = T(1) / l;
          for (int64_t d = 0; d < Dv; ++d) dst[d] = src[d] * inv;
          lse[(b * H + h) * p.Lq + i0 + r] = rmax[h * BQ + r] + std::log(l);
        } else {  // no visible key: output 0
          std::fill(dst, dst + Dv, T(0));
          lse[(b * H + h) * p.Lq + i0 + r] = std::numeric_limits<T>::infinity();
        }
      }
  };
  for (int64_t b = 0; b < p.B; ++b)  // the last block's slot (never read; zero rather than undefined)
    std::fill(colsums + (b * p.nqb + p.nqb - 1) * p.Lk, colsums + (b * p.nqb + p.nqb) * p.Lk, T(0));
  sel_run_phases(p.B * (p.nqb - 1), colsum_items(p, colsums), p.B * p.nqb, item, 0, [](int64_t) {});
}

// the query blocks of each part (per batch row): longest first to the least loaded part (deterministic)
template <typename T>
std::vector<std::vector<int64_t>> assign_parts(const Sel<T>& p, int64_t b, int64_t parts) {
  std::vector<std::vector<int64_t>> lists(parts);
  std::vector<int64_t> load(parts, 0), order(p.nqb);
  std::iota(order.begin(), order.end(), 0);
  const int64_t* ke = p.kend.data() + b * p.nqb;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return ke[a] > ke[c]; });
  for (int64_t qb : order) {
    const int64_t part = std::min_element(load.begin(), load.end()) - load.begin();
    lists[part].push_back(qb);
    load[part] += std::min(p.BQ, p.Lq - qb * p.BQ) * std::max<int64_t>(ke[qb], 1);
  }
  return lists;
}

using Lists = std::vector<std::vector<std::vector<int64_t>>>;  // [b][part] -> query blocks

// pass A, item (b, part). dq [B, H, Lq, D] (accumulated), dk/dv [B, parts, Hkv, Lk, *], dfcol [B, nqb, Lk]: the
// column sums of dF per block
template <typename T>
void backward_impl(const Sel<T>& p, const Lists& lists, const T* carry0, const T* colsums, const T* out, const T* lse,
                   const T* dout, T* dq, T* dk, T* dv, T* dfcol, int64_t parts, int64_t it) {
  const int64_t BQ = p.BQ, BK = p.BK, H = p.H, D = p.D, Dv = p.Dv, Lk = p.Lk;
  {
    const int64_t b = it / parts, part = it % parts;
    T* dkp = dk + (b * parts + part) * p.Hkv * Lk * D;
    T* dvp = dv + (b * parts + part) * p.Hkv * Lk * Dv;
    thread_local std::vector<T> buf;
    buf.resize(8 * BQ * BK + BK + H * BQ);
    T *ssel = buf.data(), *f = ssel + BQ * BK, *pt = f + BQ * BK, *dp = pt + BQ * BK, *df = dp + BQ * BK;
    T *sm = df + BQ * BK, *mah = sm + BQ * BK, *mas = mah + BQ * BK, *run = mas + BQ * BK, *delta = run + BK;
    const bool shared_mask = p.keep == nullptr || p.msh == 0;
    // the buffers this item owns start at zero (filled here, in the parallel region, not by at::zeros)
    std::fill(dkp, dkp + p.Hkv * Lk * D, T(0));
    std::fill(dvp, dvp + p.Hkv * Lk * Dv, T(0));
    for (int64_t qb : lists[b][part]) {
      const int64_t i0 = qb * BQ, m = std::min(BQ, p.Lq - i0), ke = p.kend[b * p.nqb + qb];
      T* dfc = dfcol + (b * p.nqb + qb) * Lk;
      std::fill(dfc, dfc + Lk, T(0));
      for (int64_t h = 0; h < H; ++h) {
        T* dqr = dq + ((b * H + h) * p.Lq + i0) * D;
        std::fill(dqr, dqr + m * D, T(0));
      }
      if (ke == 0) continue;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < m; ++r) {
          const T* o = out + ((b * H + h) * p.Lq + i0 + r) * Dv;
          const T* g = dout + ((b * H + h) * p.Lq + i0 + r) * Dv;
          T s = 0;
          for (int64_t d = 0; d < Dv; ++d) s += o[d] * g[d];
          delta[h * BQ + r] = s;
        }
      for (int64_t j0 = 0; j0 < ke; j0 += BK) {
        const int64_t nb = std::min(BK, ke - j0);
        smm_abt<T>(m, nb, D, p.qrow(b, p.hs, i0), D, p.krow(b, p.hs / p.G, j0), p.ksl, T(0), ssel, nb, p.scale);
        const bool masked = p.mask_tile(b, p.hs, i0, m, j0, nb, mas);
        p.carry_tile(carry0, colsums, b, qb, j0, nb, run);
        p.penalty_tile(b, i0, m, j0, nb, ssel, masked ? mas : nullptr, run, f, sm);
        std::fill(df, df + m * nb, T(0));
        for (int64_t hi = 0; hi < H; ++hi) {
          const int64_t h = hi == H - 1 ? p.hs : (hi < p.hs ? hi : hi + 1);  // the selecting head last
          const int64_t g = h / p.G;
          const T* s = ssel;
          if (h != p.hs) {
            smm_abt<T>(m, nb, D, p.qrow(b, h, i0), D, p.krow(b, g, j0), p.ksl, T(0), pt, nb, p.scale);
            s = pt;
          }
          const T* ma = masked ? mas : nullptr;
          if (!shared_mask && h != p.hs) ma = p.mask_tile(b, h, i0, m, j0, nb, mah) ? mah : nullptr;
          const T* dor = dout + ((b * H + h) * p.Lq + i0) * Dv;
          smm_abt<T>(m, nb, Dv, dor, Dv, p.vrow(b, g, j0), p.vsl, T(0), dp, nb);
          for (int64_t r = 0; r < m; ++r) {
            const T l = lse[(b * H + h) * p.Lq + i0 + r], dl = delta[h * BQ + r];
            const T* sr = s + r * nb;
            const T* fr = f + r * nb;
            T* pr = pt + r * nb;
            T* dpr = dp + r * nb;
            T* dfr = df + r * nb;
            if (ma) {
              const T* mr = ma + r * nb;
#pragma omp simd
              for (int64_t jj = 0; jj < nb; ++jj) {
                const T e = vexp(sr[jj] - fr[jj] + mr[jj] - l);
                const T ds = e * (dpr[jj] - dl);
                pr[jj] = e;
                dpr[jj] = ds;
                dfr[jj] -= ds;
              }
            } else {
#pragma omp simd
              for (int64_t jj = 0; jj < nb; ++jj) {
                const T e = vexp(sr[jj] - fr[jj] - l);
                const T ds = e * (dpr[jj] - dl);
                pr[jj] = e;
                dpr[jj] = ds;
                dfr[jj] -= ds;
              }
            }
          }
          if (h == p.hs) {
            // dR_kj = sum_{i > k in the block} dF_ij joins the selecting head's dS where R selects and S > 0
            std::fill(run, run + nb, T(0));
            for (int64_t r = m - 1; r >= 0; --r) {
              T* dfr = df + r * nb;
              T* dsr = dp + r * nb;
              const T* smr = sm + r * nb;
#pragma omp simd
              for (int64_t jj = 0; jj < nb; ++jj) {
                dsr[jj] += smr[jj] * run[jj];
                run[jj] += dfr[jj];
              }
            }
            std::copy(run, run + nb, dfc + j0);
          }
          T* dqr = dq + ((b * H + h) * p.Lq + i0) * D;
          smm_ab<T>(m, D, nb, dp, nb, p.krow(b, g, j0), p.ksl, T(1), dqr, D, p.scale);
          smm_atb<T>(nb, D, m, dp, nb, p.qrow(b, h, i0), D, T(1), dkp + (g * Lk + j0) * D, D, p.scale);
          smm_atb<T>(nb, Dv, m, pt, nb, dor, Dv, T(1), dvp + (g * Lk + j0) * Dv, Dv);
        }
      }
    }
  }
}

// pass B, item (b, part), after every pass-A item: the gradient of the carry leaving each block, g = the column sums
// of dF of the later blocks (summed from the last), reaches the selecting head's scores where R selects and S > 0
template <typename T>
void carry_grad_impl(const Sel<T>& p, const Lists& lists, const T* dfcol, T* dq, T* dk, int64_t parts, int64_t it) {
  const int64_t BQ = p.BQ, BK = p.BK, D = p.D, Lk = p.Lk, hs = p.hs, gs = p.hs / p.G;
  {
    const int64_t b = it / parts, part = it % parts;
    T* dkp = dk + ((b * parts + part) * p.Hkv + gs) * Lk * D;
    thread_local std::vector<T> buf;
    buf.resize(3 * BQ * BK + 2 * BK);
    T *s = buf.data(), *mas = s + BQ * BK, *sm = mas + BQ * BK, *run = sm + BQ * BK, *g = run + BK;
    for (int64_t qb : lists[b][part]) {
      const int64_t i0 = qb * BQ, m = std::min(BQ, p.Lq - i0), ke = p.kend[b * p.nqb + qb];
      for (int64_t j0 = 0; j0 < ke; j0 += BK) {
        const int64_t nb = std::min(BK, ke - j0);
        std::fill(g, g + nb, T(0));
        for (int64_t c = p.nqb - 1; c > qb; --c) {
          const T* cs = dfcol + (b * p.nqb + c) * Lk + j0;
#pragma omp simd
          for (int64_t jj = 0; jj < nb; ++jj) g[jj] += cs[jj];
        }
        bool any = false;
        for (int64_t jj = 0; jj < nb; ++jj) any = any || g[jj] != T(0);
        if (!any) continue;
        smm_abt<T>(m, nb, D, p.qrow(b, hs, i0), D, p.krow(b, gs, j0), p.ksl, T(0), s, nb, p.scale);
        const bool masked = p.mask_tile(b, hs, i0, m, j0, nb, mas);
        std::fill(run, run + nb, T(0));
        p.penalty_tile(b, i0, m, j0, nb, s, masked ? mas : nullptr, run, nullptr, sm);
        for (int64_t r = 0; r < m; ++r) {
          T* smr = sm + r * nb;
#pragma omp simd
          for (int64_t jj = 0; jj < nb; ++jj) smr[jj] *= g[jj];
        }
        T* dqr = dq + ((b * p.H + hs) * p.Lq + i0) * D;
        smm_ab<T>(m, D, nb, sm, nb, p.krow(b, gs, j0), p.ksl, T(1), dqr, D, p.scale);
        smm_atb<T>(nb, D, m, sm, nb, p.qrow(b, hs, i0), D, T(1), dkp + j0 * D, D, p.scale);
      }
    }
  }
}

// dst[b][g] = sum over parts of src[b][part][g] (blocks of size w), in part order
template <typename T>
void sum_parts(const T* src, T* dst, int64_t b, int64_t g, int64_t Hkv, int64_t parts, int64_t w) {
  T* o = dst + (b * Hkv + g) * w;
  std::copy(src + (b * parts * Hkv + g) * w, src + (b * parts * Hkv + g + 1) * w, o);
  for (int64_t part = 1; part < parts; ++part) {
    const T* x = src + ((b * parts + part) * Hkv + g) * w;
#pragma omp simd
    for (int64_t e = 0; e < w; ++e) o[e] += x[e];
  }
}

std::vector<at::Tensor> sel_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& keep, bool causal, int64_t head, double scale,
                                    const at::Tensor& starts, const at::Tensor& selrow,
                                    const std::optional<at::Tensor>& carry0, int64_t block_q, int64_t block_k) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  const int64_t nqb = (Lq + block_q - 1) / block_q;
  auto out = at::empty({B, H, Lq, v.size(3)}, q.options());
  auto lse = at::empty({B, H, Lq}, q.options());
  auto colsums = at::empty({B, nqb, Lk}, q.options());
  if (carry0.has_value())
    TORCH_CHECK(carry0->is_contiguous() && carry0->size(0) == B && carry0->size(1) == Lk &&
                    carry0->scalar_type() == q.scalar_type(),
                "selective: carry0 must be contiguous [B, Lk] in q's dtype");
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sel_forward", [&] {
    auto p = make_sel<scalar_t>(q, k, v, keep, causal, head, scale, starts, selrow, block_q, block_k);
    forward_impl<scalar_t>(p, carry0.has_value() ? carry0->data_ptr<scalar_t>() : nullptr,
                           colsums.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
  });
  return {out, lse, colsums};
}

// -> dq, dk, dv, dcarry0 [B, Lk] (the gradient of the carried-in column sums)
std::vector<at::Tensor> sel_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const std::optional<at::Tensor>& keep, bool causal, int64_t head,
                                     double scale, const at::Tensor& starts, const at::Tensor& selrow,
                                     const std::optional<at::Tensor>& carry0, const at::Tensor& colsums,
                                     const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                                     int64_t block_q, int64_t block_k) {
  TORCH_CHECK(dout.is_contiguous() && out.is_contiguous() && lse.is_contiguous() && colsums.is_contiguous(),
              "selective: out, lse, colsums and dout must be contiguous");
  TORCH_CHECK(!carry0.has_value() || carry0->is_contiguous(), "selective: carry0 must be contiguous");
  const int64_t B = q.size(0), Hkv = k.size(1), Lk = k.size(2), D = q.size(3), Dv = v.size(3);
  const int64_t nqb = (q.size(2) + block_q - 1) / block_q;
  const int64_t nthreads = at::get_num_threads();
  // items (b, part): at least one per thread; when the batch rows do not divide evenly over the threads (3 rows, 2
  // threads), two parts per row, so that the rows' halves balance (private buffers are O(n d) per part)
  const int64_t want = std::max<int64_t>((nthreads + B - 1) / B, B % nthreads != 0 ? 2 : 1);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(nqb, want));
  // every buffer is filled by the items that own it (no at::zeros: each is a parallel region of its own)
  auto dq = at::empty_like(q);
  auto dk = at::empty({B, Hkv, Lk, D}, q.options());
  auto dv = at::empty({B, Hkv, Lk, Dv}, q.options());
  auto dkp = parts == 1 ? dk : at::empty({B, parts, Hkv, Lk, D}, q.options());
  auto dvp = parts == 1 ? dv : at::empty({B, parts, Hkv, Lk, Dv}, q.options());
  auto dfcol = at::empty({B, nqb, Lk}, q.options());
  auto dcarry = at::zeros({B, Lk}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sel_backward", [&] {
    auto p = make_sel<scalar_t>(q, k, v, keep, causal, head, scale, starts, selrow, block_q, block_k);
    Lists lists(B);
    for (int64_t b = 0; b < B; ++b) lists[b] = assign_parts(p, b, parts);
    const scalar_t* c0 = carry0.has_value() ? carry0->data_ptr<scalar_t>() : nullptr;
    scalar_t *dqp = dq.data_ptr<scalar_t>(), *dkpp = dkp.data_ptr<scalar_t>(), *g = dfcol.data_ptr<scalar_t>();
    sel_run_phases(
        B * parts,
        [&](int64_t it) {
          backward_impl<scalar_t>(p, lists, c0, colsums.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                  lse.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), dqp, dkpp,
                                  dvp.data_ptr<scalar_t>(), g, parts, it);
        },
        B * parts, [&](int64_t it) { carry_grad_impl<scalar_t>(p, lists, g, dqp, dkpp, parts, it); },
        parts > 1 ? B * Hkv : 0,
        [&](int64_t it) {  // dK, dV = the sum of the parts' buffers, in part order
          const int64_t b = it / Hkv, gh = it % Hkv;
          sum_parts(dkpp, dk.data_ptr<scalar_t>(), b, gh, Hkv, parts, Lk * D);
          sum_parts(dvp.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), b, gh, Hkv, parts, Lk * Dv);
        });
    // d carry0 = the column sums of dF over every block
    scalar_t* dc = dcarry.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t qb = 0; qb < nqb; ++qb) {
        const scalar_t* row = g + (b * nqb + qb) * Lk;
        for (int64_t j = 0; j < Lk; ++j) dc[b * Lk + j] += row[j];
      }
  });
  return {dq, dk, dv, dcarry};
}

}  // namespace

// the ops' namespace: HF_ATTNORM_NATIVE_NS, this family's own (kernels/native.py)
HF_TORCH_LIBRARY(HF_ATTNORM_NATIVE_NS, m) {
  m.def("blas_available() -> bool", &blas_available);
  m.def(
      "sel_forward(Tensor q, Tensor k, Tensor v, Tensor? keep, bool causal, int head, float scale, Tensor starts, "
      "Tensor selrow, "
      "Tensor? carry0, int block_q, int block_k) -> Tensor[]");
  m.def(
      "sel_backward(Tensor q, Tensor k, Tensor v, Tensor? keep, bool causal, int head, float scale, Tensor starts, "
      "Tensor selrow, "
      "Tensor? carry0, Tensor colsums, Tensor out, Tensor lse, Tensor dout, int block_q, int block_k) -> Tensor[]");
}

HF_TORCH_LIBRARY_IMPL(HF_ATTNORM_NATIVE_NS, CPU, m) {
  m.impl("sel_forward", &sel_forward);
  m.impl("sel_backward", &sel_backward);
}
