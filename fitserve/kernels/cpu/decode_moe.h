// decode_step.cpp's per-layer extras: q/k norms and the sparse MoE block, as the module path runs
// them (fitserve/model/llama.py Attention.norm_qk, fitserve/model/moe.py SparseMoeBlock with its
// grouped experts, fitserve/model/moe_experts.py), the same ops in the same order so the hidden
// states are bit-identical.
//
//   q/k norms per head (Qwen3, Qwen3-MoE): RMSNorm.forward on 3-D [N, heads, D] views is
//       fused.rms_norm_reference: weight * rms_norm(x.float(), D, eps).to(dtype), q then k, cat;
//   q/k norms over the projection (OLMoE): fitserve_fused::rms_norm on the 2-D q / k columns, cat;
//   MoE block: router linear -> fitserve::moe_route (softmax, top-k, renormalised when asked;
//       moe.route calls the same op) -> fitserve::moe_experts_ggml (fp32 [N, H]) [-> +=
//       (sigmoid(shared gate) * shared expert).float()] -> .to(dtype); without a shared expert
//       the op rounds to the dtype itself (out_x_dtype: the same bits). One token without a
//       shared expert, its router a bias-free bf16_gemv: fitserve::moe_block_ggml, those three
//       ops in one call with the same bits (moe_block.h).
//
// Included by decode_step.cpp after op(), rms_norm(), silu_and_mul() and linear().
#pragma once

#include <string>
#include <tuple>
#include <vector>

namespace {

enum QkNorm : int64_t { kQkNone = 0, kQkHeads = 1, kQkWhole = 2 };

// One layer's MoE block (grouped ggml experts) or none (is_moe false: the dense gated MLP).
struct MoeLayer {
  bool is_moe = false;
  int64_t top_k = 0;
  bool renormalize = false;
  int64_t router = -1;  // index in LayerExtras::linears; the shared expert's gate_up, down and
  int64_t shared = -1;  // gate at shared, shared + 1, shared + 2 (-1: no shared expert)
  at::Tensor gate_up, down;  // uint8 [E, rows, row bytes], stacked per projection
  std::string gate_up_type, down_type;
};

// The per-layer parts of a plan beyond attention + dense MLP (decode_plan_layers).
struct LayerExtras {
  int64_t qk_norm = kQkNone;
  std::vector<at::Tensor> q_norms, k_norms;  // one each per layer (qk_norm != kQkNone)
  std::vector<double> q_eps, k_eps;
  // kQkHeads with q_eps == k_eps: per layer the q weight repeated over the Hq query heads, then
  // the k weight over the Hkv key heads ([Hq + Hkv, D], see norm_qk); else empty
  std::vector<at::Tensor> qk_weights;
  std::vector<MoeLayer> moe;  // one per layer (empty: every layer dense)
  // router + shared-expert linears, parsed from decode_plan's linear layout (parse_linears;
  // NOTE: read only through extra_linear)
  std::vector<Linear> linears;
};

at::Tensor extra_linear(const LayerExtras& e, const at::Tensor& x, int64_t i) {
  return linear(x, e.linears, i);
}

// fitserve.kernels.cpu.fused.rms_norm_reference on x [N, H, D] (fitserve_fused::rms_norm_heads,
// fused_ops.cpp: the ATen composite's bits in one pass)
at::Tensor rms_norm_heads(const at::Tensor& x, const at::Tensor& w, double eps) {
  static const auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(
      "fitserve_fused::rms_norm_heads");
  return h.call(x, w, eps);
}

// Attention.norm_qk: qk [N, Hq+Hkv, D] (a view of qkv) -> the normed copy (or qk untouched).
at::Tensor norm_qk(const LayerExtras& e, int64_t l, const at::Tensor& qkv, const at::Tensor& qk,
                   int64_t hq, int64_t q_size, int64_t kv_size) {
  if (e.qk_norm == kQkHeads && !e.qk_weights.empty()) {
    // NOTE: one normalisation over all Hq + Hkv heads: each head's row is normed on its own
    // (the same bits as the q and k halves apart), and the product with the repeated weights
    // is the same elementwise product as the broadcast one; one op instead of 11 + cat
    return rms_norm_heads(qk, e.qk_weights[l], e.q_eps[l]);
  }
  if (e.qk_norm == kQkHeads) {
    const int64_t heads = qk.size(1);
    return at::cat({rms_norm_heads(qk.narrow(1, 0, hq), e.q_norms[l], e.q_eps[l]),
                    rms_norm_heads(qk.narrow(1, hq, heads - hq), e.k_norms[l], e.k_eps[l])},
                   1);
  }
  if (e.qk_norm == kQkWhole) {
    return at::cat({rms_norm(qkv.narrow(1, 0, q_size), e.q_norms[l], e.q_eps[l]),
                    rms_norm(qkv.narrow(1, q_size, kv_size), e.k_norms[l], e.k_eps[l])},
                   1)
        .view(qk.sizes());
  }
  return qk;
}

at::Tensor moe_experts_ggml(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                            const at::Tensor& gate_up, const std::string& gate_up_type,
                            const at::Tensor& down, const std::string& down_type,
                            bool out_x_dtype) {
  static const auto h =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const std::string&, const at::Tensor&, const std::string&, bool)>(
          "fitserve::moe_experts_ggml");
  return h.call(x, ids, weights, gate_up, gate_up_type, down, down_type, out_x_dtype);
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t k, bool renorm) {
  static const auto h = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, bool)>(
      "fitserve::moe_route");
  return h.call(logits, k, renorm);
}

at::Tensor moe_block_ggml(const at::Tensor& x, const at::Tensor& router, int64_t k, bool renorm,
                          const at::Tensor& gate_up, const std::string& gate_up_type,
                          const at::Tensor& down, const std::string& down_type) {
  static const auto h =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool, const at::Tensor&,
                    const std::string&, const at::Tensor&, const std::string&)>(
          "fitserve::moe_block_ggml");
  return h.call(x, router, k, renorm, gate_up, gate_up_type, down, down_type);
}

// The router's weight when one token's block can run as fitserve::moe_block_ggml (the router a
// bias-free bf16_gemv, no shared expert: the same ops it fuses), else nullptr.
const at::Tensor* fused_router(const LayerExtras& e, const MoeLayer& m, const at::Tensor& h) {
  const Linear& router = e.linears[static_cast<size_t>(m.router)];
  if (m.shared >= 0 || h.size(0) != 1 || h.scalar_type() != at::kBFloat16 || router.size() != 1 ||
      router[0].kind != kBf16Gemv || router[0].bias)
    return nullptr;
  return &router[0].w;
}

// SparseMoeBlock.forward on h [N, H] with its experts grouped (moe.route, GroupedExperts.__call__)
at::Tensor moe_block(const LayerExtras& e, const MoeLayer& m, const at::Tensor& h) {
  // NOTE: one token: router, routing and experts in one op (one parallel region, not three)
  if (const at::Tensor* router = fused_router(e, m, h))
    return moe_block_ggml(h.contiguous(), *router, m.top_k, m.renormalize, m.gate_up,
                          m.gate_up_type, m.down, m.down_type);
  auto [weights, ids] = moe_route(extra_linear(e, h, m.router), m.top_k, m.renormalize);
  if (m.shared < 0)  // the sum rounded to h's dtype in the op (the same bits as .to())
    return moe_experts_ggml(h.contiguous(), ids, weights, m.gate_up, m.gate_up_type, m.down,
                            m.down_type, true);
  at::Tensor out = moe_experts_ggml(h.contiguous(), ids, weights, m.gate_up, m.gate_up_type,
                                    m.down, m.down_type, false);
  // Qwen2-MoE: sigmoid(shared_expert_gate(h)) * shared_expert(h)
  const at::Tensor gate = at::sigmoid(extra_linear(e, h, m.shared + 2));
  const at::Tensor up = silu_and_mul(extra_linear(e, h, m.shared));
  const at::Tensor shared = extra_linear(e, up, m.shared + 1);
  out += (gate * shared).to(at::kFloat);
  return out.to(h.scalar_type());
}

// decode_plan_layers' arguments (and the plan's head counts hq, hkv) -> LayerExtras. moe:
// kMoeInts per layer (is_moe, top_k, renormalize, has_shared); experts: gate_up and down stacks
// per MoE layer; types: their ggml type names; linears/meta: per MoE layer its router, then
// (has_shared) the shared expert's gate_up, down and gate, in linear()'s layout.
constexpr int64_t kMoeInts = 4;

LayerExtras make_layer_extras(int64_t layers, int64_t hq, int64_t hkv, int64_t qk_norm,
                              at::TensorList qk_norms,
                              at::ArrayRef<double> qk_eps, at::IntArrayRef moe,
                              at::TensorList experts, at::ArrayRef<std::string> types,
                              at::TensorList linears, at::IntArrayRef meta) {
  LayerExtras e;
  TORCH_CHECK(qk_norm >= kQkNone && qk_norm <= kQkWhole, "decode_plan_layers: qk_norm ", qk_norm);
  e.qk_norm = qk_norm;
  if (qk_norm != kQkNone) {
    TORCH_CHECK(static_cast<int64_t>(qk_norms.size()) == 2 * layers &&
                    static_cast<int64_t>(qk_eps.size()) == 2 * layers,
                "decode_plan_layers: a q and a k norm per layer");
    for (int64_t l = 0; l < layers; ++l) {
      e.q_norms.push_back(qk_norms[2 * l]);
      e.k_norms.push_back(qk_norms[2 * l + 1]);
      e.q_eps.push_back(qk_eps[2 * l]);
      e.k_eps.push_back(qk_eps[2 * l + 1]);
    }
    if (qk_norm == kQkHeads && hq > 0 && hkv > 0 && e.q_eps == e.k_eps) {
      for (int64_t l = 0; l < layers; ++l)
        e.qk_weights.push_back(at::cat({e.q_norms[l].expand({hq, e.q_norms[l].size(-1)}),
                                        e.k_norms[l].expand({hkv, e.k_norms[l].size(-1)})}, 0)
                                   .contiguous());
    }
  }
  e.linears = parse_linears(linears, meta);
  if (moe.empty()) return e;
  TORCH_CHECK(static_cast<int64_t>(moe.size()) == kMoeInts * layers,
              "decode_plan_layers: ", kMoeInts, " MoE ints per layer");
  int64_t next_linear = 0, next_expert = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* m = moe.data() + l * kMoeInts;
    MoeLayer ml;
    if (m[0] != 0) {
      TORCH_CHECK(next_expert + 2 <= static_cast<int64_t>(experts.size()) &&
                      next_expert + 2 <= static_cast<int64_t>(types.size()),
                  "decode_plan_layers: two expert stacks and types per MoE layer");
      ml = MoeLayer{true, m[1], m[2] != 0, next_linear, m[3] != 0 ? next_linear + 1 : -1,
                    experts[next_expert], experts[next_expert + 1], types[next_expert],
                    types[next_expert + 1]};
      next_expert += 2;
      next_linear += m[3] != 0 ? 4 : 1;
    }
    e.moe.push_back(std::move(ml));
  }
  TORCH_CHECK(next_expert == static_cast<int64_t>(experts.size()),
              "decode_plan_layers: more expert stacks than MoE layers");
  TORCH_CHECK(static_cast<int64_t>(e.linears.size()) == next_linear,
              "decode_plan_layers: ", next_linear, " router / shared-expert linears expected");
  return e;
}

}  // namespace
