// The mixture-of-experts MLP of a decode step for rows of one token each (engine/model/moe.py's MoEMLP, its
// arithmetic in float32): router logits = h @ router.T (dense float32), a softmax over the experts, the top k
// (largest first), renormalised over the k when `renorm`; each picked expert is down(silu(gate) * up) over the
// fused [gate | up] GEMV; the rows that picked an expert run through it together (its weights read once for them);
// the shared expert runs for every row, scaled by sigmoid(h . shared_gate). It calls cpu_decode.cpp's
// Linear, read_linear and silu_mul and dense_into (cpu_kernels.h); cpu_hybrid.cpp calls it. Low-bit experts (a
// GGUF's or our own int4/int8) run in two parallel regions a layer (lowbit_jobs: every picked expert's and the
// shared expert's gate_up, then every down), not two per expert: a decode token's 9 small GEMVs of 0.1-0.3 MB
// each left the threads waiting at a join after each one.
#include <array>

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
  auto low = [](const Linear& l) { return l.scales.has_value() && !l.bias; };
  m.lowbit = std::all_of(m.gu.begin(), m.gu.end(), low) && std::all_of(m.down.begin(), m.down.end(), low) &&
             (!m.shared_gate || (low(m.shared_gu) && low(m.shared_down)));
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

namespace {

struct Pick {  // one expert that rows picked: those rows and their routing weights
  int64_t e;
  std::vector<int64_t> rows;
  std::vector<float> scale;
};

// the experts in the order the rows picked them (row 0's first): one row alone sums its experts as MoEMLP does
std::vector<Pick> picks_of(const std::vector<int64_t>& ids, const std::vector<float>& w, int64_t k) {
  std::vector<Pick> picks;
  const int64_t n = ids.size();
  for (int64_t j0 = 0; j0 < n; ++j0) {
    const int64_t e = ids[j0];
    if (std::find(ids.begin(), ids.begin() + j0, e) != ids.begin() + j0) continue;  // done with an earlier pick
    Pick p{e, {}, {}};
    for (int64_t j = j0; j < n; ++j)
      if (ids[j] == e) p.rows.push_back(j / k), p.scale.push_back(w[j]);
    picks.push_back(std::move(p));
  }
  return picks;
}

void gather(const float* h, const Pick& p, int64_t H, float* x) {
  for (size_t i = 0; i < p.rows.size(); ++i) std::copy(h + p.rows[i] * H, h + (p.rows[i] + 1) * H, x + i * H);
}

void scatter(const Pick& p, const float* y, int64_t H, float* acc) {
  for (size_t i = 0; i < p.rows.size(); ++i) {
    float* a = acc + p.rows[i] * H;
    const float* yi = y + i * H;
    for (int64_t c = 0; c < H; ++c) a[c] += yi[c] * p.scale[i];
  }
}

// acc [B, H] += sigmoid(h . shared_gate) * y, the shared expert's output y [B, H]
void add_shared(const MoeMlp& m, const float* h, int64_t B, int64_t H, const float* y, float* acc) {
  for (int64_t b = 0; b < B; ++b) {
    float g = 0.f;
    for (int64_t c = 0; c < H; ++c) g += h[b * H + c] * m.shared_gate[c];
    g = 1.f / (1.f + std::exp(-g));
    for (int64_t c = 0; c < H; ++c) acc[b * H + c] += g * y[b * H + c];
  }
}

// the picked experts and the shared one, one after another (any Linear: dense float32 experts too)
void experts_each(const MoeMlp& m, const std::vector<Pick>& picks, const float* h, int64_t B, int64_t H, float* acc) {
  const int64_t I = std::max(m.inter, m.shared_inter);
  std::vector<float> x(B * H), gu(B * 2 * I), act(B * I), y(B * H);
  for (const Pick& p : picks) {
    const int64_t n = p.rows.size();
    gather(h, p, H, x.data());
    m.gu[p.e].run(x.data(), n, gu.data());
    silu_mul(gu.data(), n, m.inter, act.data());
    m.down[p.e].run(act.data(), n, y.data());
    scatter(p, y.data(), H, acc);
  }
  if (m.shared_gate) {
    m.shared_gu.run(h, B, gu.data());
    silu_mul(gu.data(), B, m.shared_inter, act.data());
    m.shared_down.run(act.data(), B, y.data());
    add_shared(m, h, B, H, y.data(), acc);
  }
}

bool four_bit(const Linear& l) { return l.w.scalar_type() == at::kByte; }

// the same products as experts_each for low-bit experts, in two parallel regions: every gate_up, then every down
void experts_together(const MoeMlp& m, const std::vector<Pick>& picks, const float* h, int64_t B, int64_t H,
                      float* acc) {
  const int64_t P = picks.size(), J = P + (m.shared_gate ? 1 : 0), I = std::max(m.inter, m.shared_inter);
  std::vector<int64_t> at_(J + 1, 0);  // the first row of each job in the buffers
  for (int64_t j = 0; j < J; ++j) at_[j + 1] = at_[j] + (j < P ? static_cast<int64_t>(picks[j].rows.size()) : B);
  const int64_t n = at_[J];
  thread_local std::vector<Rows> xin, xmid;
  xin.resize(J), xmid.resize(J);
  std::vector<float> x(n * H), gu(n * 2 * I), act(n * I), y(n * H);
  const bool wide = gemv_level() > 0;
  std::vector<LowbitJob> jobs(J);
  auto job = [&](int64_t j) -> std::pair<const Linear*, const Linear*> {
    return j < P ? std::make_pair(&m.gu[picks[j].e], &m.down[picks[j].e])
                 : std::make_pair(&m.shared_gu, &m.shared_down);
  };
  const Rows* all_rows[2] = {nullptr, nullptr};  // h itself rounded (by its codes' width): every expert that every
  for (int64_t j = 0; j < J; ++j) {               // row picked (a decode token's all) reads the same
    const int64_t rows = at_[j + 1] - at_[j];
    const bool four = four_bit(*job(j).first);
    if (rows == B && all_rows[four]) {  // a row picks an expert once: B rows are rows 0 .. B - 1
      jobs[j] = {job(j).first, all_rows[four], rows, gu.data() + at_[j] * 2 * I};
      continue;
    }
    float* xj = x.data() + at_[j] * H;
    j < P ? gather(h, picks[j], H, xj) : (void)std::copy(h, h + B * H, xj);
    round_rows(xj, rows, H, four, xin[j], wide);
    if (rows == B) all_rows[four] = &xin[j];
    jobs[j] = {job(j).first, &xin[j], rows, gu.data() + at_[j] * 2 * I};
  }
  lowbit_jobs(jobs);
  for (int64_t j = 0; j < J; ++j) {
    const int64_t rows = at_[j + 1] - at_[j], width = j < P ? m.inter : m.shared_inter;
    float* aj = act.data() + at_[j] * I;
    silu_mul(gu.data() + at_[j] * 2 * I, rows, width, aj);
    round_rows(aj, rows, width, four_bit(*job(j).second), xmid[j], wide);
    jobs[j] = {job(j).second, &xmid[j], rows, y.data() + at_[j] * H};
  }
  lowbit_jobs(jobs);
  for (int64_t j = 0; j < P; ++j) scatter(picks[j], y.data() + at_[j] * H, H, acc);
  if (m.shared_gate) add_shared(m, h, B, H, y.data() + at_[P] * H, acc);
}

template <bool FOUR, typename S>
void span_of(const LowbitJob& j, int64_t n0, int64_t n1) {
  const Linear& l = *j.lin;
  const S *d = l.scales->data_ptr<S>(), *mins = l.mins ? l.mins->data_ptr<S>() : nullptr;
  lowbit_span<FOUR, S>(*j.xr, j.M, l.in, l.out, l.in / l.scales->size(1), static_cast<const uint8_t*>(l.w.data_ptr()),
                       d, mins, l.sym, j.y, n0, n1);
}

void job_span(const LowbitJob& j, int64_t n0, int64_t n1) {
  const bool four = four_bit(*j.lin), half = j.lin->scales->scalar_type() == at::kHalf;
  if (four)
    half ? span_of<true, at::Half>(j, n0, n1) : span_of<true, float>(j, n0, n1);
  else
    half ? span_of<false, at::Half>(j, n0, n1) : span_of<false, float>(j, n0, n1);
}

}  // namespace

void lowbit_jobs(const std::vector<LowbitJob>& jobs) {
  constexpr int64_t CHUNK_BYTES = 16384;  // of codes: a few dozen rows, many chunks a job for two threads to share
  std::vector<std::array<int64_t, 3>> items;  // job, first row, end row
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Linear& l = *jobs[i].lin;
    const int64_t row_bytes = four_bit(l) ? l.in / 2 : l.in, chunk = std::max<int64_t>(16, CHUNK_BYTES / row_bytes);
    for (int64_t n0 = 0; n0 < l.out; n0 += chunk) items.push_back({static_cast<int64_t>(i), n0, std::min(l.out, n0 + chunk)});
  }
  const int64_t total = items.size(), T = std::min<int64_t>(at::get_num_threads(), total);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, T, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1))
      job_span(jobs[items[i][0]], items[i][1], items[i][2]);
  });
}

// moe_at: each decoder layer's first entry in ws (-1: a dense MLP); syms: the symmetry flags, 2 + 2 E a MoE layer;
// dims: (experts, top_k, renormalise), empty where no layer is MoE
MoeLayers::MoeLayers(c10::List<std::optional<at::Tensor>> ws, std::vector<int64_t> moe_at, std::vector<int64_t> syms,
                     std::vector<int64_t> dims, int64_t hidden)
    : weights(std::move(ws)), layers(moe_at.size()) {
  const bool any = std::any_of(moe_at.begin(), moe_at.end(), [](int64_t a) { return a >= 0; });
  TORCH_CHECK(!any || dims.size() == 3, "moe: dims are (experts, top_k, renormalise)");
  for (int64_t l = 0, n = 0; l < static_cast<int64_t>(moe_at.size()); ++l)
    if (moe_at[l] >= 0)
      layers[l] = read_moe(weights, moe_at[l], syms, n++ * (2 + 2 * dims[0]), dims[0], dims[1], dims[2] != 0, hidden, l);
}

// r [B, H] += the MoE MLP of h [B, H]
void moe_rows(const MoeMlp& m, const float* h, int64_t B, int64_t H, float* r) {
  const int64_t E = m.experts, k = m.top_k;
  std::vector<float> logits(B * E), w(B * k), acc(B * H, 0.f);
  std::vector<int64_t> ids(B * k);
  dense_into(h, B, H, m.router, E, nullptr, logits.data());
  for (int64_t b = 0; b < B; ++b) route_row(logits.data() + b * E, E, k, m.renorm, ids.data() + b * k, w.data() + b * k);
  const std::vector<Pick> picks = picks_of(ids, w, k);
  (m.lowbit ? experts_together : experts_each)(m, picks, h, B, H, acc.data());
  for (int64_t i = 0; i < B * H; ++i) r[i] += acc[i];
}

}  // namespace ninfer
