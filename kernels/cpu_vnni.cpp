// The low-bit GEMV's 512-bit path, on a CPU with AVX-512 (F, BW, VL) and VNNI (kernels/cpu_native.py builds with
// -march=native, so a build made here has it and a build for a CPU without it has the AVX2 path alone), and the
// switches between the paths (gemv_isa) and between the threads' splits of the weight rows (gemv_split): benchmarks
// alternate them in one process.
//
// The same integer products as cpu_native.cpp's AVX2 path, 32 an instruction: the activations rounded to int16 per
// block of 32 (round_rows, the same values), the codes widened to int16, `vpdpwssd` summing pairs of products into
// int32 lanes. Two blocks share one 512-bit register: their codes are widened together (one load of 32 bytes for
// 4-bit codes: lanes 0-15 the first block's bytes, 16-31 the second's; masked, they are the two blocks' evens,
// shifted their odds), so the activations of a pair of blocks are stored in that order (round_rows with `wide`):
// [first half of block 2p, first half of 2p + 1, second half of 2p, second half of 2p + 1], halves being the evens
// and odds for 4-bit codes, elements 0-15 and 16-31 for int8. After the two `vpdpwssd`, lanes 0-7 hold block 2p's
// partial sums and 8-15 block 2p + 1's, converted to float32 and multiplied by each block's scale times its step.
// Only the float32 summation differs from the AVX2 path: each block's integer sum is the same.
#include <atomic>
#include <tuple>

#include "cpu_kernels.h"

namespace ninfer {

#ifdef NINFER_AVX512_VNNI
constexpr int WIDEST = 1;
#else
constexpr int WIDEST = 0;
#endif
static std::atomic<int> level{WIDEST};

static std::atomic<int> dynamic{1};

int gemv_level() { return level.load(std::memory_order_relaxed); }
int gemv_dynamic() { return dynamic.load(std::memory_order_relaxed); }

// sets how the threads split the weight rows (0: one contiguous share each, 1: chunks from a shared counter) and
// returns the split before; -1 asks
int64_t gemv_split(int64_t want) {
  if (want < 0) return gemv_dynamic();
  return dynamic.exchange(want ? 1 : 0);
}

// sets the code path (0: AVX2, 1: AVX-512 VNNI; clamped to what this build has) and returns the one before; -1 asks
int64_t gemv_isa(int64_t want) {
  if (want < 0) return gemv_level();
  return level.exchange(static_cast<int>(std::min<int64_t>(want, WIDEST)));
}

#ifdef NINFER_AVX512_VNNI
namespace {

template <typename S>
inline __m256 scales8(const S* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
template <>
inline __m256 scales8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <typename S>
inline float scale1(S v) { return static_cast<float>(v); }
template <>
inline float scale1(at::Half v) { return _cvtsh_ss(v.x); }

// a pair of blocks' codes (32 bytes of 4-bit codes, 64 of int8) as int16: lo meets the first halves, hi the second
template <bool FOUR>
inline void pair_codes(const uint8_t* c, __m512i& lo, __m512i& hi) {
  if (FOUR) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
    lo = _mm512_and_si512(w, _mm512_set1_epi16(0x0F));
    hi = _mm512_srli_epi16(w, 4);
  } else {
    const __m128i* p = reinterpret_cast<const __m128i*>(c);
    const __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(p)), _mm_loadu_si128(p + 2), 1);
    const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(p + 1)), _mm_loadu_si128(p + 3), 1);
    lo = _mm512_cvtepi8_epi16(a);
    hi = _mm512_cvtepi8_epi16(b);
  }
}

// one lone block (the last of a row with an odd count): its 32 products in 8 int32 lanes
template <bool FOUR>
inline __m256i lone_dot(const uint8_t* c, const int16_t* q) {
  __m256i lo, hi;
  if (FOUR) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    lo = _mm256_and_si256(w, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(w, 4);
  } else {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c) + 1));
  }
  const __m256i* p = reinterpret_cast<const __m256i*>(q);
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(p)), hi, _mm256_loadu_si256(p + 1));
}

inline __m512 pair_factor(float a, float b) {
  return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

}  // namespace

// R rows of x (rounded in the wide order: q, per block the step dx and the sum sx; rows K, B and B apart) against
// one weight row: codes c, per block scales d and mins m (null: none; sym: -8 d, 4-bit symmetric codes)
template <int R, bool FOUR, typename S>
void wide_rows(const int16_t* q, const float* dx, const float* sx, int64_t K, int64_t B, const uint8_t* c, const S* d,
               const S* m, bool sym, float* out, int64_t out_stride) {
  constexpr int64_t bytes = FOUR ? QB / 2 : QB;
  __m512 acc[R];
  __m256 side[R];  // the mins' products and the lone block's
  float tail[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), side[r] = _mm256_setzero_ps(), tail[r] = 0.f;
  int64_t b = 0;
  for (; b + 8 <= B; b += 8) {
    const __m256 dv = scales8(d + b);
    const __m256 mv = m ? scales8(m + b) : sym ? _mm256_mul_ps(dv, _mm256_set1_ps(-8.f)) : _mm256_setzero_ps();
    __m512 f[R];
    for (int r = 0; r < R; ++r) {
      f[r] = _mm512_castps256_ps512(_mm256_mul_ps(dv, _mm256_loadu_ps(dx + r * B + b)));
      if (m || sym) side[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx + r * B + b), side[r]);
    }
    for (int j = 0; j < 8; j += 2) {
      __m512i lo, hi;
      pair_codes<FOUR>(c + (b + j) * bytes, lo, hi);
      const __m512i pick = _mm512_inserti32x8(_mm512_set1_epi32(j), _mm256_set1_epi32(j + 1), 1);
      for (int r = 0; r < R; ++r) {
        const __m512i* p = reinterpret_cast<const __m512i*>(q + r * K + (b + j) * QB);
        const __m512i s = _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, _mm512_loadu_si512(p)), hi, _mm512_loadu_si512(p + 1));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(pick, f[r]), acc[r]);
      }
    }
  }
  for (; b + 2 <= B; b += 2) {
    __m512i lo, hi;
    pair_codes<FOUR>(c + b * bytes, lo, hi);
    const float d0 = scale1(d[b]), d1 = scale1(d[b + 1]);
    const float m0 = sym ? -8.f * d0 : m ? scale1(m[b]) : 0.f, m1 = sym ? -8.f * d1 : m ? scale1(m[b + 1]) : 0.f;
    for (int r = 0; r < R; ++r) {
      const __m512i* p = reinterpret_cast<const __m512i*>(q + r * K + b * QB);
      const __m512i s = _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, _mm512_loadu_si512(p)), hi, _mm512_loadu_si512(p + 1));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), pair_factor(d0 * dx[r * B + b], d1 * dx[r * B + b + 1]), acc[r]);
      tail[r] += m0 * sx[r * B + b] + m1 * sx[r * B + b + 1];
    }
  }
  if (b < B) {
    const float d0 = scale1(d[b]), m0 = sym ? -8.f * d0 : m ? scale1(m[b]) : 0.f;
    for (int r = 0; r < R; ++r) {
      const __m256i s = lone_dot<FOUR>(c + b * bytes, q + r * K + b * QB);
      side[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d0 * dx[r * B + b]), side[r]);
      tail[r] += m0 * sx[r * B + b];
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = _mm512_reduce_add_ps(acc[r]) + hsum(side[r]) + tail[r];
}

// rows r0 .. r1 of x against weight row n (its codes c, scales d, mins m), ROWS at a time, into y [M, N]
template <bool FOUR, typename S>
void wide_row(const Rows& xr, int64_t r0, int64_t r1, int64_t K, int64_t N, const uint8_t* c, const S* d, const S* m,
              bool sym, float* y) {
  const int64_t B = K / QB;
  auto row = [&](int64_t r) { return std::make_tuple(xr.q.data() + r * K, xr.dx.data() + r * B, xr.sx.data() + r * B); };
  int64_t r = r0;
  for (; r + ROWS <= r1; r += ROWS) {
    auto [q, dx, sx] = row(r);
    wide_rows<ROWS, FOUR, S>(q, dx, sx, K, B, c, d, m, sym, y + r * N, N);
  }
  for (; r + 2 <= r1; r += 2) {
    auto [q, dx, sx] = row(r);
    wide_rows<2, FOUR, S>(q, dx, sx, K, B, c, d, m, sym, y + r * N, N);
  }
  for (; r < r1; ++r) {
    auto [q, dx, sx] = row(r);
    wide_rows<1, FOUR, S>(q, dx, sx, K, B, c, d, m, sym, y + r * N, N);
  }
}

template void wide_row<true, float>(const Rows&, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                                    const float*, bool, float*);
template void wide_row<false, float>(const Rows&, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                                     const float*, bool, float*);
template void wide_row<true, at::Half>(const Rows&, int64_t, int64_t, int64_t, int64_t, const uint8_t*,
                                       const at::Half*, const at::Half*, bool, float*);
template void wide_row<false, at::Half>(const Rows&, int64_t, int64_t, int64_t, int64_t, const uint8_t*,
                                        const at::Half*, const at::Half*, bool, float*);
#endif

}  // namespace ninfer

TORCH_LIBRARY_FRAGMENT(ninfer_cpu, m) {
  m.def("gemv_isa(int level) -> int", &ninfer::gemv_isa);
  m.def("gemv_split(int dynamic) -> int", &ninfer::gemv_split);
}
