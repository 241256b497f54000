// decode_step: a llama-family decoder stack for decode rows (one token each) in one call (engine/model/cpu_fused.py).
//
// It calls lowbit_into, check_lowbit, dense_into, rms_row and hsum (cpu_kernels.h). Each linear is dense float32 or low-bit (`Linear`, cpu_hybrid.cpp's too). Per layer:
// RMSNorm, the fused qkv GEMV (+ bias), Qwen3's per-head q/k norms, RoPE (half-split), the K/V write to each row's
// slot, attention over each row's pages, o (+ bias), the residual, RMSNorm, gate_up, SiLU * up, down, the residual;
// then the final norm. The arithmetic is the eager layer's (engine/model/llama.py) with the same kernels for the
// GEMVs and norms; attention splits each row's context into chunks the threads share (partial softmax, merged).
#include "cpu_kernels.h"

namespace ninfer {

constexpr int64_t PER_LAYER = 18;  // entries of `weights` a layer takes, in this order (a dense linear: S, M None):
enum { IN_NORM, POST_NORM, QKV, QKV_S, QKV_M, QKV_B, O, O_S, O_M, O_B, GU, GU_S, GU_M, DOWN, DOWN_S, DOWN_M, Q_NORM,
       K_NORM };
constexpr int64_t CHUNK = 64;  // tokens of one attention task

#ifdef NINFER_AVX2_F16C  // cpu_native.cpp's: AVX2, FMA and F16C
// e^x for x <= 0 (scores minus their max, -gate of SiLU clamped): 2^n times a degree-6 polynomial on |r| <= ln2/2
// (Cephes' expf coefficients), within 2 ulp of expf
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline __m256 load_kv(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_kv(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

inline float kv_float(float v) { return v; }
inline float kv_float(at::Half v) { return static_cast<float>(v); }

template <typename T>
inline void store_kv(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);  // float16: to nearest even, as Tensor.to
}

// e^x of n floats in place
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#ifdef NINFER_AVX2_F16C
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

template <typename T>
inline float dot_kv(const float* q, const T* k, int64_t d) {
#ifdef NINFER_AVX2_F16C
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_kv(k + i), a);
    b = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load_kv(k + i + 8), b);
  }
  if (i < d) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_kv(k + i), a);  // d % 8 == 0 (decode_step checks)
  return hsum(_mm256_add_ps(a, b));
#else
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += q[i] * kv_float(k[i]);
  return s;
#endif
}


// acc [D] += sum over tokens i of p[i] * v_i, the V rows of n tokens `stride` floats apart (kept in registers: one
// pass over V a slice of 64 values)
template <typename T>
inline void weighted_sum(const float* p, const T* v, int64_t n, int64_t stride, int64_t D, float* acc) {
  int64_t d0 = 0;
#ifdef NINFER_AVX2_F16C
  for (; d0 + 64 <= D; d0 += 64) {
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(acc + d0 + 8 * j);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 pv = _mm256_set1_ps(p[i]);
      const T* vi = v + i * stride + d0;
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(pv, load_kv(vi + 8 * j), a[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + d0 + 8 * j, a[j]);
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = d0; d < D; ++d) acc[d] += p[i] * kv_float(v[i * stride + d]);
}

// one attention task: every query head of row b over tokens [t0, t1) of its context (whole pages' worth of rows read
// in order); writes per query head its max score, its sum of exponentials and its unnormalized output: heads * (D + 2)
// floats at part
template <typename T>
void attend_chunk(const float* q, const T* kc, const T* vc, const int32_t* pages, const Shape& s, int64_t t0,
                  int64_t t1, float scale, float* part) {
  const int64_t G = s.heads / s.kv_heads, D = s.dim, n = t1 - t0, stride = s.kv_heads * D;
  thread_local std::vector<float> scores;  // [heads, n]
  scores.resize(s.heads * n);
  for (int64_t t = t0; t < t1;) {  // a run of tokens on one page: consecutive rows
    const int64_t page = pages[t / s.page_size], end = std::min(t1, (t / s.page_size + 1) * s.page_size);
    const T* k = kc + (page * s.page_size + t % s.page_size) * stride;
    for (int64_t i = t; i < end; ++i, k += stride)
      for (int64_t hq = 0; hq < s.heads; ++hq) scores[hq * n + i - t0] = dot_kv(q + hq * D, k + hq / G * D, D) * scale;
    t = end;
  }
  for (int64_t hq = 0; hq < s.heads; ++hq) {
    float* sg = scores.data() + hq * n;
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sg[i]);
    for (int64_t i = 0; i < n; ++i) sg[i] -= mx;
    exp_inplace(sg, n);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += sg[i];
    float* out = part + hq * (D + 2);
    out[0] = mx, out[1] = sum;
    std::fill(out + 2, out + 2 + D, 0.f);
  }
  for (int64_t t = t0; t < t1;) {
    const int64_t page = pages[t / s.page_size], end = std::min(t1, (t / s.page_size + 1) * s.page_size);
    const T* v = vc + (page * s.page_size + t % s.page_size) * stride;
    for (int64_t hq = 0; hq < s.heads; ++hq)
      weighted_sum(scores.data() + hq * n + t - t0, v + hq / G * D, end - t, stride, D, part + hq * (D + 2) + 2);
    t = end;
  }
}

// every row's attention: q [B, heads, dim] -> out [B, heads, dim] over each row's ctx_lens[b] tokens
template <typename T>
void attention(const float* q, const T* kc, const T* vc, const int32_t* table, const int32_t* ctx, int64_t B,
               const Shape& s, float scale, float* out) {
  const int64_t D = s.dim, width = s.heads * (D + 2);
  std::vector<int64_t> first(B + 1, 0);  // each row's first task (a task: one chunk of its context)
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + (ctx[b] + CHUNK - 1) / CHUNK;
  thread_local std::vector<float> partials;  // this (the calling) thread's; the workers write through `parts`
  partials.resize(first[B] * width);
  float* parts = partials.data();
  at::parallel_for(0, first[B], 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1, c = i - first[b];
      attend_chunk(q + b * s.heads * D, kc, vc, table + b * s.pages, s, c * CHUNK,
                   std::min<int64_t>(ctx[b], (c + 1) * CHUNK), scale, parts + i * width);
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t hq = 0; hq < s.heads; ++hq) {
      auto at = [&](int64_t i) { return parts + i * width + hq * (D + 2); };
      float mx = -INFINITY, sum = 0.f;
      for (int64_t i = first[b]; i < first[b + 1]; ++i) mx = std::max(mx, at(i)[0]);
      float* o = out + (b * s.heads + hq) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t i = first[b]; i < first[b + 1]; ++i) {
        const float w = std::exp(at(i)[0] - mx);
        sum += w * at(i)[1];
        for (int64_t d = 0; d < D; ++d) o[d] += w * at(i)[2 + d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= sum;
    }
  }
}

// n floats into a float32 or float16 cache at element `at`
void store_row(const at::Tensor& cache, int64_t at, const float* src, int64_t n) {
  if (cache.scalar_type() == at::kFloat)
    store_kv(cache.data_ptr<float>() + at, src, n);
  else
    store_kv(cache.data_ptr<at::Half>() + at, src, n);
}

// attention over a float32 or float16 K/V cache (both alike)
void attend(const float* q, const at::Tensor& kc, const at::Tensor& vc, const int32_t* table, const int32_t* ctx,
            int64_t B, const Shape& s, float scale, float* out) {
  if (kc.scalar_type() == at::kFloat)
    attention(q, kc.data_ptr<float>(), vc.data_ptr<float>(), table, ctx, B, s, scale, out);
  else
    attention(q, kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>(), table, ctx, B, s, scale, out);
}

// x [heads, dim] rotated by one position's cos/sin rows [dim / 2] (half-split: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s))
inline void rope(float* x, int64_t heads, int64_t D, const float* c, const float* sn) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * c[i] - x2 * sn[i];
      v[i + half] = x2 * c[i] + x1 * sn[i];
    }
  }
}

// out = silu(gate) * up for rows of [gate | up] (2 * n each)
void silu_mul(const float* gu, int64_t rows, int64_t n, float* out) {
  std::vector<float> e(n);
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gu + r * 2 * n, *u = g + n;
    for (int64_t i = 0; i < n; ++i) e[i] = -g[i];
    exp_inplace(e.data(), n);
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = g[i] / (1.f + e[i]) * u[i];
  }
}

Linear read_linear(const c10::List<std::optional<at::Tensor>>& ws, int64_t at_, int64_t bias, bool sym, int64_t in,
                   const char* op, int64_t layer) {
  auto w = ws.get(at_);
  TORCH_CHECK(w, op, ": layer ", layer, " lacks a linear weight");
  Linear l;
  l.w = *w, l.scales = ws.get(at_ + 1), l.mins = ws.get(at_ + 2), l.sym = sym, l.in = in, l.out = w->size(0);
  l.bias = bias >= 0 ? ws.get(bias) : std::nullopt;
  if (l.scales)
    check_lowbit(in, l.w, *l.scales, l.mins, sym);
  else
    TORCH_CHECK(w->scalar_type() == at::kFloat && w->dim() == 2 && w->is_contiguous() && w->size(1) == in && !l.mins,
                op, ": layer ", layer, ": a dense weight must be contiguous float32 [out, ", in, "]");
  TORCH_CHECK(!l.bias || (l.bias->scalar_type() == at::kFloat && l.bias->numel() == l.out && l.bias->is_contiguous()),
              op, ": a bias must be float32 [out]");
  return l;
}

// the checks of a step's row operands: positions and KV slots [B] int64 (each slot below `slots_total`), a page table
// [B, P] and context lengths [B] int32 (each at most `ctx_max`), cos/sin float32 [positions, rotated / 2]
void check_rows(const char* op, int64_t B, const at::Tensor& positions, const at::Tensor& slots,
                const at::Tensor& page_table, const at::Tensor& ctx_lens, const at::Tensor& cos, const at::Tensor& sin,
                int64_t rotated, int64_t slots_total, int64_t ctx_max) {
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.is_contiguous() && page_table.size(0) == B &&
              ctx_lens.scalar_type() == at::kInt && ctx_lens.numel() == B && positions.numel() == B &&
              slots.numel() == B && positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong, op,
              ": positions, slots [B] int64; page_table [B, P], ctx_lens [B] int32");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == rotated / 2 &&
              sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous(), op,
              ": cos/sin float32 [positions, rotated dims / 2]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int32_t* ctx = ctx_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pos[b] >= 0 && pos[b] < cos.size(0) && slot[b] >= 0 && slot[b] < slots_total && ctx[b] >= 1 &&
                ctx[b] <= ctx_max, op, ": row ", b, "'s position, slot or context is out of range");
}

// the rest of a layer after its mixing (attention, or a GDN layer's) for B rows: r += li[1](mixed); h = RMSNorm(r);
// r += li[3](silu(gate) * up) over [gate | up] = li[2](h); h and big are scratch rows
void finish_layer(const Linear* li, const float* mixed, const float* post_norm, int64_t B, int64_t H, int64_t inter,
                  float eps, float* r, float* h, float* big) {
  li[1].run(mixed, B, big);
  for (int64_t i = 0; i < B * H; ++i) r[i] += big[i];
  for (int64_t b = 0; b < B; ++b) rms_row(r + b * H, post_norm, H, eps, h + b * H);
  li[2].run(h, B, big);
  silu_mul(big, B, inter, h);
  li[3].run(h, B, big);
  for (int64_t i = 0; i < B * H; ++i) r[i] += big[i];
}

at::Tensor decode_step(const at::Tensor& x_, const c10::List<std::optional<at::Tensor>>& weights,
                       at::IntArrayRef syms, const at::Tensor& final_norm, at::TensorList k_cache,
                       at::TensorList v_cache, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& page_table,
                       const at::Tensor& ctx_lens, at::IntArrayRef dims, double eps_, double scale_) {
  TORCH_CHECK(dims.size() == 3, "decode_step: dims are (heads, kv_heads, head_dim)");
  const int64_t L = k_cache.size(), B = x_.size(0), H = x_.size(1);
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "decode_step: x must be float32 [B, hidden]");
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == L * PER_LAYER && syms.size() == 4 * L &&
              v_cache.size() == L, "decode_step: ", PER_LAYER, " weights and 4 symmetry flags a layer");
  const int64_t P = page_table.size(1);
  Shape s{dims[0], dims[1], dims[2], k_cache[0].size(1), P};
  const int64_t D = s.dim, QS = s.heads * D, KS = s.kv_heads * D;
  TORCH_CHECK(D % 8 == 0 && s.heads % s.kv_heads == 0 && k_cache[0].dim() == 4 && k_cache[0].size(2) == s.kv_heads &&
              k_cache[0].size(3) == D, "decode_step: the KV cache is not [pages, page_size, kv_heads, head_dim]");
  const auto kv_type = k_cache[0].scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kHalf, "decode_step: the KV cache must be float32 or float16");
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(k_cache[l].is_contiguous() && v_cache[l].is_contiguous() && k_cache[l].sizes() == k_cache[0].sizes() &&
                v_cache[l].sizes() == k_cache[0].sizes() && k_cache[l].scalar_type() == kv_type &&
                v_cache[l].scalar_type() == kv_type, "decode_step: every layer's K and V like the first's");
  check_rows("decode_step", B, positions, slots, page_table, ctx_lens, cos, sin, D, k_cache[0].size(0) * s.page_size,
             P * s.page_size);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int32_t* ctx = ctx_lens.data_ptr<int32_t>();
  const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);

  std::vector<Linear> lin(4 * L);
  std::vector<const float*> norms(4 * L, nullptr);  // in, post, q, k norm weights per layer
  int64_t widest = 0, inter = 0;
  for (int64_t l = 0; l < L; ++l) {
    auto w = [&](int i) { return weights.get(l * PER_LAYER + i); };
    const int parts[4][2] = {{QKV, QKV_B}, {O, O_B}, {GU, -1}, {DOWN, -1}};
    const int64_t in[4] = {H, QS, H, 0};
    for (int j = 0; j < 4; ++j) {
      const int64_t k_in = j == 3 ? inter : in[j], bias = parts[j][1] < 0 ? -1 : l * PER_LAYER + parts[j][1];
      lin[4 * l + j] = read_linear(weights, l * PER_LAYER + parts[j][0], bias, syms[4 * l + j] != 0, k_in,
                                   "decode_step", l);
      if (j == 2) inter = lin[4 * l + j].out / 2;
      widest = std::max(widest, lin[4 * l + j].out);
    }
    TORCH_CHECK(lin[4 * l].out == QS + 2 * KS && lin[4 * l + 1].out == H && lin[4 * l + 3].out == H &&
                lin[4 * l + 2].out == 2 * inter, "decode_step: layer ", l, "'s shapes disagree with dims");
    for (int j = 0; j < 4; ++j) {
      auto t = w(j < 2 ? (j ? POST_NORM : IN_NORM) : (j == 2 ? Q_NORM : K_NORM));
      if (j < 2) TORCH_CHECK(t, "decode_step: layer ", l, " lacks a norm weight");
      if (!t) continue;
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == (j < 2 ? H : D),
                  "decode_step: norm weights are float32 [hidden] or [head_dim]");
      norms[4 * l + j] = t->data_ptr<float>();
    }
  }
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.numel() == H && final_norm.is_contiguous(),
              "decode_step: the final norm must be float32 [hidden]");

  auto resid = x_.contiguous().clone();
  auto out = at::empty({B, H}, x_.options());
  std::vector<float> h(B * std::max(H, inter)), big(B * widest), q(B * QS), attn(B * QS);
  float* r = resid.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const Linear* li = &lin[4 * l];
    for (int64_t b = 0; b < B; ++b) rms_row(r + b * H, norms[4 * l], H, eps, h.data() + b * H);
    li[0].run(h.data(), B, big.data());
    for (int64_t b = 0; b < B; ++b) {
      float* qkv = big.data() + b * li[0].out;
      if (norms[4 * l + 2])
        for (int64_t i = 0; i < s.heads + s.kv_heads; ++i)
          rms_row(qkv + i * D, norms[4 * l + (i < s.heads ? 2 : 3)], D, eps, qkv + i * D);
      rope(qkv, s.heads + s.kv_heads, D, cos.data_ptr<float>() + pos[b] * (D / 2),
           sin.data_ptr<float>() + pos[b] * (D / 2));
      std::copy(qkv, qkv + QS, q.data() + b * QS);
      store_row(k_cache[l], slot[b] * KS, qkv + QS, KS);
      store_row(v_cache[l], slot[b] * KS, qkv + QS + KS, KS);
    }
    attend(q.data(), k_cache[l], v_cache[l], page_table.data_ptr<int32_t>(), ctx, B, s, scale, attn.data());
    finish_layer(li, attn.data(), norms[4 * l + 1], B, H, inter, eps, r, h.data(), big.data());
  }
  for (int64_t b = 0; b < B; ++b) rms_row(r + b * H, final_norm.data_ptr<float>(), H, eps, out.data_ptr<float>() + b * H);
  return out;
}

}  // namespace ninfer

TORCH_LIBRARY_FRAGMENT(ninfer_cpu, m) {
  m.def("decode_step(Tensor x, Tensor?[] weights, int[] syms, Tensor final_norm, Tensor[] k_cache, Tensor[] v_cache, "
        "Tensor cos, Tensor sin, Tensor positions, Tensor slots, Tensor page_table, Tensor ctx_lens, int[] dims, "
        "float eps, float scale) -> Tensor");
  m.impl("decode_step", c10::DispatchKey::CPU, &ninfer::decode_step);
}
