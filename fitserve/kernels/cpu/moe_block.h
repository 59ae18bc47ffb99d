// fitserve::moe_block_ggml: one token's sparse MoE block without a shared expert in one parallel
// region (decode_moe.h's moe_block at batch 1, a Qwen3-MoE / Mixtral / OLMoE W1 step):
//
//   logits = router @ x      bf16_gemv's rows (dense_row_dot.h), rounded to bf16
//   w, ids = moe_route(logits, k, renormalize)
//   out    = moe_experts_ggml(x, ids, w, gate_up, down, out_x_dtype=true)
//
// the same bits as those three ops called in turn. The threads split the router rows and meet at
// one barrier; then every thread routes, groups and quantizes x itself (the same numbers on each,
// so no second barrier) and runs its whole experts (expert_split); where experts do not split
// evenly, chunk spans with a barrier on each side of the activation quantization. The calling
// thread sums the k rows after the region. NOTE: one region (and one barrier) where the three
// ops took three regions, and routing, x's and the activation's quantization no longer run on
// the calling thread alone between them.
// Included by moe_experts.cpp after moe_experts_ggml.
#pragma once

#include <c10/util/ParallelGuard.h>
#include <omp.h>

#include "dense_row_dot.h"

namespace fitserve::moe {
namespace {

// The router rows [r0, r1) of bf16 [E, H] on x, rounded to bf16 as bf16_gemv rounds them.
void router_rows(const c10::BFloat16* router, const c10::BFloat16* xb, const float* xf,
                 int64_t H, int64_t r0, int64_t r1, c10::BFloat16* logits) {
  for (int64_t r = r0; r < r1; ++r)
    logits[r] = c10::BFloat16(dense::row_dot(router + r * H, xb, xf, H));
}

struct BlockArgs {
  const at::Tensor& x;
  const c10::BFloat16* router;
  const float* xf;
  int64_t E, H, I, k;
  bool renormalize;
  const TypeInfo &tg, &td;
  const uint8_t *gate_up, *down;
  c10::BFloat16* logits;  // [E], shared
  float *act, *y;         // [k, I], [k, H], shared
  const Act& ah;          // over hbuf
  ActBuf& hbuf;
};

// Thread t of P: the whole block but the final sum. Thread 0 returns the routing weights and the
// row of each slot (for combine).
template <class Barrier>
void block_share(const BlockArgs& b, int64_t t, int64_t P, Barrier&& barrier,
                 std::vector<float>* w_out, std::vector<int64_t>* row_of) {
  router_rows(b.router, b.x.data_ptr<c10::BFloat16>(), b.xf, b.H, b.E * t / P,
              b.E * (t + 1) / P, b.logits);
  barrier();
  std::vector<float> w(b.k);
  std::vector<int64_t> ids(b.k);
  route_rows(b.logits, 1, b.E, b.k, b.renormalize, w.data(), ids.data());
  const Groups g = group_slots(ids.data(), b.k, b.k, b.E);
  static thread_local ActBuf tok, xbuf;  // this thread's copy of x's codes
  const Act ax = quantize_x<c10::BFloat16>(b.x, g, b.tg, tok, xbuf);
  const RowList Lg = make_row_list(g, b.gate_up, b.I, b.H / b.tg.block * b.tg.bytes, b.I,
                                   b.tg.gate_up, &ax, b.act);
  const RowList Ld = make_row_list(g, b.down, b.H, b.I / b.td.block * b.td.bytes, 0, b.td.down,
                                   &b.ah, b.y);
  const std::vector<int64_t> split = expert_split(g, Lg.per + Ld.per, P);
  if (!split.empty()) {
    run_expert_share(Lg, Ld, split, t, b.act, b.td, b.hbuf);
  } else {
    const auto [g0, g1] = chunk_span(Lg, t, P);
    run_chunks(Lg, g0, g1);
    barrier();
    quantize_rows(b.act, b.k * t / P, b.k * (t + 1) / P, b.I, b.td.act_block, b.td.perm128,
                  b.hbuf);
    barrier();
    const auto [d0, d1] = chunk_span(Ld, t, P);
    run_chunks(Ld, d0, d1);
  }
  if (t == 0) {
    *w_out = w;
    row_of->assign(b.k, 0);
    for (int64_t m = 0; m < b.k; ++m) (*row_of)[g.order[m]] = m;
  }
}

at::Tensor moe_block_ggml(const at::Tensor& x, const at::Tensor& router, int64_t k,
                          bool renormalize, const at::Tensor& gate_up,
                          const std::string& gate_up_type, const at::Tensor& down,
                          const std::string& down_type) {
  const TypeInfo& tg = type_info(gate_up_type);
  const TypeInfo& td = type_info(down_type);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.size(0) == 1 && x.is_contiguous(),
              "moe_block_ggml: x must be a contiguous bfloat16 [1, H], got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t H = x.size(1), E = gate_up.dim() == 3 ? gate_up.size(0) : 0;
  TORCH_CHECK(router.device().is_cpu() && router.scalar_type() == at::kBFloat16 &&
                  router.is_contiguous() && router.dim() == 2 && router.size(0) == E &&
                  router.size(1) == H,
              "moe_block_ggml: router must be a contiguous bfloat16 [E=", E, ", H=", H,
              "], got ", router.sizes(), " ", router.scalar_type());
  TORCH_CHECK(k >= 1 && k <= E, "moe_block_ggml: k = ", k, " experts of ", E);
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(1) % 2 == 0,
              "moe_block_ggml: gate_up must be [E, 2I, row bytes], got ", gate_up.sizes());
  const int64_t I = gate_up.size(1) / 2;
  check_stack(gate_up, tg, E, 2 * I, H, "gate_up");
  check_stack(down, td, E, H, I, "down");
  static thread_local std::vector<float> act, y, xf;
  static thread_local std::vector<c10::BFloat16> logits;
  static thread_local ActBuf hbuf;
  act.resize(k * I);
  y.resize(k * H);
  logits.resize(E);
  if (!dense::kBf16Dot) {
    xf.resize(H);
    for (int64_t c = 0; c < H; ++c) xf[c] = static_cast<float>(x.data_ptr<c10::BFloat16>()[c]);
  }
  const Act ah = act_buffer(hbuf, k, I, td.act_block);
  const BlockArgs b{x, router.data_ptr<c10::BFloat16>(), xf.data(), E, H, I, k, renormalize,
                    tg, td, gate_up.data_ptr<uint8_t>(), down.data_ptr<uint8_t>(),
                    logits.data(), act.data(), y.data(), ah, hbuf};
  std::vector<float> w;
  std::vector<int64_t> row_of;
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region()) {
    block_share(b, 0, 1, [] {}, &w, &row_of);
  } else {
    // NOTE: OpenMP directly (torch's own runtime: the extension links the libgomp torch
    // loaded) for the barrier; every thread of the team takes part, as in at::parallel_for
#pragma omp parallel
    {
      c10::ParallelGuard guard(true);  // nested at::parallel_for calls run inline
      block_share(b, omp_get_thread_num(), omp_get_num_threads(), [] {
#pragma omp barrier
      }, &w, &row_of);
    }
  }
  at::Tensor out = at::empty({1, H}, x.options());
  combine(y, row_of, w.data(), 1, k, H, out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace
}  // namespace fitserve::moe
