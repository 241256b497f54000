// The mixture-of-experts MLP of a decode step for rows of one token each (engine/model/moe.py's MoEMLP, its
// arithmetic in float32): router logits = h @ router.T (dense float32), a softmax over the experts, the top k
// (largest first), renormalised over the k when `renorm`; each picked expert is down(silu(gate) * up) over the
// fused [gate | up] GEMV; the rows that picked an expert run through it together (its weights read once for them);
// the shared expert runs for every row, scaled by sigmoid(h . shared_gate). It calls cpu_decode.cpp's
// Linear, read_linear and silu_mul and dense_into (cpu_kernels.h); cpu_hybrid.cpp calls it.
#include "cpu_kernels.h"

namespace ninfer {

constexpr int64_t MOE_HEAD = 8;  // entries before the experts: router, shared gate, shared gate_up (3), shared down (3)

// a layer's MoE entries of `ws` from `at`: router [E, H], shared gate [1, H] or None, the shared expert's gate_up and
// down (3 entries each: the weight or codes, scales, mins; all None without a shared expert), then per expert its
// gate_up and down; the symmetry flags of those linears from `syms` at `sym_at` (2 + 2 E of them)
MoeMlp read_moe(const c10::List<std::optional<at::Tensor>>& ws, int64_t at_, at::IntArrayRef syms, int64_t sym_at,
                int64_t E, int64_t k, bool renorm, int64_t H, int64_t layer) {
  MoeMlp m;
  m.experts = E, m.top_k = k, m.renorm = renorm;
  TORCH_CHECK(E > 0 && k > 0 && k <= E, "moe: top_k must lie in 1..experts");
  TORCH_CHECK(at_ + MOE_HEAD + 6 * E <= static_cast<int64_t>(ws.size()) &&
              sym_at + 2 + 2 * E <= static_cast<int64_t>(syms.size()), "moe: layer ", layer, " lacks entries");
  auto f32 = [&](int64_t i, int64_t n, const char* what) -> const float* {
    auto t = ws.get(i);
    if (!t) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, "moe: layer ", layer, "'s ",
                what, " must be contiguous float32 with ", n, " values");
    return t->data_ptr<float>();
  };
  m.router = f32(at_, E * H, "router");
  TORCH_CHECK(m.router, "moe: layer ", layer, " lacks its router");
  m.shared_gate = f32(at_ + 1, H, "shared expert gate");
  if (m.shared_gate) {
    m.shared_gu = read_linear(ws, at_ + 2, -1, syms[sym_at] != 0, H, "moe", layer);
    m.shared_inter = m.shared_gu.out / 2;
    m.shared_down = read_linear(ws, at_ + 5, -1, syms[sym_at + 1] != 0, m.shared_inter, "moe", layer);
    TORCH_CHECK(m.shared_gu.out % 2 == 0 && m.shared_down.out == H, "moe: layer ", layer, "'s shared expert shapes");
  }
  m.gu.resize(E), m.down.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t base = at_ + MOE_HEAD + 6 * e, s = sym_at + 2 + 2 * e;
    m.gu[e] = read_linear(ws, base, -1, syms[s] != 0, H, "moe", layer);
    m.inter = m.gu[e].out / 2;
    TORCH_CHECK(m.gu[e].out == m.gu[0].out && m.gu[e].out % 2 == 0, "moe: layer ", layer, "'s experts differ in width");
    m.down[e] = read_linear(ws, base + 3, -1, syms[s + 1] != 0, m.inter, "moe", layer);
    TORCH_CHECK(m.down[e].out == H, "moe: layer ", layer, "'s expert ", e, " does not return the hidden size");
  }
  return m;
}

// one row's routing: the top k of softmax(logits) (largest first), renormalised over the k when `renorm`
void route_row(const float* logits, int64_t E, int64_t k, bool renorm, int64_t* ids, float* w) {
  thread_local std::vector<float> p;
  thread_local std::vector<int64_t> order;
  p.resize(E), order.resize(E);
  const float top = *std::max_element(logits, logits + E);
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(logits[e] - top);
  for (int64_t e = 0; e < E; ++e) p[e] /= sum, order[e] = e;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  float picked = 0.f;
  for (int64_t j = 0; j < k; ++j) ids[j] = order[j], w[j] = p[order[j]], picked += w[j];
  if (renorm)
    for (int64_t j = 0; j < k; ++j) w[j] /= picked;
}

// r [B, H] += the MoE MLP of h [B, H]
void moe_rows(const MoeMlp& m, const float* h, int64_t B, int64_t H, float* r) {
  const int64_t E = m.experts, k = m.top_k, I = m.inter;
  std::vector<float> logits(B * E), w(B * k), acc(B * H, 0.f);
  std::vector<int64_t> ids(B * k);
  dense_into(h, B, H, m.router, E, nullptr, logits.data());
  for (int64_t b = 0; b < B; ++b) route_row(logits.data() + b * E, E, k, m.renorm, ids.data() + b * k, w.data() + b * k);
  std::vector<float> x(B * H), gu(B * 2 * std::max(I, m.shared_inter)), act(B * std::max(I, m.shared_inter)),
      y(B * H);
  std::vector<int64_t> rows;
  std::vector<float> scale;
  // experts in the order the rows picked them (row 0's first): one row alone sums its experts as MoEMLP does
  for (int64_t j0 = 0; j0 < B * k; ++j0) {
    const int64_t e = ids[j0];
    if (std::find(ids.begin(), ids.begin() + j0, e) != ids.begin() + j0) continue;  // done with an earlier pick
    rows.clear(), scale.clear();
    for (int64_t j = j0; j < B * k; ++j)
      if (ids[j] == e) rows.push_back(j / k), scale.push_back(w[j]);
    const int64_t n = rows.size();
    for (int64_t i = 0; i < n; ++i) std::copy(h + rows[i] * H, h + (rows[i] + 1) * H, x.data() + i * H);
    m.gu[e].run(x.data(), n, gu.data());
    silu_mul(gu.data(), n, I, act.data());
    m.down[e].run(act.data(), n, y.data());
    for (int64_t i = 0; i < n; ++i) {
      float* a = acc.data() + rows[i] * H;
      const float* yi = y.data() + i * H;
      for (int64_t c = 0; c < H; ++c) a[c] += yi[c] * scale[i];
    }
  }
  if (m.shared_gate) {
    m.shared_gu.run(h, B, gu.data());
    silu_mul(gu.data(), B, m.shared_inter, act.data());
    m.shared_down.run(act.data(), B, y.data());
    for (int64_t b = 0; b < B; ++b) {
      float g = 0.f;
      for (int64_t c = 0; c < H; ++c) g += h[b * H + c] * m.shared_gate[c];
      g = 1.f / (1.f + std::exp(-g));
      for (int64_t c = 0; c < H; ++c) acc[b * H + c] += g * y[b * H + c];
    }
  }
  for (int64_t i = 0; i < B * H; ++i) r[i] += acc[i];
}

}  // namespace ninfer
