// y = x @ W.T in float32 for grouped int8 weights, W = c * d (+ m): codes c int8 [N, K], scales d (and mins m)
// float32 [N, K / G]. Built for the machine it runs on (kernels/cpu_native.py); the twin is
// kernels.reference.quant_linear_ref with float32 activations. Only the summation order differs from a float32
// matmul over the dequantized weight.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ROWS = 4;  // rows of x that share one read of a weight row

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows of x against weight row c (G % 32 == 0): four independent accumulators per row, each code block of 32
// converted once to floats, dequantized (c * d + m) and multiplied into every row
template <int R>
void dot_rows(const float* x, int64_t K, int64_t G, const int8_t* c, const float* d, const float* m, float* out,
              int64_t out_stride) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / G; ++g) {
    const __m256 dg = _mm256_set1_ps(d[g]), mg = m ? _mm256_set1_ps(m[g]) : _mm256_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k));
      const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
      __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
                     _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                     _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
                     _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))};
      for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(w[i], dg, mg);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i)
          acc[r][i] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + r * K + k + 8 * i), acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r * out_stride] = hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                             _mm256_add_ps(acc[r][2], acc[r][3])));
}
constexpr int64_t BLOCK = 32;
#else
// any other CPU: plain loops the compiler vectorizes for it
template <int R>
void dot_rows(const float* x, int64_t K, int64_t G, const int8_t* c, const float* d, const float* m, float* out,
              int64_t out_stride) {
  float acc[R] = {};
  for (int64_t g = 0; g < K / G; ++g) {
    const float dg = d[g], mg = m ? m[g] : 0.f;
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * G;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < G; ++j) s += (float(c[g * G + j]) * dg + mg) * xg[j];
      acc[r] += s;
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = acc[r];
}
constexpr int64_t BLOCK = 1;
#endif

at::Tensor q8_linear(const at::Tensor& x_, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "q8_linear: x must be float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "q8_linear: codes must be contiguous int8 [N, K]");
  const auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && scales.dim() == 2 && scales.size(0) == N && K % scales.size(1) == 0,
              "q8_linear: shapes of x, codes and scales disagree");
  const int64_t G = K / scales.size(1);
  TORCH_CHECK(G % BLOCK == 0, "q8_linear: the group size must be a multiple of ", BLOCK);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "q8_linear: scales: float32");
  TORCH_CHECK(!mins || (mins->sizes() == scales.sizes() && mins->scalar_type() == at::kFloat &&
                        mins->is_contiguous()), "q8_linear: mins: float32 like the scales");
  auto y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *dp = scales.data_ptr<float>();
  const float* mp = mins ? mins->data_ptr<float>() : nullptr;
  const int8_t* cp = codes.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = K / G;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* c = cp + n * K;
      const float *d = dp + n * groups, *m = mp ? mp + n * groups : nullptr;
      int64_t r = 0;
      for (; r + ROWS <= M; r += ROWS) dot_rows<ROWS>(xp + r * K, K, G, c, d, m, yp + r * N + n, N);
      for (; r < M; ++r) dot_rows<1>(xp + r * K, K, G, c, d, m, yp + r * N + n, N);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(ninfer_cpu, m) {
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins) -> Tensor");
  m.impl("q8_linear", c10::DispatchKey::CPU, &q8_linear);
}
