// CPU kernels built for the machine they run on (kernels/cpu_native.py): the low-bit GEMV/GEMM, the dequantization
// of the dense prompt path and RMSNorm; the other units (cpu_kernels.h declares what they share) call them.
//
// lowbit_linear: y = x @ W.T for 4-bit (uint8 [N, K / 2], element 2j in the low nibble of byte j, 2j+1 in the high)
// or grouped int8 codes (int8 [N, K]), W = c * d + m (4-bit symmetric: (c - 8) * d), scales and mins float32 or
// float16 [N, K / G]. The activations are rounded to int16 per block of 32 (kernels.reference.int16_rows: about 4,000
// times finer than the block's largest value, 256 times finer than bfloat16 there) and multiplied as integers, 16
// products an instruction; the mins meet the block sums of x in float32. Twin: reference.lowbit_linear_ref.
#include "cpu_kernels.h"

namespace ninfer {

// ---------------------------------------------------------------------------------------------------- lowbit_linear
constexpr int64_t PREFETCH = 4;  // weight rows read ahead
constexpr int64_t M_BLOCK = 64;  // rows of x a pass over the weight rows takes (32-wide groups)

// interleaved (4-bit codes): a block's rounded values are stored evens first, then odds, the order its nibbles unpack in
// wide: a pair of blocks holds [first half of block 2p, of 2p + 1, second half of 2p, of 2p + 1] (halves: evens and
// odds when interleaved, else values 0-15 and 16-31); a row's last block, when its count is odd, [first, second half]
namespace {

// one block's largest magnitude and sum, and its values times inv rounded to nearest (ties to even), clamped to
// +-32767, in their own order
#ifdef NINFER_AVX2_F16C
inline float block_stats(const float* xb, float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 a0 = _mm256_loadu_ps(xb), a1 = _mm256_loadu_ps(xb + 8), a2 = _mm256_loadu_ps(xb + 16),
               a3 = _mm256_loadu_ps(xb + 24);
  __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                            _mm256_max_ps(_mm256_andnot_ps(sign, a2), _mm256_andnot_ps(sign, a3)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return _mm_cvtss_f32(m);
}

inline void block_round(const float* xb, float inv, int16_t* v) {
  const __m256 iv = _mm256_set1_ps(inv);
  const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
  for (int h = 0; h < QB; h += 16) {
    auto q = [&](int o) {
      const __m256i t = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + h + o), iv));
      return _mm256_min_epi32(hi, _mm256_max_epi32(lo, t));
    };
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(q(0), q(8)), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + h), p);
  }
}
#else
inline float block_stats(const float* xb, float& sum) {
  float amax = 0.f, s = 0.f;
  for (int j = 0; j < QB; ++j) amax = std::max(amax, std::abs(xb[j])), s += xb[j];
  sum = s;
  return amax;
}

inline void block_round(const float* xb, float inv, int16_t* v) {
  for (int j = 0; j < QB; ++j)
    v[j] = static_cast<int16_t>(std::min(32767.f, std::max(-32767.f, std::nearbyint(xb[j] * inv))));
}
#endif

}  // namespace

void round_rows(const float* x, int64_t M, int64_t K, bool interleaved, Rows& r, bool wide) {
  const int64_t B = K / QB, blocks = M * B;
  r.q.resize(M * K);
  r.dx.resize(blocks);
  r.sx.resize(blocks);
  r.wide = wide;
  int16_t v[QB];
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + i * QB;
    const float amax = block_stats(xb, r.sx[i]);
    r.dx[i] = amax / 32767.f;
    block_round(xb, amax > 0.f ? 32767.f / amax : 0.f, v);
    const int64_t o = (i % B) & 1;  // wide: the second block of its pair
    const bool pair = wide && !((B & 1) && i % B == B - 1);
    int16_t* qb = r.q.data() + (pair ? (i - o) * QB + o * (QB / 2) : i * QB);
    const int64_t stride = pair ? QB : QB / 2;  // from a block's first half to its second
    if (interleaved) {
      for (int j = 0; j < QB / 2; ++j) qb[j] = v[2 * j], qb[stride + j] = v[2 * j + 1];
    } else {
      std::copy(v, v + QB / 2, qb);
      std::copy(v + QB / 2, v + QB, qb + stride);
    }
  }
}

template <typename S>
inline float as_float(S v) { return static_cast<float>(v); }
#if defined(__F16C__)
template <>
inline float as_float(at::Half v) { return _cvtsh_ss(v.x); }
#endif

// a weight row's scales and mins (or, sym, -8 times the scales) spread to one per block of QB, as float32
template <typename S>
void block_table(const S* d, const S* m, bool sym, int64_t groups, int64_t per, float* ds, float* ms) {
  int64_t g = 0;
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (std::is_same_v<S, at::Half>) {
    for (; per == 1 && g + 8 <= groups; g += 8) {  // groups of QB (GGUF's 4-bit blocks): 8 scales at a time
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g)));
      _mm256_storeu_ps(ds + g, dv);
      if (sym) _mm256_storeu_ps(ms + g, _mm256_mul_ps(dv, _mm256_set1_ps(-8.f)));
      else if (m) _mm256_storeu_ps(ms + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g))));
    }
  }
#endif
  for (; g < groups; ++g) {
    const float dg = as_float(d[g]), mg = sym ? -8.f * dg : m ? as_float(m[g]) : 0.f;
    for (int64_t j = g * per; j < (g + 1) * per; ++j) ds[j] = dg, ms[j] = mg;
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
// half `h` of a block's codes as 16 int16: the evens (h = 0) or odds (1) of 4-bit codes, the first or second 16 of int8
template <bool FOUR>
inline __m256i codes16(const uint8_t* c, int h) {
  if (FOUR) {
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    return _mm256_cvtepu8_epi16(_mm_and_si128(h ? _mm_srli_epi16(p, 4) : p, _mm_set1_epi8(0x0F)));
  }
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c) + h));
}

// both halves of a block's codes: for 4-bit codes one widening of the 16 bytes, then the low nibbles (the evens)
// and the high ones (the odds), as codes16 gives them with one shuffle fewer
template <bool FOUR>
inline void codes16x2(const uint8_t* c, __m256i& w0, __m256i& w1) {
  if (FOUR) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    w0 = _mm256_and_si256(b, _mm256_set1_epi16(0x0F));
    w1 = _mm256_srli_epi16(b, 4);
  } else {
    w0 = codes16<false>(c, 0);
    w1 = codes16<false>(c, 1);
  }
}

// one block's 32 integer products, summed in 8 int32 lanes and converted to float
inline __m256 block_dot(__m256i w0, __m256i w1, const int16_t* q) {
  const __m256i* p = reinterpret_cast<const __m256i*>(q);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(p)),
                                             _mm256_madd_epi16(w1, _mm256_loadu_si256(p + 1))));
}
#endif

// R rows of x (rounded) against one weight row: codes c, scales d and mins m (or, sym, -8 d) of that row
template <int R, bool FOUR, typename S>
void lowbit_rows(const Rows& xr, int64_t row0, int64_t K, int64_t G, const uint8_t* c, const S* d, const S* m,
                 bool sym, float* out, int64_t out_stride) {
  const int64_t B = K / QB, per = G / QB, bytes = FOUR ? QB / 2 : QB;
  float ds[MAX_BLOCKS], ms[MAX_BLOCKS];  // the row's scale and min of each block, as float32
  block_table(d, m, sym, K / G, per, ds, ms);
  float acc[R];
#if defined(__AVX2__) && defined(__FMA__)
  __m256 v0[R], v1[R];  // two accumulators a row (even and odd blocks), kept in registers
  for (int r = 0; r < R; ++r) v0[r] = v1[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= B; b += 2) {
    __m256i w0, w1;
    codes16x2<FOUR>(c + b * bytes, w0, w1);
    __m256i u0, u1;
    codes16x2<FOUR>(c + (b + 1) * bytes, u0, u1);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * B + b;
      v0[r] = _mm256_fmadd_ps(block_dot(w0, w1, xr.q.data() + i * QB), _mm256_set1_ps(ds[b] * xr.dx[i]), v0[r]);
      v1[r] = _mm256_fmadd_ps(block_dot(u0, u1, xr.q.data() + (i + 1) * QB), _mm256_set1_ps(ds[b + 1] * xr.dx[i + 1]),
                              v1[r]);
    }
  }
  if (b < B) {
    __m256i w0, w1;
    codes16x2<FOUR>(c + b * bytes, w0, w1);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * B + b;
      v0[r] = _mm256_fmadd_ps(block_dot(w0, w1, xr.q.data() + i * QB), _mm256_set1_ps(ds[b] * xr.dx[i]), v0[r]);
    }
  }
  for (int r = 0; r < R; ++r) acc[r] = hsum(_mm256_add_ps(v0[r], v1[r]));
#else
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < B; ++b) {
    const float dg = ds[b];
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * B + b;
      const int16_t* q = xr.q.data() + i * QB;
      int32_t s = 0;
      for (int j = 0; j < QB; ++j) {
        const int w = FOUR ? (j < QB / 2 ? c[b * bytes + j] & 15 : c[b * bytes + j - QB / 2] >> 4)
                           : static_cast<int8_t>(c[b * bytes + j]);
        s += w * q[j];
      }
      acc[r] += static_cast<float>(s) * (dg * xr.dx[i]);
    }
  }
#endif
  if (m != nullptr || sym)
    for (int r = 0; r < R; ++r) acc[r] += dot(ms, xr.sx.data() + (row0 + r) * B, B);
  for (int r = 0; r < R; ++r) out[r * out_stride] = acc[r];
}

#ifdef NINFER_AVX2_F16C
template <typename S>
inline __m256 load8(const S* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
template <>
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// R rows of x (rounded: q, per block the step dx and the sum sx; rows K, B and B apart) against a weight row whose
// groups are the blocks (G == QB: GGUF's Q4_0/Q4_1/Q8_0). Scales and mins are read 8 blocks at a time; each block's
// codes are widened once for the R rows; a row's arithmetic is the same for every R (two accumulators, even and odd
// blocks, the mins' products folded into the first), so a row's result never depends on the rows beside it
template <int R, bool FOUR, typename S>
void lowbit_rows_g32(const int16_t* q, const float* dx, const float* sx, int64_t K, int64_t B, const uint8_t* c,
                     const S* d, const S* m, bool sym, float* out, int64_t out_stride) {
  constexpr int64_t bytes = FOUR ? QB / 2 : QB;
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= B; b += 8) {
    const __m256 dv = load8(d + b);
    const __m256 mv = m ? load8(m + b) : sym ? _mm256_mul_ps(dv, _mm256_set1_ps(-8.f)) : _mm256_setzero_ps();
    __m256 f[R];
    for (int r = 0; r < R; ++r) {
      f[r] = _mm256_mul_ps(dv, _mm256_loadu_ps(dx + r * B + b));
      if (m || sym) acc0[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx + r * B + b), acc0[r]);
    }
    for (int j = 0; j < 8; j += 2) {
      const uint8_t* cb = c + (b + j) * bytes;
      __m256i w0, w1;
      codes16x2<FOUR>(cb, w0, w1);
      __m256i u0, u1;
      codes16x2<FOUR>(cb + bytes, u0, u1);
      const __m256i lane = _mm256_set1_epi32(j), next = _mm256_set1_epi32(j + 1);
      for (int r = 0; r < R; ++r) {
        const int16_t* qb = q + r * K + (b + j) * QB;
        acc0[r] = _mm256_fmadd_ps(block_dot(w0, w1, qb), _mm256_permutevar8x32_ps(f[r], lane), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(block_dot(u0, u1, qb + QB), _mm256_permutevar8x32_ps(f[r], next), acc1[r]);
      }
    }
  }
  float tail[R] = {};
  for (; b < B; ++b) {
    const float dg = as_float(d[b]), mg = sym ? -8.f * dg : m ? as_float(m[b]) : 0.f;
    const uint8_t* cb = c + b * bytes;
    __m256i w0, w1;
    codes16x2<FOUR>(cb, w0, w1);
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm256_fmadd_ps(block_dot(w0, w1, q + r * K + b * QB), _mm256_set1_ps(dg * dx[r * B + b]), acc0[r]);
      tail[r] += mg * sx[r * B + b];
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + tail[r];
}
#endif

// weight rows n0 .. n1 of y [M, N] = rows xr @ W.T (lowbit_all's work, split by the caller among its threads)
template <bool FOUR, typename S>
void lowbit_span(const Rows& xr, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* cp, const S* dp,
                 const S* mp, bool sym, float* yp, int64_t n0, int64_t n1) {
  const int64_t groups = K / G, row_bytes = FOUR ? K / 2 : K;
  // rows of x in blocks of M_BLOCK (their int16 values stay in L2) when the groups are the blocks; else all at once
  const int64_t m_step = G == QB ? M_BLOCK : std::max<int64_t>(M, 1);
  for (int64_t r0 = 0; r0 < M; r0 += m_step) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* c = cp + n * row_bytes;
      const S *d = dp + n * groups, *m = mp ? mp + n * groups : nullptr;
#if defined(__AVX2__)
      if (n + PREFETCH < n1) {
        const char* f = reinterpret_cast<const char*>(cp + (n + PREFETCH) * row_bytes);
        for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(f + o, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(dp + (n + PREFETCH) * groups), _MM_HINT_T0);
        if (mp) _mm_prefetch(reinterpret_cast<const char*>(mp + (n + PREFETCH) * groups), _MM_HINT_T0);
      }
#endif
#ifdef NINFER_AVX512_VNNI
      if (xr.wide) {  // rounded for the 512-bit path (cpu_vnni.cpp)
        if (G == QB) {
          wide_row<FOUR, S>(xr, r0, std::min(M, r0 + m_step), K, N, c, d, m, sym, yp + n);
        } else {
          float ds[MAX_BLOCKS], ms[MAX_BLOCKS];
          block_table(d, m, sym, groups, G / QB, ds, ms);
          wide_row<FOUR, float>(xr, r0, std::min(M, r0 + m_step), K, N, c, ds, m || sym ? ms : nullptr, false, yp + n);
        }
        continue;
      }
#endif
#ifdef NINFER_AVX2_F16C
      if (G == QB) {
        const int64_t B = K / QB, r1 = std::min(M, r0 + M_BLOCK);
        int64_t r = r0;
        for (; r + ROWS <= r1; r += ROWS)
          lowbit_rows_g32<ROWS, FOUR, S>(xr.q.data() + r * K, xr.dx.data() + r * B, xr.sx.data() + r * B, K, B, c, d,
                                         m, sym, yp + r * N + n, N);
        for (; r + 2 <= r1; r += 2)
          lowbit_rows_g32<2, FOUR, S>(xr.q.data() + r * K, xr.dx.data() + r * B, xr.sx.data() + r * B, K, B, c, d, m,
                                      sym, yp + r * N + n, N);
        for (; r < r1; ++r)
          lowbit_rows_g32<1, FOUR, S>(xr.q.data() + r * K, xr.dx.data() + r * B, xr.sx.data() + r * B, K, B, c, d, m,
                                      sym, yp + r * N + n, N);
        continue;
      }
#endif
      int64_t r = 0;
      for (; r + ROWS <= M; r += ROWS) lowbit_rows<ROWS, FOUR, S>(xr, r, K, G, c, d, m, sym, yp + r * N + n, N);
      for (; r < M; ++r) lowbit_rows<1, FOUR, S>(xr, r, K, G, c, d, m, sym, yp + r * N + n, N);
    }
  }
}

template void lowbit_span<true, float>(const Rows&, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                                       const float*, bool, float*, int64_t, int64_t);
template void lowbit_span<true, at::Half>(const Rows&, int64_t, int64_t, int64_t, int64_t, const uint8_t*,
                                          const at::Half*, const at::Half*, bool, float*, int64_t, int64_t);
template void lowbit_span<false, float>(const Rows&, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                                        const float*, bool, float*, int64_t, int64_t);
template void lowbit_span<false, at::Half>(const Rows&, int64_t, int64_t, int64_t, int64_t, const uint8_t*,
                                           const at::Half*, const at::Half*, bool, float*, int64_t, int64_t);

template <bool FOUR, typename S>
void lowbit_all(const Rows& xr, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* cp, const S* dp,
                const S* mp, bool sym, float* yp) {
  auto run = [&](int64_t n0, int64_t n1) { lowbit_span<FOUR, S>(xr, M, K, N, G, cp, dp, mp, sym, yp, n0, n1); };
  if (!gemv_dynamic()) {
    at::parallel_for(0, N, 16, run);  // one contiguous share per thread
    return;
  }
  // the weight rows in chunks the threads take in turn: a thread the OS holds back (another process on its core)
  // leaves its rows to the others instead of making them wait for it at the end
  const int64_t T = at::get_num_threads(), chunk = std::max<int64_t>(16, N / (8 * T));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, T, 1, [&](int64_t, int64_t) {
    for (int64_t n0 = next.fetch_add(chunk); n0 < N; n0 = next.fetch_add(chunk)) run(n0, std::min(N, n0 + chunk));
  });
}

// cpu_output.cpp's q8_linear runs int8 codes with float32 scales through it
template void lowbit_all<false, float>(const Rows& xr, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* cp,
                                       const float* dp, const float* mp, bool sym, float* yp);

// the checks of lowbit_linear's weight operands against rows of length K
void check_lowbit(int64_t K, const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                  bool sym) {
  const bool four = codes.scalar_type() == at::kByte;
  TORCH_CHECK(codes.dim() == 2 && (four || codes.scalar_type() == at::kChar) && codes.is_contiguous(),
              "lowbit_linear: codes must be contiguous uint8 (4-bit pairs) or int8 [N, K]");
  TORCH_CHECK(codes.size(1) * (four ? 2 : 1) == K && scales.dim() == 2 && scales.size(0) == codes.size(0) &&
              scales.size(1) > 0 && K % scales.size(1) == 0, "lowbit_linear: shapes of x, codes and scales disagree");
  TORCH_CHECK((K / scales.size(1)) % QB == 0, "lowbit_linear: the group size must be a multiple of ", QB);
  TORCH_CHECK(K <= QB * MAX_BLOCKS, "lowbit_linear: rows longer than ", QB * MAX_BLOCKS, " values are not taken");
  const auto st = scales.scalar_type();
  TORCH_CHECK((st == at::kFloat || st == at::kHalf) && scales.is_contiguous(),
              "lowbit_linear: scales must be contiguous float32 or float16");
  TORCH_CHECK(!mins || (mins->sizes() == scales.sizes() && mins->scalar_type() == st && mins->is_contiguous()),
              "lowbit_linear: mins must be like the scales");
  TORCH_CHECK(!(sym && mins), "lowbit_linear: symmetric 4-bit codes take no mins");
}

// y [M, N] = x [M, K] @ W.T for checked operands (check_lowbit), into y
void lowbit_into(const float* x, int64_t M, int64_t K, const at::Tensor& codes, const at::Tensor& scales,
                 const std::optional<at::Tensor>& mins, bool sym, float* yp) {
  const bool four = codes.scalar_type() == at::kByte;
  const int64_t N = codes.size(0), G = K / scales.size(1);
  thread_local Rows xr;
  round_rows(x, M, K, four, xr, gemv_level() > 0);
  const auto* cp = static_cast<const uint8_t*>(codes.data_ptr());
  if (scales.scalar_type() == at::kFloat) {
    const float *dp = scales.data_ptr<float>(), *mp = mins ? mins->data_ptr<float>() : nullptr;
    four ? lowbit_all<true>(xr, M, K, N, G, cp, dp, mp, sym, yp) : lowbit_all<false>(xr, M, K, N, G, cp, dp, mp, sym, yp);
  } else {
    const at::Half *dp = scales.data_ptr<at::Half>(), *mp = mins ? mins->data_ptr<at::Half>() : nullptr;
    four ? lowbit_all<true>(xr, M, K, N, G, cp, dp, mp, sym, yp) : lowbit_all<false>(xr, M, K, N, G, cp, dp, mp, sym, yp);
  }
}

at::Tensor lowbit_linear(const at::Tensor& x_, const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, bool sym) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "lowbit_linear: x must be float32 [M, K]");
  const auto x = x_.contiguous();
  check_lowbit(x.size(1), codes, scales, mins, sym);
  auto y = at::empty({x.size(0), codes.size(0)}, x.options());
  lowbit_into(x.data_ptr<float>(), x.size(0), x.size(1), codes, scales, mins, sym, y.data_ptr<float>());
  return y;
}

// ---------------------------------------------------------------------------------------------------- dequantize_into
// out [N, K] float32 = the weight lowbit_linear reads (codes, scales, mins as check_lowbit takes them), with
// kernels.quant.dequantize's float32 operations in its order: (c - offset) * d, then + m, each rounded (never fused
// into one multiply-add: the dense prompt path must see exactly the weight the file gives); or bfloat16 [N, K], those
// float32 values rounded as torch rounds them (to nearest, ties to even), in the same pass
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__AVX2__)
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// 8 floats rounded to bfloat16 to nearest, ties to even (as torch's float -> bfloat16; weights hold no NaN)
inline void store8(at::BFloat16* p, __m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// columns k0 .. k1 (one group, 32 a step) of a row of codes as bfloat16 in `out`, 32 values an instruction: with
// float16 scales and mins every value is zero or a normal float32 (a multiple of 2^-24), which vcvtne2ps2bf16 rounds
// as torch does (to nearest, ties to even; it would flush subnormals, of which there are none)
inline void dequant32_bf16(const uint8_t* row, bool four, float d, float m, bool has_m, float offset, int64_t k0,
                           int64_t k1, at::BFloat16* out) {
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m), off = _mm512_set1_ps(offset);
  for (int64_t k = k0; k < k1; k += 32) {
    __m512i lo, hi;  // codes k .. k + 15 and k + 16 .. k + 31 as int32
    if (four) {
      const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)), mask = _mm_set1_epi8(0x0F);
      const __m128i l = _mm_and_si128(p, mask), h = _mm_and_si128(_mm_srli_epi16(p, 4), mask);
      lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(l, h)), hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(l, h));
    } else {
      lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
      hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16)));
    }
    __m512 a = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(lo), off), dv);
    __m512 b = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(hi), off), dv);
    if (has_m) a = _mm512_add_ps(a, mv), b = _mm512_add_ps(b, mv);
    _mm512_storeu_si512(out + k, (__m512i)_mm512_cvtne2ps_pbh(b, a));  // b's values to the upper half
  }
}
#endif

template <typename S, typename O>
void dequant_rows(const uint8_t* cp, const S* dp, const S* mp, bool four, bool sym, int64_t K, int64_t G, int64_t n0,
                  int64_t n1, O* out) {
#pragma STDC FP_CONTRACT OFF
  const int64_t groups = K / G, row_bytes = four ? K / 2 : K;
  const float offset = sym ? 8.f : 0.f;
  std::vector<float> c(G);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = cp + n * row_bytes;
    for (int64_t g = 0; g < groups; ++g) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if constexpr (std::is_same_v<S, at::Half> && std::is_same_v<O, at::BFloat16>) {
        dequant32_bf16(row, four, as_float(dp[n * groups + g]), mp ? as_float(mp[n * groups + g]) : 0.f, mp != nullptr,
                       offset, g * G, (g + 1) * G, out + n * K);
        continue;
      }
#endif
#if defined(__AVX2__)
      const __m256 dv = _mm256_set1_ps(as_float(dp[n * groups + g])), off = _mm256_set1_ps(offset);
      const __m256 mv = _mm256_set1_ps(mp ? as_float(mp[n * groups + g]) : 0.f);
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        __m128i e[2];  // the 32 codes in order, as bytes
        if (four) {
          const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)), mask = _mm_set1_epi8(0x0F);
          const __m128i lo = _mm_and_si128(p, mask), hi = _mm_and_si128(_mm_srli_epi16(p, 4), mask);
          e[0] = _mm_unpacklo_epi8(lo, hi), e[1] = _mm_unpackhi_epi8(lo, hi);
        } else {
          e[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
          e[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16));
        }
        for (int i = 0; i < 4; ++i) {
          const __m128i b = i & 1 ? _mm_srli_si128(e[i / 2], 8) : e[i / 2];
          __m256 v = _mm256_cvtepi32_ps(four ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b));
          v = _mm256_mul_ps(_mm256_sub_ps(v, off), dv);
          if (mp) v = _mm256_add_ps(v, mv);
          store8(out + n * K + k + 8 * i, v);
        }
      }
      continue;
#endif
      for (int64_t j = 0; j < G; ++j) {
        const int64_t k = g * G + j;
        c[j] = four ? static_cast<float>((row[k / 2] >> (4 * (k & 1))) & 15) - offset
                    : static_cast<float>(static_cast<int8_t>(row[k]));
      }
      const float d = as_float(dp[n * groups + g]), m = mp ? as_float(mp[n * groups + g]) : 0.f;
      O* o = out + n * K + g * G;
      for (int64_t j = 0; j < G; ++j) {
        float v = c[j] * d;
        if (mp) v = v + m;
        o[j] = static_cast<O>(v);
      }
    }
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

at::Tensor dequantize_into(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                           bool sym, at::Tensor out) {
  const bool four = codes.scalar_type() == at::kByte;
  const int64_t N = codes.size(0), K = codes.size(1) * (four ? 2 : 1);
  check_lowbit(K, codes, scales, mins, sym);
  const auto ot = out.scalar_type();
  TORCH_CHECK((ot == at::kFloat || ot == at::kBFloat16) && out.is_contiguous() && out.dim() == 2 && out.size(0) == N &&
              out.size(1) == K, "dequantize_into: out must be contiguous float32 or bfloat16 [N, K]");
  const int64_t G = K / scales.size(1);
  const auto* cp = static_cast<const uint8_t*>(codes.data_ptr());
  auto rows = [&](auto* op) {
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      if (scales.scalar_type() == at::kFloat)
        dequant_rows(cp, scales.data_ptr<float>(), mins ? mins->data_ptr<float>() : nullptr, four, sym, K, G, n0, n1,
                     op);
      else
        dequant_rows(cp, scales.data_ptr<at::Half>(), mins ? mins->data_ptr<at::Half>() : nullptr, four, sym, K, G,
                     n0, n1, op);
    });
  };
  if (ot == at::kFloat)
    rows(out.data_ptr<float>());
  else
    rows(out.data_ptr<at::BFloat16>());
  return out;
}

// y = x * rsqrt(mean(x^2) + eps) * w for one row of D floats
void rms_row(const float* x, const float* w, int64_t D, float eps, float* y) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < D; ++i) s += x[i] * x[i];
  const float inv = 1.f / std::sqrt(s / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) y[i] = x[i] * inv * w[i];
}

// ---------------------------------------------------------------------------------------------------- rms_norm
// y = x * rsqrt(mean(x^2) + eps) * w over the last dim of float32 rows (one pass a row, the sum in float32 lanes);
// ATen's CPU kernel takes about 25 us for one 576-wide row, this about 1 us plus the call
at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w, double eps) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 1 &&
              x_.dim() >= 1 && x_.size(-1) == w.size(0), "rms_norm: float32 x [..., D] and weight [D]");
  const auto x = x_.contiguous();
  const auto wc = w.contiguous();
  const int64_t D = w.size(0), rows = D ? x.numel() / D : 0;
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) rms_row(xp + r * D, wp, D, static_cast<float>(eps), yp + r * D);
  return y;
}

}  // namespace ninfer

TORCH_LIBRARY(ninfer_cpu, m) {
  m.def("lowbit_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, bool sym) -> Tensor");
  m.impl("lowbit_linear", c10::DispatchKey::CPU, &ninfer::lowbit_linear);
  m.def("dequantize_into(Tensor codes, Tensor scales, Tensor? mins, bool sym, Tensor(a!) out) -> Tensor(a!)");
  m.impl("dequantize_into", c10::DispatchKey::CPU, &ninfer::dequantize_into);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &ninfer::rms_norm);
}
