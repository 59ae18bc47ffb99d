// fitserve::moe_experts_ggml: every active expert of one sparse MoE layer in one call (llama.cpp's
// mul_mat_id, for the gated MLP): y[t] = sum_j w[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]),
// e = ids[t, j], with each expert's weights as stored (GGUF ggml blocks, stacked per projection:
// uint8 [E, rows, row bytes]).
//
//   1. the step's N * k slots (token t, choice j) sorted by expert (a stable counting sort);
//   2. x's N rows quantized once for the gate/up type (ggml_blocks_run.h's quantize), copied
//      into that order (one copy per slot);
//   3. gate_up: every active expert's (gate row n, up row I + n) pairs as one list of chunks
//      streamed with prefetch across expert boundaries (moe_rows.h); each pair runs against
//      the expert's slots in tiles of rows of x (each weight row decoded once per tile) and
//      silu(gate) * up is formed on the tile's results -> act [N * k, I] fp32;
//   4. act quantized for the down type; down streamed the same way -> [N * k, H];
//      3-4 share the threads in one of two ways: whole experts per thread when that splits the
//      cost evenly (batch 1: k / threads experts each; one parallel region, no barrier), else
//      each projection's chunks split by cost (a region each, act quantized in between);
//   5. each token's k rows summed with its routing weights (j = 0 .. k-1) -> out [N, H] fp32
//      (out_x_dtype: rounded once to x's dtype).
// Only the active experts' bytes are read: at batch 1 exactly the k experts' rows. Each output
// is one item's work in one order, so the thread count does not change the bits.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "build_tier.h"
#include "ggml_blocks_iq4.h"
#include "ggml_blocks_q5.h"
#include "moe_route.h"
#include "moe_rows.h"

namespace fitserve::moe {
namespace {

// Thread t's span of one projection's chunks [c0, c1) when the chunks are split over `threads`
// by cost into contiguous spans of whole chunks: at batch 1 a thread streams its share of all k
// experts' rows back to back.
//
//   chunks   |c|c|c|c|c| |c|c|c|c|c| |c|c|c ...
//   threads  [---- thread 0 ----][---- thread 1 ----]  (equal cost: 2 + tokens(e) per chunk)
std::pair<int64_t, int64_t> chunk_span(const RowList& L, int64_t t, int64_t threads) {
  const Groups& g = L.g;
  const int64_t A = static_cast<int64_t>(g.active.size()), chunks = A * L.per;
  std::vector<int64_t> cost_end(A);  // cumulative cost at the end of each expert's chunks
  int64_t total = 0;
  for (int64_t a = 0; a < A; ++a) {
    total += L.per * (2 + g.tokens(g.active[a]));
    cost_end[a] = total;
  }
  // NOTE: a span start at cost c -> the chunk where cost c falls (whole chunks per thread)
  auto chunk_at = [&](int64_t cost) -> int64_t {
    if (cost >= total) return chunks;
    const int64_t a = std::upper_bound(cost_end.begin(), cost_end.end(), cost) - cost_end.begin();
    const int64_t before = a == 0 ? 0 : cost_end[a - 1];
    return a * L.per + (cost - before) / (2 + g.tokens(g.active[a]));
  };
  return {chunk_at(total * t / threads), chunk_at(total * (t + 1) / threads)};
}

// One projection's chunks split by cost over the threads (one parallel region).
void stream_rows(const RowList& L) {
  const int64_t chunks = static_cast<int64_t>(L.g.active.size()) * L.per;
  if (chunks == 0) return;
  const int64_t threads = std::clamp<int64_t>(at::get_num_threads(), 1, chunks);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto [c0, c1] = chunk_span(L, t, threads);
      run_chunks(L, c0, c1);
    }
  });
}

// Whole active experts per thread: split[t] .. split[t + 1] (active indices, contiguous), each
// expert costing (gate/up chunks + down chunks) * (2 + tokens); empty when the most loaded
// thread would carry more than kSplitSlack over an even share (then each projection is split
// by chunks instead, stream_rows).
constexpr double kSplitSlack = 1.05;

std::vector<int64_t> expert_split(const Groups& g, int64_t chunks_per_expert, int64_t threads) {
  const int64_t A = static_cast<int64_t>(g.active.size());
  std::vector<int64_t> cum(A + 1, 0);
  for (int64_t a = 0; a < A; ++a)
    cum[a + 1] = cum[a] + chunks_per_expert * (2 + g.tokens(g.active[a]));
  std::vector<int64_t> split(threads + 1, A);
  split[0] = 0;
  int64_t worst = 0;
  for (int64_t t = 1; t <= threads; ++t) {
    if (t < threads) {  // the expert boundary nearest to an even share
      const double target = static_cast<double>(cum[A]) * t / threads;
      int64_t a = std::lower_bound(cum.begin(), cum.end(), static_cast<int64_t>(target)) -
                  cum.begin();
      if (a > 0 && target - cum[a - 1] < cum[a] - target) --a;
      split[t] = std::max(split[t - 1], a);
    }
    worst = std::max(worst, cum[split[t]] - cum[split[t - 1]]);
  }
  if (static_cast<double>(worst) > kSplitSlack * static_cast<double>(cum[A]) / threads) return {};
  return split;
}

// rows [m0, m1) of x [*, K] quantized into buf (ggml::act_buffer's layout; ggml::quantize's codes)
void quantize_rows(const float* x, int64_t m0, int64_t m1, int64_t K, int64_t block,
                   bool perm128, ActBuf& buf) {
  const int64_t nd = K / block;
  for (int64_t m = m0; m < m1; ++m)
    ggml::quantize_row(x + m * K, K, block, perm128, buf.q.data() + m * K, buf.d.data() + m * nd,
                       buf.s16.data() + m * K / 16, buf.s32.data() + m * K / 32,
                       buf.ds.data() + m * K / 32);
}

struct TypeInfo {
  const char* name;
  int64_t block, bytes, act_block;
  bool perm128;
  RowFn gate_up, down;  // gate_up_rows<T>, down_rows<T> (moe_rows.h)
};

template <class T>
constexpr TypeInfo info(const char* name) {
  return {name, T::kQK, T::kBytes, T::kActBlock, T::kPerm128, &gate_up_rows<T>, &down_rows<T>};
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

// x's N token rows quantized once (into tok), then copied into the step's sorted slot order
// (into buf): a token is quantized once however many of the k experts it picked (same codes).
template <class X>
Act quantize_x(const at::Tensor& x, const Groups& g, const TypeInfo& t, ActBuf& tok,
               ActBuf& buf) {
  const int64_t N = x.size(0), K = x.size(1), M = static_cast<int64_t>(g.token.size());
  const Act a = ggml::quantize(x.data_ptr<X>(), N, K, t.act_block, t.perm128, tok);
  const int64_t nd = a.nd;
  if (static_cast<int64_t>(buf.q.size()) < M * K) buf.q.resize(M * K);
  if (static_cast<int64_t>(buf.d.size()) < M * nd) buf.d.resize(M * nd);
  if (static_cast<int64_t>(buf.ds.size()) < M * K / 32) buf.ds.resize(M * K / 32);
  if (static_cast<int64_t>(buf.s16.size()) < M * K / 16) buf.s16.resize(M * K / 16);
  if (static_cast<int64_t>(buf.s32.size()) < M * K / 32) buf.s32.resize(M * K / 32);
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t s = g.token[m];
      std::copy_n(a.qrow(s), K, buf.q.data() + m * K);
      std::copy_n(a.drow(s), nd, buf.d.data() + m * nd);
      std::copy_n(a.s16row(s), K / 16, buf.s16.data() + m * (K / 16));
      std::copy_n(a.s32row(s), K / 32, buf.s32.data() + m * (K / 32));
      std::copy_n(a.dsrow(s), K / 32, buf.ds.data() + m * (K / 32));
    }
  });
  return {buf.q.data(), buf.d.data(), buf.s16.data(), buf.s32.data(), buf.ds.data(), K, nd};
}

// out[t] = sum over j = 0 .. k-1 of w[t, j] * y[row of slot (t, j)], summed in fp32 from 0 in
// choice order, stored as O (fp32, or rounded once to x's bf16: the same bits as .to())
template <class O>
void combine(const std::vector<float>& y, const std::vector<int64_t>& row_of, const float* wp,
             int64_t N, int64_t k, int64_t H, O* op) {
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / H), [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = wp[t * k + j];
        const float* src = y.data() + row_of[t * k + j] * H;
        for (int64_t c = 0; c < H; ++c) acc[c] += w * src[c];
      }
      std::copy(acc.begin(), acc.end(), op + t * H);
    }
  });
}

// Thread t's whole experts split[t] .. split[t + 1] (expert_split): their gate/up rows (the
// first down rows prefetched as they finish), their activation rows quantized, their down rows.
void run_expert_share(const RowList& Lg, const RowList& Ld, const std::vector<int64_t>& split,
                      int64_t t, const float* act, const TypeInfo& td, ActBuf& hbuf) {
  const Groups& g = Lg.g;
  const int64_t a0 = split[t], a1 = split[t + 1];
  if (a0 == a1) return;
  run_chunks(Lg, a0 * Lg.per, a1 * Lg.per, &Ld, a0 * Ld.per, a1 * Ld.per);
  quantize_rows(act, g.start[g.active[a0]], g.start[g.active[a1 - 1] + 1], Lg.rows,
                td.act_block, td.perm128, hbuf);
  run_chunks(Ld, a0 * Ld.per, a1 * Ld.per);
}

at::Tensor moe_experts_ggml(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                            const at::Tensor& gate_up, const std::string& gate_up_type,
                            const at::Tensor& down, const std::string& down_type,
                            bool out_x_dtype) {
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
  // NOTE: out_x_dtype: the sum rounded straight to x's dtype (decode_layers without a shared
  // expert: no fp32 tensor and .to() call per layer)
  at::Tensor out = at::empty({N, H}, x.options().dtype(out_x_dtype ? x.scalar_type() : at::kFloat));
  if (N == 0) return out;
  if (k == 0) return out.zero_();

  const Groups g = group_slots(ids.data_ptr<int64_t>(), N * k, k, E);
  const int64_t M = N * k;
  // NOTE: scratch reused across calls (a decode step makes one call per layer)
  static thread_local ActBuf buf_tok, buf_x, buf_h;
  static thread_local std::vector<float> act, y;
  act.resize(M * I);
  y.resize(M * H);
  const Act ax = x.scalar_type() == at::kBFloat16 ? quantize_x<c10::BFloat16>(x, g, tg, buf_tok, buf_x)
                                                  : quantize_x<float>(x, g, tg, buf_tok, buf_x);
  const RowList Lg = make_row_list(g, gate_up.data_ptr<uint8_t>(), I, H / tg.block * tg.bytes, I,
                                   tg.gate_up, &ax, act.data());
  const Act ah = act_buffer(buf_h, M, I, td.act_block);
  const RowList Ld = make_row_list(g, down.data_ptr<uint8_t>(), H, I / td.block * td.bytes, 0,
                                   td.down, &ah, y.data());
  const int64_t threads = at::get_num_threads();
  const std::vector<int64_t> split = expert_split(g, Lg.per + Ld.per, threads);
  if (!split.empty()) {
    // NOTE: thread_local scratch is named through these in the region (a worker naming buf_h
    // would get its own)
    ActBuf& hbuf = buf_h;
    const float* act_rows = act.data();
    // NOTE: whole experts per thread (even shares): a thread runs its experts' gate/up, then
    // quantizes their activation rows, then their down rows, so the op is one parallel region
    // with no barrier inside (was: a region per projection, the act quantized in between on the
    // calling thread); its down rows are prefetched while its gate/up rows finish
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) run_expert_share(Lg, Ld, split, t, act_rows, td, hbuf);
    });
  } else {
    stream_rows(Lg);
    ggml::quantize(act.data(), M, I, td.act_block, td.perm128, buf_h);
    stream_rows(Ld);
  }

  // the weighted sum of each token's k rows, in choice order j = 0 .. k-1
  std::vector<int64_t> row_of(M);
  for (int64_t m = 0; m < M; ++m) row_of[g.order[m]] = m;
  const float* wp = weights.data_ptr<float>();
  if (out.scalar_type() == at::kBFloat16)
    combine(y, row_of, wp, N, k, H, out.data_ptr<c10::BFloat16>());
  else
    combine(y, row_of, wp, N, k, H, out.data_ptr<float>());
  if (buf_x.q.size() > (size_t{1} << 24)) buf_x = ActBuf();
  if (buf_tok.q.size() > (size_t{1} << 24)) buf_tok = ActBuf();  // a large prefill's: freed
  if (buf_h.q.size() > (size_t{1} << 24)) buf_h = ActBuf();
  if (y.size() > (size_t{1} << 22)) y = std::vector<float>(), act = std::vector<float>();
  return out;
}

}  // namespace
}  // namespace fitserve::moe

#include "moe_block.h"

namespace fitserve::moe {
namespace {

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
        "str gate_up_type, Tensor down, str down_type, bool out_x_dtype=False) -> Tensor");
  m.def("moe_route(Tensor logits, int k, bool renormalize) -> (Tensor, Tensor)");
  m.def("moe_block_ggml(Tensor x, Tensor router, int k, bool renormalize, Tensor gate_up, "
        "str gate_up_type, Tensor down, str down_type) -> Tensor");
  m.def("moe_experts_types() -> str[]", &fitserve::moe::moe_experts_types);
  m.def("moe_experts_tier() -> str", &fitserve::moe::moe_experts_tier);
}

TORCH_LIBRARY_IMPL(fitserve, CPU, m) {
  m.impl("moe_experts_ggml", &fitserve::moe::moe_experts_ggml);
  m.impl("moe_route", &fitserve::moe::moe_route);
  m.impl("moe_block_ggml", &fitserve::moe::moe_block_ggml);
}
