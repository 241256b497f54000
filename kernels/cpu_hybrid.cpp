// hybrid_step: the decode step of a Qwen3.5-class Gated-DeltaNet hybrid for rows of one token each, in one call
// (engine/model/cpu_hybrid.py). It calls Linear, read_linear, rms_row, attend,
// finish_layer and moe_rows of the other units (cpu_kernels.h).
//
// The arithmetic is the eager layers' (engine/model/gdn.py, qwen35.py) in float32, each linear dense float32 or low-bit
// (the GEMVs of dense_linear and lowbit_linear). A GDN layer: RMSNorm, in_proj [qkv | z | b | a], the causal conv
// update (kernel K, SiLU) over the row's conv state, q and k L2-normed (q also scaled by Dk^-0.5), beta = sigmoid(b),
// g = -exp(A_log) softplus(a + dt_bias), the gated delta rule's step on the row's state (float32 or float16 storage,
// float32 arithmetic: S <- e^g S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q), the gated RMSNorm times
// silu(z), out_proj. A gated attention layer: the fused q|gate, k, v GEMV, per-head q/k norms, RoPE on the first
// `rotated` dims of each head, the K/V write, attention over the row's pages, times sigmoid(gate), o_proj. Then each
// layer's MLP: dense, or a mixture of experts (kernels/cpu_moe.cpp) where `moe_at` gives the layer's first entry of
// `moe_weights`; then the final norm.
#include "cpu_kernels.h"

namespace ninfer {

constexpr int64_t HYB_PER_LAYER = 18;  // entries of `weights` a layer takes, in this order (3 per linear):
enum { HY_IN_NORM, HY_POST_NORM, HY_MIX_IN, HY_MIX_OUT = HY_MIX_IN + 3, HY_GU = HY_MIX_OUT + 3, HY_DOWN = HY_GU + 3,
       HY_A = HY_DOWN + 3, HY_B, HY_C, HY_D };
// a linear: (float32 weight [N, K], None, None) or (codes, scales, mins or None). MIX_IN: GDN in_proj, attention
// q|gate,k,v; MIX_OUT: out_proj or o_proj. A..D: GDN conv weight [C, K], dt_bias [HV], -exp(A_log) [HV], output norm
// [Dv]; attention: q_norm, k_norm [head_dim], None, None.
enum { GDN = 0, ATTN = 1 };
constexpr float GDN_L2_EPS = 1e-6f;  // kernels/reference.GDN_NORM_EPS

const float* vec(const c10::List<std::optional<at::Tensor>>& ws, int64_t i, int64_t n, int64_t layer) {
  auto t = ws.get(i);
  TORCH_CHECK(t && t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, "hybrid_step: layer ",
              layer, ": weight entry ", i % HYB_PER_LAYER, " must be float32 with ", n, " values");
  return t->data_ptr<float>();
}

inline float silu1(float x) { return x / (1.f + std::exp(-x)); }
inline float softplus1(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

// x [heads, D]: the first r dims of each head rotated by one position's cos/sin rows [r / 2] (half-split)
inline void rope_part(float* x, int64_t heads, int64_t D, int64_t r, const float* c, const float* sn) {
  const int64_t half = r / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * c[i] - x2 * sn[i];
      v[i + half] = x2 * c[i] + x1 * sn[i];
    }
  }
}

// one value head's gated delta step: S [Dk, Dv] (stored as T) <- e^g S + k delta^T, delta = beta (v - S^T k);
// o = S^T q after the update; float32 throughout, the state rounded to T when stored
template <typename T>
void delta_head(const float* q, const float* k, const float* v, float g, float beta, T* S, int64_t Dk, int64_t Dv,
                float* o) {
  thread_local std::vector<float> s, kv;
  s.resize(Dk * Dv), kv.assign(Dv, 0.f);
  const float eg = std::exp(g);
  for (int64_t i = 0; i < Dk; ++i) {
    const T* row = S + i * Dv;
    float* si = s.data() + i * Dv;
    const float ki = k[i];
    for (int64_t j = 0; j < Dv; ++j) {
      si[j] = static_cast<float>(row[j]) * eg;
      kv[j] += ki * si[j];
    }
  }
  for (int64_t j = 0; j < Dv; ++j) kv[j] = beta * (v[j] - kv[j]);
  std::fill(o, o + Dv, 0.f);
  for (int64_t i = 0; i < Dk; ++i) {
    T* row = S + i * Dv;
    float* si = s.data() + i * Dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < Dv; ++j) {
      si[j] += ki * kv[j];
      o[j] += qi * si[j];
      row[j] = static_cast<T>(si[j]);
    }
  }
}

struct GdnShape {
  int64_t hk, hv, dk, dv, kernel, conv_dim, key_dim, value_dim;
};

// one GDN layer's mixing for B rows: proj [B, conv_dim + value_dim + 2 hv] -> out [B, value_dim] (normed, gated)
void gdn_rows(const float* proj, int64_t B, const GdnShape& g, const float* conv_w, const float* dt_bias,
              const float* neg_a, const float* gnorm, float eps, float* conv_state, const at::Tensor& ssm,
              const int64_t* state_slots, float* mixed, float* out) {
  const int64_t width = g.conv_dim + g.value_dim + 2 * g.hv, K = g.kernel, rep = g.hv / g.hk;
  for (int64_t b = 0; b < B; ++b) {  // conv update, q/k L2 norms
    const float* x = proj + b * width;
    float* st = conv_state + state_slots[b] * g.conv_dim * (K - 1);
    float* y = mixed + b * g.conv_dim;
    for (int64_t c = 0; c < g.conv_dim; ++c) {
      const float* w = conv_w + c * K;
      float* sc = st + c * (K - 1);
      float acc = 0.f;
      for (int64_t j = 0; j < K - 1; ++j) acc += w[j] * sc[j];
      acc += w[K - 1] * x[c];
      for (int64_t j = 0; j + 1 < K - 1; ++j) sc[j] = sc[j + 1];
      sc[K - 2] = x[c];
      y[c] = silu1(acc);
    }
    for (int64_t h = 0; h < 2 * g.hk; ++h) {
      float* v = y + h * g.dk;
      float ss = 0.f;
      for (int64_t i = 0; i < g.dk; ++i) ss += v[i] * v[i];
      const float inv = 1.f / std::sqrt(ss + GDN_L2_EPS) * (h < g.hk ? 1.f / std::sqrt(static_cast<float>(g.dk)) : 1.f);
      for (int64_t i = 0; i < g.dk; ++i) v[i] *= inv;
    }
  }
  const bool half = ssm.scalar_type() == at::kHalf;
  at::parallel_for(0, B * g.hv, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / g.hv, h = i % g.hv, kh = h / rep;
      const float* x = proj + b * width;
      const float* y = mixed + b * g.conv_dim;
      const float* q = y + kh * g.dk;
      const float* k = y + g.key_dim + kh * g.dk;
      const float* v = y + 2 * g.key_dim + h * g.dv;
      const float* z = x + g.conv_dim + h * g.dv;
      const float beta = 1.f / (1.f + std::exp(-x[g.conv_dim + g.value_dim + h]));
      const float gg = neg_a[h] * softplus1(x[g.conv_dim + g.value_dim + g.hv + h] + dt_bias[h]);
      const int64_t at_ = (state_slots[b] * g.hv + h) * g.dk * g.dv;
      float* o = out + b * g.value_dim + h * g.dv;
      if (half)
        delta_head(q, k, v, gg, beta, ssm.data_ptr<at::Half>() + at_, g.dk, g.dv, o);
      else
        delta_head(q, k, v, gg, beta, ssm.data_ptr<float>() + at_, g.dk, g.dv, o);
      rms_row(o, gnorm, g.dv, eps, o);
      for (int64_t j = 0; j < g.dv; ++j) o[j] *= silu1(z[j]);
    }
  });
}

at::Tensor hybrid_step(const at::Tensor& x_, const c10::List<std::optional<at::Tensor>>& weights, at::IntArrayRef kinds,
                       at::IntArrayRef syms, const at::Tensor& final_norm, at::TensorList k_cache,
                       at::TensorList v_cache, at::TensorList conv_states, at::TensorList ssm_states,
                       const at::Tensor& state_slots, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& page_table,
                       const at::Tensor& ctx_lens, at::IntArrayRef dims, double eps_,
                       const c10::intrusive_ptr<MoeLayers>& moe_layers) {
  TORCH_CHECK(dims.size() == 9, "hybrid_step: dims are (heads, kv_heads, head_dim, rotated, hk, hv, dk, dv, kernel)");
  const int64_t L = kinds.size(), B = x_.size(0), H = x_.size(1);
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat && x_.is_contiguous(),
              "hybrid_step: x must be contiguous float32 [B, hidden]");
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == L * HYB_PER_LAYER && syms.size() == 4 * L,
              "hybrid_step: ", HYB_PER_LAYER, " weights and 4 symmetry flags a layer");
  int64_t n_attn = 0;
  for (auto k : kinds) {
    TORCH_CHECK(k == GDN || k == ATTN, "hybrid_step: a layer kind is 0 (GDN) or 1 (attention)");
    n_attn += k == ATTN;
  }
  TORCH_CHECK(static_cast<int64_t>(k_cache.size()) == n_attn && static_cast<int64_t>(v_cache.size()) == n_attn &&
              static_cast<int64_t>(conv_states.size()) == L - n_attn &&
              static_cast<int64_t>(ssm_states.size()) == L - n_attn,
              "hybrid_step: one K and V cache per attention layer, one conv and ssm state per GDN layer");
  Shape s{dims[0], dims[1], dims[2], n_attn ? k_cache[0].size(1) : 1, page_table.size(1)};
  const int64_t D = s.dim, QS = s.heads * D, KS = s.kv_heads * D, R = dims[3];
  GdnShape g{dims[4], dims[5], dims[6], dims[7], dims[8], 0, dims[4] * dims[6], dims[5] * dims[7]};
  g.conv_dim = 2 * g.key_dim + g.value_dim;
  TORCH_CHECK(D % 8 == 0 && s.heads % s.kv_heads == 0 && R % 2 == 0 && R <= D && g.hv % g.hk == 0 && g.kernel >= 2,
              "hybrid_step: dims disagree (head_dim a multiple of 8, heads a multiple of kv_heads)");
  const auto kv_type = n_attn ? k_cache[0].scalar_type() : at::kFloat;
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kHalf, "hybrid_step: the KV cache must be float32 or float16");
  for (int64_t l = 0; l < n_attn; ++l)
    TORCH_CHECK(k_cache[l].dim() == 4 && k_cache[l].size(2) == s.kv_heads && k_cache[l].size(3) == D &&
                k_cache[l].is_contiguous() && v_cache[l].is_contiguous() && k_cache[l].sizes() == k_cache[0].sizes() &&
                v_cache[l].sizes() == k_cache[0].sizes() && k_cache[l].scalar_type() == kv_type &&
                v_cache[l].scalar_type() == kv_type,
                "hybrid_step: every K and V cache [pages, page_size, kv_heads, head_dim] like the first");
  TORCH_CHECK(state_slots.scalar_type() == at::kLong && state_slots.numel() == B, "hybrid_step: state_slots [B] int64");
  const int64_t* sslot = state_slots.data_ptr<int64_t>();
  for (int64_t l = 0; l < L - n_attn; ++l) {
    const auto &cs = conv_states[l], &ss = ssm_states[l];
    TORCH_CHECK(cs.scalar_type() == at::kFloat && cs.is_contiguous() && cs.dim() == 3 && cs.size(1) == g.conv_dim &&
                cs.size(2) == g.kernel - 1, "hybrid_step: conv states must be float32 [slots, conv_dim, kernel - 1]");
    TORCH_CHECK((ss.scalar_type() == at::kFloat || ss.scalar_type() == at::kHalf) && ss.is_contiguous() &&
                ss.dim() == 4 && ss.size(0) == cs.size(0) && ss.size(1) == g.hv && ss.size(2) == g.dk &&
                ss.size(3) == g.dv, "hybrid_step: ssm states must be float32 or float16 [slots, hv, dk, dv]");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(sslot[b] >= 0 && sslot[b] < cs.size(0), "hybrid_step: row ", b, "'s state slot is out of range");
  }
  if (n_attn)
    check_rows("hybrid_step", B, positions, slots, page_table, ctx_lens, cos, sin, R, k_cache[0].size(0) * s.page_size,
               s.pages * s.page_size);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int32_t* ctx = ctx_lens.data_ptr<int32_t>();
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.numel() == H && final_norm.is_contiguous(),
              "hybrid_step: the final norm must be float32 [hidden]");
  const float eps = static_cast<float>(eps_), scale = 1.f / std::sqrt(static_cast<float>(D));

  TORCH_CHECK(static_cast<int64_t>(moe_layers->layers.size()) == L,
              "hybrid_step: the MoE layers must name each decoder layer (", L, "), not ", moe_layers->layers.size());
  const std::vector<MoeMlp>& moe = moe_layers->layers;
  std::vector<Linear> lin(4 * L);
  int64_t widest = 0, inter = 0;
  for (int64_t l = 0; l < L; ++l) {
    const bool gdn = kinds[l] == GDN, is_moe = moe[l].router != nullptr;
    const int64_t base = l * HYB_PER_LAYER;
    auto read = [&](int64_t at_, int j, int64_t in) {
      return read_linear(weights, base + at_, -1, syms[4 * l + j] != 0, in, "hybrid_step", l);
    };
    lin[4 * l] = read(HY_MIX_IN, 0, H);
    lin[4 * l + 1] = read(HY_MIX_OUT, 1, gdn ? g.value_dim : QS);
    if (!is_moe) {
      lin[4 * l + 2] = read(HY_GU, 2, H);
      const int64_t li = lin[4 * l + 2].out / 2;
      TORCH_CHECK(lin[4 * l + 2].out % 2 == 0 && (!inter || li == inter), "hybrid_step: layer ", l, "'s MLP width");
      inter = li;
      lin[4 * l + 3] = read(HY_DOWN, 3, inter);
      TORCH_CHECK(lin[4 * l + 3].out == H, "hybrid_step: layer ", l, "'s MLP shapes disagree with dims");
    }
    TORCH_CHECK(lin[4 * l].out == (gdn ? g.conv_dim + g.value_dim + 2 * g.hv : 2 * QS + 2 * KS) &&
                lin[4 * l + 1].out == H, "hybrid_step: layer ", l, "'s shapes disagree with dims");
    vec(weights, base + HY_IN_NORM, H, l), vec(weights, base + HY_POST_NORM, H, l);
    if (gdn) {
      vec(weights, base + HY_A, g.conv_dim * g.kernel, l), vec(weights, base + HY_B, g.hv, l);
      vec(weights, base + HY_C, g.hv, l), vec(weights, base + HY_D, g.dv, l);
    } else {
      vec(weights, base + HY_A, D, l), vec(weights, base + HY_B, D, l);
    }
    for (int j = 0; j < 4; ++j) widest = std::max(widest, lin[4 * l + j].out);
  }

  auto resid = x_.clone();
  auto out = at::empty({B, H}, x_.options());
  std::vector<float> h(B * std::max({H, inter, g.value_dim, QS})), big(B * widest), mixed(B * g.conv_dim),
      q(B * QS), gate(B * QS), attn(B * std::max(QS, g.value_dim));
  float* r = resid.data_ptr<float>();
  auto w = [&](int64_t l, int64_t i) { return weights.get(l * HYB_PER_LAYER + i)->data_ptr<float>(); };
  int64_t attn_at = 0, gdn_at = 0;
  for (int64_t l = 0; l < L; ++l) {
    const Linear* li = &lin[4 * l];
    for (int64_t b = 0; b < B; ++b) rms_row(r + b * H, w(l, HY_IN_NORM), H, eps, h.data() + b * H);
    li[0].run(h.data(), B, big.data());
    if (kinds[l] == GDN) {
      gdn_rows(big.data(), B, g, w(l, HY_A), w(l, HY_B), w(l, HY_C), w(l, HY_D), eps,
               conv_states[gdn_at].data_ptr<float>(), ssm_states[gdn_at], sslot, mixed.data(), attn.data());
      ++gdn_at;
    } else {
      const int64_t width = 2 * QS + 2 * KS;
      for (int64_t b = 0; b < B; ++b) {
        float* row = big.data() + b * width;
        float *qb = q.data() + b * QS, *kv = row + 2 * QS;
        for (int64_t hq = 0; hq < s.heads; ++hq) {
          rms_row(row + hq * 2 * D, w(l, HY_A), D, eps, qb + hq * D);
          std::copy(row + hq * 2 * D + D, row + (hq + 1) * 2 * D, gate.data() + b * QS + hq * D);
        }
        for (int64_t hk = 0; hk < s.kv_heads; ++hk) rms_row(kv + hk * D, w(l, HY_B), D, eps, kv + hk * D);
        const float *c = cos.data_ptr<float>() + pos[b] * (R / 2), *sn = sin.data_ptr<float>() + pos[b] * (R / 2);
        rope_part(qb, s.heads, D, R, c, sn);
        rope_part(kv, s.kv_heads, D, R, c, sn);
        store_row(k_cache[attn_at], slot[b] * KS, kv, KS);
        store_row(v_cache[attn_at], slot[b] * KS, kv + KS, KS);
      }
      attend(q.data(), k_cache[attn_at], v_cache[attn_at], page_table.data_ptr<int32_t>(), ctx, B, s, scale,
             attn.data());
      for (int64_t i = 0; i < B * QS; ++i) attn[i] *= 1.f / (1.f + std::exp(-gate[i]));
      ++attn_at;
    }
    if (moe[l].router) {
      li[1].run(attn.data(), B, big.data());
      for (int64_t i = 0; i < B * H; ++i) r[i] += big[i];
      for (int64_t b = 0; b < B; ++b) rms_row(r + b * H, w(l, HY_POST_NORM), H, eps, h.data() + b * H);
      moe_rows(moe[l], h.data(), B, H, r);
    } else {
      finish_layer(li, attn.data(), w(l, HY_POST_NORM), B, H, inter, eps, r, h.data(), big.data());
    }
  }
  for (int64_t b = 0; b < B; ++b) rms_row(r + b * H, final_norm.data_ptr<float>(), H, eps, out.data_ptr<float>() + b * H);
  return out;
}

}  // namespace ninfer

TORCH_LIBRARY_FRAGMENT(ninfer_cpu, m) {
  m.class_<ninfer::MoeLayers>("MoeLayers")  // registered before the schema below names it
      .def(torch::init<c10::List<std::optional<at::Tensor>>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<int64_t>, int64_t>());
  m.def("hybrid_step(Tensor x, Tensor?[] weights, int[] kinds, int[] syms, Tensor final_norm, Tensor[] k_cache, "
        "Tensor[] v_cache, Tensor[] conv_states, Tensor[] ssm_states, Tensor state_slots, Tensor cos, Tensor sin, "
        "Tensor positions, Tensor slots, Tensor page_table, Tensor ctx_lens, int[] dims, float eps, "
        "__torch__.torch.classes.ninfer_cpu.MoeLayers moe_layers) -> Tensor");
  m.impl("hybrid_step", c10::DispatchKey::CPU, &ninfer::hybrid_step);
}
