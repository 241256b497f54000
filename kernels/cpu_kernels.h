// The CPU kernels' shared part (kernels/cpu_native.py builds each .cpp beside it as its own translation unit and
// links them into one library): the includes, the helpers and constants every unit uses, and the declarations of
// what one unit defines and another calls. Everything lives in namespace ninfer.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NINFER_AVX2_F16C 1  // AVX2, FMA and F16C: the vector paths of every unit
#endif
#if defined(NINFER_AVX2_F16C) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define NINFER_AVX512_VNNI 1  // the low-bit GEMV's 512-bit path (cpu_vnni.cpp)
#endif

namespace ninfer {

constexpr int64_t ROWS = 4;  // rows of x that share one read of a weight row

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// ------------------------------------------------------------------------------------ cpu_native.cpp: lowbit_linear
constexpr int64_t QB = 32;  // activations rounded per block of this many values
constexpr int64_t MAX_BLOCKS = 1024;  // blocks a row may have (K up to 32,768)

struct Rows {  // M rows of activations rounded to int16: q [M, K], per block: the step dx and the float32 sum sx
  std::vector<int16_t> q;
  std::vector<float> dx, sx;
  bool wide = false;  // q in the order of the 512-bit path (cpu_vnni.cpp), which then reads them
};

// x [M, K] rounded to int16 per block of QB (interleaved: a block's evens first, then its odds, for 4-bit codes;
// wide: in pairs of blocks, for cpu_vnni.cpp's path: the same values in another order)
void round_rows(const float* x, int64_t M, int64_t K, bool interleaved, Rows& r, bool wide = false);
// the GEMV's code path now: 0 AVX2, 1 AVX-512 VNNI (cpu_vnni.cpp; the widest built is the default)
int gemv_level();
// whether the GEMV's threads take its weight rows in chunks from a shared counter (1) or one share each (0)
int gemv_dynamic();
#ifdef NINFER_AVX512_VNNI
// rows r0 .. r1 of x (rounded wide) against weight row n (its codes c, per-block scales d, mins m) into y + r * N
template <bool FOUR, typename S>
void wide_row(const Rows& xr, int64_t r0, int64_t r1, int64_t K, int64_t N, const uint8_t* c, const S* d, const S* m,
              bool sym, float* y);
#endif
// y [M, N] = rows xr @ W.T for 4-bit (FOUR) or int8 codes cp, scales dp and mins mp of type S, groups of G
template <bool FOUR, typename S>
void lowbit_all(const Rows& xr, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* cp, const S* dp,
                const S* mp, bool sym, float* yp);
// weight rows n0 .. n1 of lowbit_all's product (the caller splits the rows among its threads)
template <bool FOUR, typename S>
void lowbit_span(const Rows& xr, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* cp, const S* dp,
                 const S* mp, bool sym, float* yp, int64_t n0, int64_t n1);
void check_lowbit(int64_t K, const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                  bool sym);
void lowbit_into(const float* x, int64_t M, int64_t K, const at::Tensor& codes, const at::Tensor& scales,
                 const std::optional<at::Tensor>& mins, bool sym, float* yp);
at::Tensor lowbit_linear(const at::Tensor& x_, const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, bool sym);
void rms_row(const float* x, const float* w, int64_t D, float eps, float* y);

// ------------------------------------------------------------------------------------- cpu_dense.cpp: dense_linear
void dense_into(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y);
at::Tensor dense_linear(const at::Tensor& x_, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// -------------------------------------------------------------------------------------- cpu_decode.cpp: decode_step
struct Shape {
  int64_t heads, kv_heads, dim, page_size, pages;  // pages: columns of the page table
};

// n floats into a float32 or float16 cache at element `at`
void store_row(const at::Tensor& cache, int64_t at, const float* src, int64_t n);
// attention over a float32 or float16 K/V cache: q [B, heads, dim] -> out [B, heads, dim] over each row's context
void attend(const float* q, const at::Tensor& kc, const at::Tensor& vc, const int32_t* table, const int32_t* ctx,
            int64_t B, const Shape& s, float scale, float* out);
// out = silu(gate) * up for rows of [gate | up] (2 * n each)
void silu_mul(const float* gu, int64_t rows, int64_t n, float* out);

// a linear of a decode step: a dense float32 weight [out, in] (no scales; dense_linear's GEMV) or low-bit codes
// (lowbit_linear's operands), and an optional float32 bias; read from `ws` at entries at, at + 1, at + 2 (weight or
// codes, scales, mins) and `bias` (-1: none) by read_linear, which checks them against `in` inputs
struct Linear {
  at::Tensor w;
  std::optional<at::Tensor> scales, mins, bias;
  bool sym = false;
  int64_t in = 0, out = 0;
  void run(const float* x, int64_t B, float* y) const {
    if (scales)
      lowbit_into(x, B, in, w, *scales, mins, sym, y);
    else
      dense_into(x, B, in, w.data_ptr<float>(), out, nullptr, y);
    if (bias) {
      const float* bp = bias->data_ptr<float>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < out; ++i) y[b * out + i] += bp[i];
    }
  }
};

// y [M, out] = rows xr (round_rows of M rows for lin: interleaved for 4-bit codes) @ W.T, for a low-bit `lin`
struct LowbitJob {
  const Linear* lin;
  const Rows* xr;
  int64_t M;
  float* y;
};
// several low-bit GEMVs in one parallel region: the threads take chunks of every job's weight rows from one counter
// (one fork and join for all, and no thread idles at the end of a small one); each value as lowbit_into computes it
void lowbit_jobs(const std::vector<LowbitJob>& jobs);

Linear read_linear(const c10::List<std::optional<at::Tensor>>& ws, int64_t at_, int64_t bias, bool sym, int64_t in,
                   const char* op, int64_t layer);
void check_rows(const char* op, int64_t B, const at::Tensor& positions, const at::Tensor& slots,
                const at::Tensor& page_table, const at::Tensor& ctx_lens, const at::Tensor& cos, const at::Tensor& sin,
                int64_t rotated, int64_t slots_total, int64_t ctx_max);
void finish_layer(const Linear* li, const float* mixed, const float* post_norm, int64_t B, int64_t H, int64_t inter,
                  float eps, float* r, float* h, float* big);

// ------------------------------------------------------------------------------------------ cpu_moe.cpp: moe MLP
struct MoeMlp {
  const float* router = nullptr;       // [E, H] float32
  const float* shared_gate = nullptr;  // [H] float32, or null: no shared expert
  Linear shared_gu, shared_down;
  std::vector<Linear> gu, down;  // per expert: [2 I, H], [H, I]
  int64_t experts = 0, top_k = 0, inter = 0, shared_inter = 0;
  bool renorm = true;
  bool lowbit = false;  // every expert linear (the shared one too) has low-bit codes and no bias: lowbit_jobs runs them
};

MoeMlp read_moe(const c10::List<std::optional<at::Tensor>>& ws, int64_t at_, at::IntArrayRef syms, int64_t sym_at,
                int64_t E, int64_t k, bool renorm, int64_t H, int64_t layer);
void moe_rows(const MoeMlp& m, const float* h, int64_t B, int64_t H, float* r);

// a model's MoE layers read once (read_moe of each), for every decode step after: a step then converts none of the
// thousands of expert tensors from Python (torch.classes.ninfer_cpu.MoeLayers; hybrid_step takes it)
struct MoeLayers : torch::CustomClassHolder {
  c10::List<std::optional<at::Tensor>> weights;  // held: the layers point into them
  std::vector<MoeMlp> layers;                    // one a decoder layer; a dense MLP's has no router
  MoeLayers(c10::List<std::optional<at::Tensor>> ws, std::vector<int64_t> at, std::vector<int64_t> syms,
            std::vector<int64_t> dims, int64_t hidden);
};

}  // namespace ninfer
