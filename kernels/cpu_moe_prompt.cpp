// The routed experts of a mixture-of-experts MLP over a prompt's rows in one call: engine/model/moe.py's
// MoEMLP._grouped, the same operations in the same order, without its dozen ATen calls (each a fork and join of
// the threads) per expert and layer. The threads take whole experts in turn; each runs its expert's operations
// alone, inside the parallel region (ATen and oneDNN then run single-threaded), so an expert's weight is dequantized
// into that thread's buffer and multiplied while it is still in the cache.
//
// For an expert picked by n rows: x = h[rows]; gate_up and down as engine/model/linear.Linear computes them for n
// rows: up to `few` rows through lowbit_linear (float32 in and out), more dequantized (dequantize_into) and
// multiplied densely in `dense` (bfloat16: activations rounded, bfloat16 out; or float32); silu(gate) * up between;
// each row's output times its routing weight. A row's outputs are then summed in the order of their experts'
// numbers from zero, as index_add_ over the experts in order sums them.
#include "cpu_kernels.h"

namespace ninfer {

at::Tensor dequantize_into(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                           bool sym, at::Tensor out);  // cpu_native.cpp

namespace {

struct Proj {
  const at::Tensor& codes;
  const at::Tensor& scales;
  const std::optional<at::Tensor>& mins;
  bool sym;
};

// x [n, K] float32 @ W.T -> [n, N] float32, as Linear computes it for n rows; `buf` holds the dense weight
at::Tensor project(const at::Tensor& x, const Proj& w, int64_t few, at::ScalarType dense, at::Tensor& buf) {
  if (x.size(0) <= few) return lowbit_linear(x, w.codes, w.scales, w.mins, w.sym);
  const int64_t N = w.codes.size(0), K = x.size(1);
  if (buf.scalar_type() != dense || buf.numel() < N * K) buf = at::empty({N * K}, x.options().dtype(dense));
  const auto weight = dequantize_into(w.codes, w.scales, w.mins, w.sym, buf.narrow(0, 0, N * K).view({N, K}));
  return at::linear(x.to(dense), weight).to(at::kFloat);
}

void check_expert(const Proj& gu, const Proj& down, int64_t H, int64_t e) {
  check_lowbit(H, gu.codes, gu.scales, gu.mins, gu.sym);
  TORCH_CHECK(gu.codes.size(0) % 2 == 0, "moe_prompt: expert ", e, "'s gate_up has an odd row count");
  check_lowbit(gu.codes.size(0) / 2, down.codes, down.scales, down.mins, down.sym);
  TORCH_CHECK(down.codes.size(0) == H, "moe_prompt: expert ", e, "'s down does not return the hidden size");
}

// the pairs (row t, slot j) of flat ids [P] grouped by expert, in row order within each (a stable counting sort):
// expert e's pairs are pairs[start[e] .. start[e + 1]); order: the picked experts, most pairs first (the threads take
// them in that order, so the last taken are the shortest)
struct Groups {
  std::vector<int64_t> start, pairs, order;
};

Groups group_pairs(const int64_t* id, int64_t P, int64_t E) {
  Groups g;
  g.start.assign(E + 1, 0), g.pairs.resize(P);
  for (int64_t j = 0; j < P; ++j) ++g.start[id[j] + 1];
  for (int64_t e = 0; e < E; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  for (int64_t j = 0; j < P; ++j) g.pairs[fill[id[j]]++] = j;
  for (int64_t e = 0; e < E; ++e)
    if (g.start[e + 1] > g.start[e]) g.order.push_back(e);
  const auto& s = g.start;
  std::stable_sort(g.order.begin(), g.order.end(),
                   [&](int64_t a, int64_t b) { return s[a + 1] - s[a] > s[b + 1] - s[b]; });
  return g;
}

// r [T, H] (zeros) += each row's k pair outputs y [T * k, H], in the order of their experts' numbers
void sum_rows(const float* y, const int64_t* id, int64_t T, int64_t k, int64_t H, float* r) {
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slots(k);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < k; ++j) slots[j] = t * k + j;
      std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
      float* o = r + t * H;
      for (int64_t j : slots)
        for (int64_t c = 0; c < H; ++c) o[c] += y[j * H + c];
    }
  });
}

}  // namespace

// h [T, H] float32; ids [T, k] int64 expert numbers (distinct within a row), weights [T, k] float32; per expert e the
// fused gate_up (codes, scales, mins) [2 I, H] and down [H, I]; returns [T, H] float32
at::Tensor moe_prompt(const at::Tensor& h_, const at::Tensor& ids_, const at::Tensor& weights_,
                      at::TensorList gu_codes, at::TensorList gu_scales,
                      const c10::List<std::optional<at::Tensor>>& gu_mins, bool gu_sym, at::TensorList down_codes,
                      at::TensorList down_scales, const c10::List<std::optional<at::Tensor>>& down_mins, bool down_sym,
                      int64_t few, bool bf16) {
  TORCH_CHECK(h_.dim() == 2 && h_.scalar_type() == at::kFloat, "moe_prompt: h must be float32 [T, H]");
  TORCH_CHECK(ids_.dim() == 2 && ids_.size(0) == h_.size(0) && weights_.sizes() == ids_.sizes() &&
              weights_.scalar_type() == at::kFloat, "moe_prompt: ids and weights must be [T, k] (float32 weights)");
  const int64_t E = gu_codes.size(), T = h_.size(0), k = ids_.size(1), H = h_.size(1);
  TORCH_CHECK(E > 0 && gu_scales.size() == E && gu_mins.size() == static_cast<size_t>(E) && down_codes.size() == E &&
              down_scales.size() == E && down_mins.size() == static_cast<size_t>(E),
              "moe_prompt: every expert needs its gate_up and down operands");
  const auto h = h_.contiguous();
  const auto ids = ids_.to(at::kLong).contiguous();
  const auto weights = weights_.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < T * k; ++j) TORCH_CHECK(id[j] >= 0 && id[j] < E, "moe_prompt: an expert id out of range");
  for (int64_t e = 0; e < E; ++e)
    check_expert({gu_codes[e], gu_scales[e], gu_mins.get(e), gu_sym},
                 {down_codes[e], down_scales[e], down_mins.get(e), down_sym}, H, e);
  const Groups g = group_pairs(id, T * k, E);
  const auto& start = g.start;
  const auto& pairs = g.pairs;
  const auto& order = g.order;
  auto y = at::empty({T * k, H}, h.options());  // each pair's weighted expert output
  const auto dense = bf16 ? at::kBFloat16 : at::kFloat;
  const int64_t threads = at::get_num_threads();
  std::vector<at::Tensor> bufs(threads, at::empty({0}, h.options().dtype(dense)));
  std::atomic<int64_t> next{0};
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the workers take the caller's
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t) {
    c10::InferenceMode guard(inference);
    at::Tensor& buf = bufs[t0];
    for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(order.size()); i = next.fetch_add(1)) {
      const int64_t e = order[i], n = start[e + 1] - start[e];
      const auto sel = at::from_blob(const_cast<int64_t*>(pairs.data() + start[e]), {n}, at::kLong);  // read only
      const auto x = h.index_select(0, at::floor_divide(sel, k));
      const auto gu = project(x, {gu_codes[e], gu_scales[e], gu_mins.get(e), gu_sym}, few, dense, buf);
      const int64_t I = gu.size(1) / 2;
      const auto act = at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
      const auto out = project(act, {down_codes[e], down_scales[e], down_mins.get(e), down_sym}, few, dense, buf);
      const auto scaled = (out * weights.view({-1}).index_select(0, sel).unsqueeze(1)).contiguous();
      const float* sp = scaled.data_ptr<float>();
      for (int64_t r = 0; r < n; ++r) std::copy(sp + r * H, sp + (r + 1) * H, yp + pairs[start[e] + r] * H);
    }
  });
  auto r = at::zeros({T, H}, h.options());
  sum_rows(y.data_ptr<float>(), id, T, k, H, r.data_ptr<float>());
  return r;
}

}  // namespace ninfer

TORCH_LIBRARY_FRAGMENT(ninfer_cpu, m) {
  m.def("moe_prompt(Tensor h, Tensor ids, Tensor weights, Tensor[] gu_codes, Tensor[] gu_scales, Tensor?[] gu_mins, "
        "bool gu_sym, Tensor[] down_codes, Tensor[] down_scales, Tensor?[] down_mins, bool down_sym, int few, "
        "bool bf16) -> Tensor");
  m.impl("moe_prompt", c10::DispatchKey::CPU, &ninfer::moe_prompt);
}
