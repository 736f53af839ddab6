// Shared by the C++ CPU kernels (fused_cpu.cpp, stickbreaking_cpu.cpp, selective_cpu.cpp; one extension per family,
// kernels/native.py): the BLAS entry points and row-major matmul wrappers, an exp that GCC vectorises, and the
// q/k/v/keep binding of a problem struct. Everything is in an anonymous namespace, so each translation unit gets its
// own inlined copy.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

namespace {

// The Fortran BLAS that libtorch_cpu links (MKL in the x86 wheels) exports sgemm_/dgemm_; ATen's own
// cpublas::gemm overloads are not exported to extensions. Weak references: a torch build without them makes
// blas_available() false and the Python side falls back to the pure-PyTorch path.
extern "C" {
__attribute__((weak)) void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
                                  const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                                  const float* beta, float* c, const int* ldc);
__attribute__((weak)) void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
                                  const double* alpha, const double* a, const int* lda, const double* b,
                                  const int* ldb, const double* beta, double* c, const int* ldc);
}

// whether the BLAS entry points resolved (each extension registers it as its op blas_available)
inline bool blas_available() { return sgemm_ != nullptr && dgemm_ != nullptr; }

// column-major C = op(A) op(B) + beta C, as BLAS
inline void blas_gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                      int64_t ldb, float beta, float* c, int64_t ldc) {
  const int im = m, in = n, ik = k, ila = lda, ilb = ldb, ilc = ldc;
  const float one = 1.0f;
  sgemm_(&ta, &tb, &im, &in, &ik, &one, a, &ila, b, &ilb, &beta, c, &ilc);
}
inline void blas_gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, const double* a, int64_t lda,
                      const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  const int im = m, in = n, ik = k, ila = lda, ilb = ldb, ilc = ldc;
  const double one = 1.0;
  dgemm_(&ta, &tb, &im, &in, &ik, &one, a, &ila, b, &ilb, &beta, c, &ilc);
}

// row-major wrappers. C[m][n] = A[m][k] B[n][k]^T + beta C
template <typename T>
inline void mm_abt(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
                   int64_t ldc) {
  blas_gemm('T', 'N', n, m, k, b, ldb, a, lda, beta, c, ldc);
}
// C[m][n] = A[m][k] B[k][n] + beta C
template <typename T>
inline void mm_ab(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
                  int64_t ldc) {
  blas_gemm('N', 'N', n, m, k, b, ldb, a, lda, beta, c, ldc);
}
// C[m][n] = A[k][m]^T B[k][n] + beta C
template <typename T>
inline void mm_atb(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
                   int64_t ldc) {
  blas_gemm('N', 'T', n, m, k, b, ldb, a, lda, beta, c, ldc);
}

// exp that GCC vectorises (Cephes expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp); clamped so that very
// negative arguments give 0 and large ones stay finite. Forced inline: an out-of-line call in a scan loop stops its
// vectorisation (measured 5x slower in stickbreaking.cpp).
inline __attribute__((always_inline)) float vexp(float x) {
  x = std::min(std::max(x, -88.0f), 88.0f);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  // 2^n from the exponent bits (a bit cast, not memcpy, so that loops calling vexp vectorise)
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return x <= -88.0f ? 0.0f : p * scale;
}
inline __attribute__((always_inline)) double vexp(double x) { return std::exp(x); }

// Fills the fields a scan kernel's problem struct P shares (B, H, Lq, D, Hkv, Lk, Dv, G; q, k, v and the k/v strides;
// keep and its strides) from q [B, H, Lq, D] (contiguous), k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (last dims
// contiguous) and keep, bool [B, H, Lq, Lk] with a contiguous last dim; ``who`` names the kernel in the errors.
template <typename T, typename P>
void bind_qkv(P& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const std::optional<at::Tensor>& keep, const char* who) {
  p.B = q.size(0);
  p.H = q.size(1);
  p.Lq = q.size(2);
  p.D = q.size(3);
  p.Hkv = k.size(1);
  p.Lk = k.size(2);
  p.Dv = v.size(3);
  TORCH_CHECK(p.Hkv > 0 && p.H % p.Hkv == 0 && k.size(0) == p.B && v.size(0) == p.B && k.size(3) == p.D &&
                  v.size(2) == p.Lk && v.size(1) == p.Hkv,
              who, ": incompatible q, k, v shapes");
  TORCH_CHECK(q.is_contiguous() && k.stride(3) == 1 && v.stride(3) == 1,
              who, ": q must be contiguous, k and v contiguous in their last dim");
  p.G = p.H / p.Hkv;
  p.q = q.data_ptr<T>();
  p.k = k.data_ptr<T>();
  p.v = v.data_ptr<T>();
  p.ksb = k.stride(0);
  p.ksh = k.stride(1);
  p.ksl = k.stride(2);
  p.vsb = v.stride(0);
  p.vsh = v.stride(1);
  p.vsl = v.stride(2);
  p.keep = nullptr;
  p.msb = p.msh = p.msl = 0;
  if (keep.has_value()) {
    TORCH_CHECK(keep->dim() == 4 && keep->size(0) == p.B && keep->size(1) == p.H && keep->size(2) == p.Lq &&
                    keep->size(3) == p.Lk && keep->stride(3) == 1 && keep->scalar_type() == at::kBool,
                who, ": keep must be bool [B, H, Lq, Lk] with a contiguous last dim");
    p.keep = keep->data_ptr<bool>();
    p.msb = keep->stride(0);
    p.msh = keep->stride(1);
    p.msl = keep->stride(2);
  }
}

}  // namespace

// The namespace of an extension's ops: -DHF_ATTNORM_NATIVE_NS=<namespace> (kernels/native.py gives each family its
// own, and a build of another map table another), expanded before TORCH_LIBRARY pastes it into names.
#ifndef HF_ATTNORM_NATIVE_NS
#error "compile with -DHF_ATTNORM_NATIVE_NS=<namespace> (kernels/native.py does)"
#endif
#define HF_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define HF_TORCH_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
