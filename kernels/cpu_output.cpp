// q8_linear, the CPU output layer's kernel (kernels/cpu_native.py; it calls
// cpu_native.cpp's lowbit_all and round_rows, and hsum, from cpu_kernels.h): y = x @ W.T in float32 for grouped int8 weights, W = c * d (+ m): codes
// c int8 [N, K], scales d (and mins m) float32 [N, K / G]. The twin is kernels.reference.quant_linear_ref with float32
// activations: a float32 matmul over the dequantized weight up to summation order. With AVX2, FMA and F16C each row
// of x runs through lowbit_all twice (rounded to int16, then what that rounding left, rounded again): x is then held
// to about 2^-32 of each block's largest value, finer than float32's own rounding of the products, and each weight
// row is read once for both. Elsewhere (and for rows over 32,768 values) the codes are converted to floats.
#include "cpu_kernels.h"

namespace ninfer {

#if defined(__AVX2__) && defined(__FMA__)
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

#ifdef NINFER_AVX2_F16C
// y [M, N] = x @ W.T for int8 codes with float32 scales (and mins), each row of x as two rows of lowbit_all: its
// rounding to int16 and the rounding of what that left (its block sums set to zero, so the mins meet x's sums once)
void twice_rounded_into(const float* x, int64_t M, int64_t K, const at::Tensor& codes, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, float* yp) {
  const int64_t N = codes.size(0), G = K / scales.size(1), B = K / QB;
  thread_local Rows once, xr;
  thread_local std::vector<float> both, y2;
  round_rows(x, M, K, false, once);
  both.resize(2 * M * K);
  for (int64_t i = 0; i < M; ++i) {
    float *hi = both.data() + 2 * i * K, *lo = hi + K;
    for (int64_t k = 0; k < K; ++k) {
      hi[k] = x[i * K + k];
      lo[k] = x[i * K + k] - static_cast<float>(once.q[i * K + k]) * once.dx[i * B + k / QB];
    }
  }
  round_rows(both.data(), 2 * M, K, false, xr, gemv_level() > 0);
  for (int64_t i = 0; i < M; ++i) std::fill_n(xr.sx.data() + (2 * i + 1) * B, B, 0.f);
  y2.resize(2 * M * N);
  const float* mp = mins ? mins->data_ptr<float>() : nullptr;
  lowbit_all<false>(xr, 2 * M, K, N, G, static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(), mp,
                    false, y2.data());
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) yp[i * N + n] = y2[2 * i * N + n] + y2[(2 * i + 1) * N + n];
}
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
#ifdef NINFER_AVX2_F16C
  if (K <= QB * MAX_BLOCKS) {
    twice_rounded_into(x.data_ptr<float>(), M, K, codes, scales, mins, y.data_ptr<float>());
    return y;
  }
#endif
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

}  // namespace ninfer

TORCH_LIBRARY_FRAGMENT(ninfer_cpu, m) {
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins) -> Tensor");
  m.impl("q8_linear", c10::DispatchKey::CPU, &ninfer::q8_linear);
}
