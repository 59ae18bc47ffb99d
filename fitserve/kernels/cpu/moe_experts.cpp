// fitserve::moe_experts_ggml: every active expert of one sparse MoE layer in one call (llama.cpp's
// mul_mat_id, for the gated MLP): y[t] = sum_j w[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]),
// e = ids[t, j], with each expert's weights as stored (GGUF ggml blocks, stacked per projection:
// uint8 [E, rows, row bytes]).
//
//   1. the step's N * k slots (token t, choice j) sorted by expert (a stable counting sort);
//   2. x's rows quantized in that order for the gate/up type (ggml_blocks_run.h's quantize);
//   3. gate_up: (active expert, block of rows) items, claimed by the threads one at a time,
//      each runs its rows against the expert's slots (rows_range: tiles of rows of x, each weight
//      row decoded once per tile) -> h [N * k, 2I] fp32;
//   4. silu(gate) * up in fp32, quantized for the down type; down the same way -> [N * k, H];
//   5. each token's k rows summed with its routing weights (j = 0 .. k-1) -> out [N, H] fp32.
// Only the active experts' bytes are read: at batch 1 exactly the k experts' rows. Each output
// is one item's work in one order, so the thread count does not change the bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "build_tier.h"
#include "ggml_blocks_iq4.h"
#include "ggml_blocks_kquant.h"
#include "ggml_blocks_q5.h"
#include "ggml_blocks_run.h"

namespace fitserve::moe {
namespace {

using ggml::Act;
using ggml::ActBuf;

// The step's slots grouped by expert: sorted row m holds slot order[m] (= t * k + j); expert
// e's rows are [start[e], start[e + 1]); active = the experts with at least one slot.
struct Groups {
  std::vector<int64_t> start, order, token, active;
};

Groups group_slots(const int64_t* ids, int64_t slots, int64_t k, int64_t E) {
  Groups g;
  g.start.assign(E + 1, 0);
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < E, "moe_experts_ggml: expert id ", ids[s],
                " out of range [0, ", E, ")");
    ++g.start[ids[s] + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    if (g.start[e + 1] > 0) g.active.push_back(e);
    g.start[e + 1] += g.start[e];
  }
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  g.order.resize(slots);
  g.token.resize(slots);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t m = fill[ids[s]]++;
    g.order[m] = s;
    g.token[m] = s / k;
  }
  return g;
}

// fn(e, n0, n1) for every (active expert e, block [n0, n1) of its `rows` weight rows); the
// threads claim the items one at a time (experts with many tokens cost more than others).
template <class F>
void for_items(const std::vector<int64_t>& active, int64_t rows, F&& fn) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t total_rows = static_cast<int64_t>(active.size()) * rows;
  // NOTE: 4..32 rows per item (a multiple of 4), >= 8 items per thread where the rows allow
  const int64_t nb = std::clamp<int64_t>(total_rows / (8 * threads) / 4 * 4, 4, 32);
  const int64_t per = (rows + nb - 1) / nb;
  const int64_t items = static_cast<int64_t>(active.size()) * per;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t n0 = (i % per) * nb;
      fn(active[i / per], n0, std::min(rows, n0 + nb));
    }
  });
}

// out[m, n] (m a sorted row, n < rows) = the dot of expert e's weight row n with sorted row m
// of the activations, for every active expert's rows; W = the stacked [E, rows, row bytes].
template <class T>
void experts_matmul(const Act& a, const Groups& g, const uint8_t* W, int64_t rows,
                    float* out) {
  const int64_t nblk = a.K / T::kQK, row_bytes = nblk * T::kBytes;
  for_items(g.active, rows, [&](int64_t e, int64_t n0, int64_t n1) {
    ggml::rows_range<T>(W + e * rows * row_bytes, row_bytes, nblk, a, g.start[e],
                        g.start[e + 1], n0, n1, rows, out);
  });
}

struct TypeInfo {
  const char* name;
  int64_t block, bytes, act_block;
  bool perm128;
  void (*matmul)(const Act&, const Groups&, const uint8_t*, int64_t, float*);
};

template <class T>
constexpr TypeInfo info(const char* name) {
  return {name, T::kQK, T::kBytes, T::kActBlock, T::kPerm128, &experts_matmul<T>};
}

const TypeInfo kTypes[] = {
    info<ggml::Q4K>("Q4_K"),     info<ggml::Q5K>("Q5_K"),  info<ggml::Q6K>("Q6_K"),
    info<ggml::Q5_0>("Q5_0"),    info<ggml::Q5_1>("Q5_1"), info<ggml::IQ4NL>("IQ4_NL"),
    info<ggml::IQ4XS>("IQ4_XS"),
};

const TypeInfo& type_info(const std::string& name) {
  for (const TypeInfo& t : kTypes)
    if (name == t.name) return t;
  TORCH_CHECK(false, "moe_experts_ggml: no kernel for GGML type ", name);
}

void check_stack(const at::Tensor& w, const TypeInfo& t, int64_t E, int64_t rows, int64_t cols,
                 const char* what) {
  TORCH_CHECK(cols > 0 && cols % t.block == 0, "moe_experts_ggml: ", what, " has ", cols,
              " columns, not a multiple of ", t.name, "'s block size ", t.block);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.dim() == 3 && w.size(0) == E && w.size(1) == rows &&
                  w.size(2) == cols / t.block * t.bytes,
              "moe_experts_ggml: ", what, " must be contiguous uint8 [E=", E, ", ", rows, ", ",
              cols / t.block * t.bytes, "] of ", t.name, ", got ", w.sizes(), " ",
              w.scalar_type());
}

template <class X>
Act quantize_x(const at::Tensor& x, const Groups& g, const TypeInfo& t, ActBuf& buf) {
  return ggml::quantize(x.data_ptr<X>(), static_cast<int64_t>(g.token.size()), x.size(1),
                        t.act_block, t.perm128, buf, g.token.data());
}

// silu(h[:, :I]) * h[:, I:] in fp32 (h [M, 2I]) -> act [M, I]
void silu_and_mul(const float* h, int64_t M, int64_t I, float* act) {
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* gate = h + m * 2 * I;
      const float* up = gate + I;
      float* o = act + m * I;
      for (int64_t i = 0; i < I; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
}

at::Tensor moe_experts_ggml(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                            const at::Tensor& gate_up, const std::string& gate_up_type,
                            const at::Tensor& down, const std::string& down_type) {
  const TypeInfo& tg = type_info(gate_up_type);
  const TypeInfo& td = type_info(down_type);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts_ggml: x must be a contiguous float32 / bfloat16 [N, H], got ",
              x.sizes(), " ", x.scalar_type());
  const int64_t N = x.size(0), H = x.size(1);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == N &&
                  ids.is_contiguous(),
              "moe_experts_ggml: ids must be contiguous int64 [N=", N, ", k], got ", ids.sizes(),
              " ", ids.scalar_type());
  const int64_t k = ids.size(1), E = gate_up.dim() == 3 ? gate_up.size(0) : 0;
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                  weights.sizes() == ids.sizes(),
              "moe_experts_ggml: weights must be contiguous float32 [N, k] like ids, got ",
              weights.sizes(), " ", weights.scalar_type());
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(1) % 2 == 0,
              "moe_experts_ggml: gate_up must be [E, 2I, row bytes], got ", gate_up.sizes());
  const int64_t I = gate_up.size(1) / 2;
  check_stack(gate_up, tg, E, 2 * I, H, "gate_up");
  check_stack(down, td, E, H, I, "down");
  at::Tensor out = at::zeros({N, H}, x.options().dtype(at::kFloat));
  if (N == 0 || k == 0) return out;

  const Groups g = group_slots(ids.data_ptr<int64_t>(), N * k, k, E);
  const int64_t M = N * k;
  static thread_local ActBuf buf_x, buf_h;
  const Act ax = x.scalar_type() == at::kBFloat16 ? quantize_x<c10::BFloat16>(x, g, tg, buf_x)
                                                  : quantize_x<float>(x, g, tg, buf_x);
  at::Tensor h = at::empty({M, 2 * I}, out.options());
  tg.matmul(ax, g, gate_up.data_ptr<uint8_t>(), 2 * I, h.data_ptr<float>());
  at::Tensor act = at::empty({M, I}, out.options());
  silu_and_mul(h.data_ptr<float>(), M, I, act.data_ptr<float>());
  const Act ah = ggml::quantize(act.data_ptr<float>(), M, I, td.act_block, td.perm128, buf_h);
  at::Tensor y = at::empty({M, H}, out.options());
  td.matmul(ah, g, down.data_ptr<uint8_t>(), H, y.data_ptr<float>());

  // the weighted sum of each token's k rows, in choice order j = 0 .. k-1
  std::vector<int64_t> row_of(M);
  for (int64_t m = 0; m < M; ++m) row_of[g.order[m]] = m;
  const float* yp = y.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const float w = wp[t * k + j];
        const float* src = yp + row_of[t * k + j] * H;
        float* dst = op + t * H;
        for (int64_t c = 0; c < H; ++c) dst[c] += w * src[c];
      }
  });
  if (buf_x.q.size() > (size_t{1} << 24)) buf_x = ActBuf();  // a large prefill's: freed
  if (buf_h.q.size() > (size_t{1} << 24)) buf_h = ActBuf();
  return out;
}

std::vector<std::string> moe_experts_types() {
  std::vector<std::string> v;
  for (const TypeInfo& t : kTypes) v.emplace_back(t.name);
  return v;
}

std::string moe_experts_tier() { return build_tier_name(); }

}  // namespace
}  // namespace fitserve::moe

TORCH_LIBRARY_FRAGMENT(fitserve, m) {
  m.def("moe_experts_ggml(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, "
        "str gate_up_type, Tensor down, str down_type) -> Tensor");
  m.def("moe_experts_types() -> str[]", &fitserve::moe::moe_experts_types);
  m.def("moe_experts_tier() -> str", &fitserve::moe::moe_experts_tier);
}

TORCH_LIBRARY_IMPL(fitserve, CPU, m) {
  m.impl("moe_experts_ggml", &fitserve::moe::moe_experts_ggml);
}
