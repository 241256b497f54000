// dense_linear: y = x @ W.T (+ bias) for a few float32 rows of x and a float32 weight W [N, K] (kernels/cpu_native.py;
// hsum from cpu_kernels.h). Memory-bound decode GEMVs: each weight row is read
// once for up to four rows of x, the threads share the weight rows in contiguous runs. ATen's float32 GEMV reads a
// 512-wide layer at about half the bandwidth this reaches on two AVX2 cores (docs/KERNELS.md). Summation order only
// differs from a float32 matmul: eight lanes a row, four accumulators each in K order, then the lanes added.
#include "cpu_kernels.h"

namespace ninfer {

#if defined(__AVX2__) && defined(__FMA__)
// R rows of x against W rows w0..w0 + WR - 1 (K % 8 == 0): WR * R accumulators
template <int R, int WR>
inline void dense_rows(const float* x, int64_t K, const float* w, float* y, int64_t y_stride) {
  __m256 acc[R][WR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < WR; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[WR];
    for (int j = 0; j < WR; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int j = 0; j < WR; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < WR; ++j) y[r * y_stride + j] = hsum(acc[r][j]);
}
#endif

// rows [n0, n1) of y = x @ W.T for M rows of x, y row stride N
void dense_span(const float* x, int64_t M, int64_t K, const float* w, int64_t N, int64_t n0, int64_t n1, float* y) {
#if defined(__AVX2__) && defined(__FMA__)
  if (K % 8 == 0) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) {
      int64_t n = n0;
      for (; n + 2 <= n1; n += 2) dense_rows<4, 2>(x + r * K, K, w + n * K, y + r * N + n, N);
      for (; n < n1; ++n) dense_rows<4, 1>(x + r * K, K, w + n * K, y + r * N + n, N);
    }
    for (; r < M; ++r) {
      int64_t n = n0;
      for (; n + 4 <= n1; n += 4) dense_rows<1, 4>(x + r * K, K, w + n * K, y + r * N + n, N);
      for (; n < n1; ++n) dense_rows<1, 1>(x + r * K, K, w + n * K, y + r * N + n, N);
    }
    return;
  }
#endif
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = n0; n < n1; ++n) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * w[n * K + k];
      y[r * N + n] = s;
    }
}

// y [M, N] = x [M, K] @ W.T (+ bias [N]), the weight rows split between the threads
void dense_into(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    dense_span(x, M, K, w, N, n0, n1, y);
    if (bias)
      for (int64_t r = 0; r < M; ++r)
        for (int64_t n = n0; n < n1; ++n) y[r * N + n] += bias[n];
  });
}

at::Tensor dense_linear(const at::Tensor& x_, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "dense_linear: x must be float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x_.size(1),
              "dense_linear: the weight must be contiguous float32 [N, K]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0)),
              "dense_linear: a bias must be float32 [N]");
  const auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  dense_into(x.data_ptr<float>(), M, K, w.data_ptr<float>(), N, bias ? bias->data_ptr<float>() : nullptr,
             y.data_ptr<float>());
  return y;
}

}  // namespace ninfer

TORCH_LIBRARY_FRAGMENT(ninfer_cpu, m) {
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("dense_linear", c10::DispatchKey::CPU, &ninfer::dense_linear);
}
