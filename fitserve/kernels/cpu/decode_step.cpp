// fitserve_step::decode_layers: every decoder layer of a decode-only step in one op call.
//
// It runs exactly the op sequence of fitserve/runner/decode_loop.py (DecodeLoop._python_layers):
//
//   per layer: [add_]rms_norm -> qkv -> rope_write_kv_ -> paged_decode_attention -> o_proj
//              -> add_rms_norm_ -> gate_up -> silu_and_mul -> down
//
// calling the same registered ops (fused_ops.cpp, paged_attention.cpp, qlinear.cpp,
// ggml_blocks.cpp, fp8_gemv.cpp, dense_gemv.cpp, at::linear) with the same arguments, so its
// hidden states are bit-identical to the Python loop's. What it removes is the Python between
// them: at batch 1 a SmolLM2 step is ~270 op calls of a few microseconds of work each, and
// ~4 us of interpreter + binding per call was a quarter of it.
//
// What does not change from step to step (norm weights, linears, KV caches, head shapes) is a
// plan, made once by decode_plan and named by an integer handle. NOTE: passing it as lists
// (~500 tensors + 500 ints for SmolLM2-135M) cost 0.3-0.6 ms of argument conversion per step,
// and a TorchScript custom class ~40 us; an int costs nothing. So decode_layers writes caches
// that are not among its arguments: it is an eager-only op (DecodeLoop), never traced.
//
// Layers with q/k norms (Qwen3, OLMoE) or a sparse MoE block on grouped ggml experts (Qwen3-MoE,
// Mixtral, OLMoE, Qwen2-MoE) take their extras from decode_plan_layers (decode_moe.h).
//
// Each linear is a list of parts whose outputs are concatenated along columns (one part: the
// linear itself; several: a ConcatLinear, e.g. a Q4_K_M qkv whose attn_v is Q6_K). In the flat
// lists decode_plan takes, a linear is meta [parts, part...], each part 5 ints (kind, two
// kind-specific ints, has_mins, has_bias) then 2 strings (ggml: type, "" | fp8: fmt,
// granularity | others: "", ""; each its length, then one int per byte), and kPartTensors
// tensors (weight, scales, mins, bias; absent ones empty). decode_plan parses them once into
// LinearPart lists (parse_linears).
//
// A quantized KV cache (fitserve/quant/kv_cache.py) comes as its codes in k_caches / v_caches,
// its scales in k_scales / v_scales and kv_codec >= 0 (kv_codes.h's ids): each layer then calls
// rope_write_kvq_ (kvq_write.cpp) and paged_decode_attention_kvq, as the Python loop does.
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kvq_prefetch.h"

namespace {

// NOTE: kinds 0-3 keep their numbers; each part's kind says where its bias goes: inside the op
// (dense, bf16 GEMV, fp8: as nn.Linear / DenseLinear / Fp8Linear call it) or added to its output
// afterwards (int4, int8, ggml: PackedLinear / GgmlLinear's `y + bias`).
enum LinearKind : int64_t {
  kDense = 0, kInt4 = 1, kInt8 = 2, kBf16Gemv = 3,
  kGgml = 4,  // fitserve::ggml_matmul (ggml_blocks.cpp), y cast to x's dtype; strings: type
  kFp8 = 5,   // fitserve_fp8::fp8_linear (fp8_gemv.cpp); ints: block; strings: fmt, granularity
};
constexpr size_t kPartTensors = 4;  // weight (q / blocks / codes), scales, mins, bias
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o_proj, gate_up, down

struct LinearPart {
  int64_t kind = kDense, i0 = 0, i1 = 0;  // int4/int8: group, act_quant | fp8: block, -
  at::Tensor w, s;
  std::optional<at::Tensor> mins, bias;
  std::string s0, s1;
};
using Linear = std::vector<LinearPart>;  // outputs concatenated along columns

// The other extensions' ops, looked up on first use (they register when their module loads).
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  static const auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(
      "fitserve_fused::rms_norm");
  return h.call(x, w, eps);
}

at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& w,
                         double eps) {
  static const auto h =
      op<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "fitserve_fused::add_rms_norm_");
  return h.call(residual, x, w, eps);
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  static const auto h = op<at::Tensor(const at::Tensor&)>("fitserve_fused::silu_and_mul");
  return h.call(gate_up);
}

void rope_write_kv_(at::Tensor& qk, const at::Tensor& v, const at::Tensor& positions,
                    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slots, int64_t num_q_heads,
                    bool interleaved) {
  static const auto h =
      op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, int64_t, bool)>(
          "fitserve_fused::rope_write_kv_");
  h.call(qk, v, positions, cos, sin, k_cache, v_cache, slots, num_q_heads, interleaved);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& tables, const at::Tensor& lens, double scale,
                     int64_t window, int64_t partition) {
  static const auto h =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, double, int64_t, int64_t, bool)>(
          "fitserve::paged_decode_attention");
  return h.call(q, k_cache, v_cache, tables, lens, scale, window, partition, true);
}

// The quantized-cache twins of rope_write_kv_ and attention (kvq_write.cpp,
// paged_attention_kvq.cpp).
void rope_write_kvq_(at::Tensor& qk, const at::Tensor& v, const at::Tensor& positions,
                     const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc,
                     at::Tensor& ks, at::Tensor& vs, const at::Tensor& slots, int64_t num_q_heads,
                     bool interleaved, int64_t codec, bool channel_keys) {
  static const auto h =
      op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&,
              const at::Tensor&, int64_t, bool, int64_t, bool)>("fitserve::rope_write_kvq_");
  h.call(qk, v, positions, cos, sin, kc, vc, ks, vs, slots, num_q_heads, interleaved, codec,
         channel_keys);
}

at::Tensor attention_kvq(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                         const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& tables,
                         const at::Tensor& lens, double scale, int64_t window, int64_t codec,
                         bool channel_keys, int64_t partition) {
  static const auto h =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                    int64_t, bool, int64_t, bool)>("fitserve::paged_decode_attention_kvq");
  return h.call(q, kc, vc, ks, vs, tables, lens, scale, window, codec, channel_keys, partition,
                true);
}

// ggml parts side by side, rounded to x's dtype (fitserve::ggml_matmul_parts): the bits of
// GgmlLinear's ggml_matmul(...).to(dtype) per part, concatenated (ConcatLinear)
at::Tensor ggml_parts(const at::Tensor& x, const LinearPart* const* parts, size_t count) {
  static const auto h =
      op<at::Tensor(const at::Tensor&, at::TensorList, at::ArrayRef<std::string>, bool)>(
          "fitserve::ggml_matmul_parts");
  std::vector<at::Tensor> w;
  std::vector<std::string> types;
  for (size_t i = 0; i < count; ++i) {
    w.push_back(parts[i]->w);
    types.push_back(parts[i]->s0);
  }
  return h.call(x.contiguous(), w, types, true);
}

// One part on x [M, K], calling the op its module calls, with the same arguments.
at::Tensor run_part(const at::Tensor& x, const LinearPart& p) {
  at::Tensor y;
  switch (p.kind) {
    case kDense:
      return p.bias ? at::linear(x, p.w, *p.bias) : at::linear(x, p.w);
    case kBf16Gemv: {  // dense bf16, one row (dense_gemv.cpp)
      static const auto h =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>(
              "fitserve_dense::bf16_gemv");
      return h.call(x, p.w, p.bias);
    }
    case kFp8: {
      static const auto h =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const std::string&, const std::string&, int64_t,
                        const std::optional<at::Tensor>&)>("fitserve_fp8::fp8_linear");
      return h.call(x, p.w, p.s, p.s0, p.s1, p.i0, p.bias);
    }
    case kInt4: {
      static const auto h =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const std::optional<at::Tensor>&, int64_t, bool, bool)>(
              "fitserve::int4_linear");
      y = h.call(x.contiguous(), p.w, p.s, p.mins, p.i0, p.i1 == 1, p.i1 == 2);
      break;
    }
    case kInt8: {
      static const auto h =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool,
                        bool)>("fitserve::int8_linear");
      y = h.call(x.contiguous(), p.w, p.s, p.i0, p.i1 == 1, p.i1 == 2);
      break;
    }
    case kGgml: {  // float32 out, cast to x's dtype (GgmlLinear.forward)
      const LinearPart* one = &p;
      y = ggml_parts(x, &one, 1);
      break;
    }
    default:
      TORCH_CHECK(false, "decode_layers: unknown linear kind ", p.kind);
  }
  return p.bias ? at::add(y, *p.bias) : y;
}

// Linear i of the plan on x: its one part, or its parts' outputs concatenated (ConcatLinear).
at::Tensor linear(const at::Tensor& x, const std::vector<Linear>& linears, int64_t i) {
  const Linear& parts = linears[static_cast<size_t>(i)];
  if (parts.size() == 1) return run_part(x, parts[0]);
  std::vector<at::Tensor> outs;
  outs.reserve(parts.size());
  // NOTE: ggml parts without a bias (a Q4_K_M qkv or gate_up): one op, one parallel region at
  // batch 1; the cast is elementwise, so the same bits as casting each part
  if (std::all_of(parts.begin(), parts.end(),
                  [](const LinearPart& p) { return p.kind == kGgml && !p.bias; })) {
    std::vector<const LinearPart*> ptrs;
    for (const LinearPart& p : parts) ptrs.push_back(&p);
    return ggml_parts(x, ptrs.data(), ptrs.size());
  }
  for (const LinearPart& p : parts) outs.push_back(run_part(x, p));
  return at::cat(outs, -1);
}

// The flat lists (see the top of the file) as linears; checks that they are consumed exactly.
std::vector<Linear> parse_linears(at::TensorList t, at::IntArrayRef meta) {
  std::vector<Linear> out;
  size_t mi = 0, ti = 0;
  const auto next = [&]() {
    TORCH_CHECK(mi < meta.size(), "decode_plan: linear meta ends inside a linear");
    return meta[mi++];
  };
  const auto text = [&]() {
    const int64_t len = next();
    TORCH_CHECK(len >= 0 && mi + static_cast<size_t>(len) <= meta.size(),
                "decode_plan: bad string length ", len, " in the linear meta");
    std::string str;
    for (int64_t c = 0; c < len; ++c) str.push_back(static_cast<char>(meta[mi++]));
    return str;
  };
  while (mi < meta.size()) {
    const int64_t parts = next();
    TORCH_CHECK(parts >= 1, "decode_plan: a linear of ", parts, " parts");
    Linear lin;
    for (int64_t j = 0; j < parts; ++j) {
      LinearPart p;
      p.kind = next();
      TORCH_CHECK(p.kind >= kDense && p.kind <= kFp8, "decode_plan: unknown linear kind ", p.kind);
      p.i0 = next();
      p.i1 = next();
      const bool has_mins = next() != 0, has_bias = next() != 0;
      p.s0 = text();
      p.s1 = text();
      TORCH_CHECK(ti + kPartTensors <= t.size(), "decode_plan: linear tensors end inside a part");
      p.w = t[ti];
      p.s = t[ti + 1];
      if (has_mins) p.mins = t[ti + 2];
      if (has_bias) p.bias = t[ti + 3];
      ti += kPartTensors;
      lin.push_back(std::move(p));
    }
    out.push_back(std::move(lin));
  }
  TORCH_CHECK(ti == t.size(), "decode_plan: ", t.size() - ti, " linear tensors left unused");
  return out;
}

}  // namespace

#include "decode_moe.h"

namespace {

struct Plan {
  std::vector<at::Tensor> norms, k_caches, v_caches;
  std::vector<Linear> linears;
  std::vector<double> eps;
  int64_t hq, hkv, hd, partition;
  double scale;
  bool interleaved;
  std::shared_ptr<const LayerExtras> extras;  // q/k norms, MoE blocks (decode_plan_layers)
  std::vector<at::Tensor> k_scales, v_scales;  // a quantized cache's (kv_codec >= 0)
  int64_t kv_codec = -1;
  bool channel_keys = false;
};

std::mutex plans_mutex;
std::unordered_map<int64_t, std::shared_ptr<const Plan>> plans;
int64_t next_plan = 1;

int64_t decode_plan(at::TensorList norms, at::ArrayRef<double> eps, at::TensorList linears,
                    at::IntArrayRef meta, at::TensorList k_caches, at::TensorList v_caches,
                    int64_t hq, int64_t hkv, int64_t hd, double scale, int64_t partition,
                    bool interleaved, at::TensorList k_scales, at::TensorList v_scales,
                    int64_t kv_codec, bool channel_keys) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers,
              "decode_plan: one K and one V cache per layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(eps.size()) == 2 * layers,
              "decode_plan: two norms (input, post-attention) per layer");
  std::vector<Linear> parsed = parse_linears(linears, meta);
  TORCH_CHECK(static_cast<int64_t>(parsed.size()) == kLinearsPerLayer * layers, "decode_plan: ",
              kLinearsPerLayer, " linears per layer, got ", parsed.size(), " for ", layers,
              " layers");
  TORCH_CHECK(kv_codec < 0 || (static_cast<int64_t>(k_scales.size()) == layers &&
                               static_cast<int64_t>(v_scales.size()) == layers),
              "decode_plan: a quantized cache needs one K and one V scale tensor per layer");
  auto plan = std::make_shared<Plan>(Plan{norms.vec(), k_caches.vec(), v_caches.vec(),
                                          std::move(parsed), eps.vec(), hq, hkv, hd, partition,
                                          scale, interleaved});
  plan->k_scales = k_scales.vec();
  plan->v_scales = v_scales.vec();
  plan->kv_codec = kv_codec;
  plan->channel_keys = channel_keys;
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.emplace(next_plan, std::move(plan));
  return next_plan++;
}

// Adds q/k norms and MoE blocks (decode_moe.h's make_layer_extras) to plan `handle`.
void decode_plan_layers(int64_t handle, int64_t qk_norm, at::TensorList qk_norms,
                        at::ArrayRef<double> qk_eps, at::IntArrayRef moe, at::TensorList experts,
                        at::ArrayRef<std::string> expert_types, at::TensorList linears,
                        at::IntArrayRef meta) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  const auto it = plans.find(handle);
  TORCH_CHECK(it != plans.end(), "decode_plan_layers: no decode plan ", handle);
  auto plan = std::make_shared<Plan>(*it->second);
  plan->extras = std::make_shared<const LayerExtras>(make_layer_extras(
      static_cast<int64_t>(plan->k_caches.size()), plan->hq, plan->hkv, qk_norm, qk_norms,
      qk_eps, moe, experts, expert_types, linears, meta));
  it->second = std::move(plan);
}

void drop_decode_plan(int64_t handle) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.erase(handle);
}

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x0, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, int64_t handle, int64_t window) {
  std::shared_ptr<const Plan> plan;
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    const auto it = plans.find(handle);
    TORCH_CHECK(it != plans.end(), "decode_layers: no decode plan ", handle);
    plan = it->second;
  }
  const Plan& p = *plan;
  const at::TensorList norms = p.norms;
  const std::vector<Linear>& linears = p.linears;
  const int64_t layers = static_cast<int64_t>(p.k_caches.size());
  const int64_t hq = p.hq, hkv = p.hkv, hd = p.hd;
  const int64_t n = x0.size(0), qk_cols = (hq + hkv) * hd, q_size = hq * hd;
  const LayerExtras* ex = p.extras.get();
  at::Tensor residual, x = x0;
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor h = l == 0 ? rms_norm(x, norms[0], p.eps[0])
                          : add_rms_norm_(residual, x, norms[2 * l], p.eps[2 * l]);
    if (l == 0) residual = x;
    const int64_t li = l * kLinearsPerLayer;
    if (p.kv_codec >= 0)
      prefetch_write_lines(p.k_caches[l], p.v_caches[l], p.k_scales[l], p.v_scales[l], slots,
                           p.channel_keys);
    const at::Tensor qkv = linear(h, linears, li);
    at::Tensor qk = qkv.narrow(1, 0, qk_cols).view({n, hq + hkv, hd});
    if (ex != nullptr) qk = norm_qk(*ex, l, qkv, qk, hq, q_size, hkv * hd);
    const at::Tensor v = qkv.narrow(1, qk_cols, qkv.size(1) - qk_cols).view({n, hkv, hd});
    at::Tensor kc = p.k_caches[l], vc = p.v_caches[l];
    at::Tensor out;
    if (p.kv_codec >= 0) {
      at::Tensor ks = p.k_scales[l], vs = p.v_scales[l];
      rope_write_kvq_(qk, v, positions, cos, sin, kc, vc, ks, vs, slots, hq, p.interleaved,
                      p.kv_codec, p.channel_keys);
      out = attention_kvq(qk.narrow(1, 0, hq), kc, vc, ks, vs, block_tables, seq_lens, p.scale,
                          window, p.kv_codec, p.channel_keys, p.partition);
    } else {
      rope_write_kv_(qk, v, positions, cos, sin, kc, vc, slots, hq, p.interleaved);
      out = attention(qk.narrow(1, 0, hq), kc, vc, block_tables, seq_lens, p.scale, window,
                      p.partition);
    }
    h = add_rms_norm_(residual, linear(out.reshape({n, q_size}), linears, li + 1),
                      norms[2 * l + 1], p.eps[2 * l + 1]);
    if (ex != nullptr && !ex->moe.empty() && ex->moe[l].is_moe)
      x = moe_block(*ex, ex->moe[l], h);
    else
      x = linear(silu_and_mul(linear(h, linears, li + 2)), linears, li + 3);
  }
  return {residual, x};
}

}  // namespace

// decode_plan / drop_decode_plan take no tensor to dispatch on: plain functions (catch-all)
TORCH_LIBRARY(fitserve_step, m) {
  m.def("decode_plan(Tensor[] norms, float[] eps, Tensor[] linears, int[] meta, "
        "Tensor[] k_caches, Tensor[] v_caches, int num_q_heads, int num_kv_heads, "
        "int head_dim, float scale, int partition_size, bool interleaved, Tensor[] k_scales, "
        "Tensor[] v_scales, int kv_codec, bool channel_keys) -> int",
        &decode_plan);
  m.def("drop_decode_plan(int plan) -> ()", &drop_decode_plan);
  m.def("decode_plan_layers(int plan, int qk_norm, Tensor[] qk_norms, float[] qk_eps, int[] moe, "
        "Tensor[] experts, str[] expert_types, Tensor[] linears, int[] meta) -> ()",
        &decode_plan_layers);
  m.def("decode_layers(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor slots, "
        "Tensor block_tables, Tensor seq_lens, int plan, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fitserve_step, CPU, m) { m.impl("decode_layers", &decode_layers); }
