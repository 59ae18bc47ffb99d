// fitserve_step::decode_layers: every decoder layer of a decode-only step in one op call.
//
// It runs exactly the op sequence of fitserve/runner/decode_loop.py (DecodeLoop._python_layers):
//
//   per layer: [add_]rms_norm -> qkv -> rope_write_kv_ -> paged_decode_attention -> o_proj
//              -> add_rms_norm_ -> gate_up -> silu_and_mul -> down
//
// calling the same registered ops (fused_ops.cpp, paged_attention.cpp, qlinear.cpp, at::linear)
// with the same arguments, so its hidden states are bit-identical to the Python loop's. What it
// removes is the Python between them: at batch 1 a SmolLM2 step is ~270 op calls of a few
// microseconds of work each, and ~4 us of interpreter + binding per call was a quarter of it.
//
// What does not change from step to step (norm weights, linears, KV caches, head shapes) is a
// plan, made once by decode_plan and named by an integer handle. NOTE: passing it as lists
// (~500 tensors + 500 ints for SmolLM2-135M) cost 0.3-0.6 ms of argument conversion per step,
// and a TorchScript custom class ~40 us; an int costs nothing. So decode_layers writes caches
// that are not among its arguments: it is an eager-only op (DecodeLoop), never traced.
//
// A quantized KV cache (fitserve/quant/kv_cache.py) comes as its codes in k_caches / v_caches,
// its scales in k_scales / v_scales and kv_codec >= 0 (kv_codes.h's ids): each layer then calls
// rope_write_kvq_ (kvq_write.cpp) and paged_decode_attention_kvq, as the Python loop does.
//
// Linears come as 3 tensors + 4 ints each (kLinearMeta): kind (dense / int4 / int8 / dense bf16
// GEMV), group size, act_quant, and whether the third tensor is present (dense: bias; int4:
// mins).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

enum LinearKind : int64_t { kDense = 0, kInt4 = 1, kInt8 = 2, kBf16Gemv = 3 };
constexpr int64_t kLinearMeta = 4;      // kind, group, act_quant (2: weight-only, batch invariant), has_third
constexpr int64_t kLinearTensors = 3;   // dense: weight, bias | int4: q, scales, mins | int8: q, scales, -
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o_proj, gate_up, down

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

at::Tensor linear(const at::Tensor& x, at::TensorList t, at::IntArrayRef meta, int64_t i) {
  const at::Tensor* ts = t.data() + i * kLinearTensors;
  const int64_t* m = meta.data() + i * kLinearMeta;
  const bool third = m[3] != 0;
  switch (m[0]) {
    case kDense:
      return third ? at::linear(x, ts[0], ts[2]) : at::linear(x, ts[0]);
    case kInt4: {
      static const auto h =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const std::optional<at::Tensor>&, int64_t, bool, bool)>(
              "fitserve::int4_linear");
      const std::optional<at::Tensor> mins = third ? std::optional<at::Tensor>(ts[2]) : std::nullopt;
      return h.call(x.contiguous(), ts[0], ts[1], mins, m[1], m[2] == 1, m[2] == 2);
    }
    case kInt8: {
      static const auto h =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool,
                        bool)>("fitserve::int8_linear");
      return h.call(x.contiguous(), ts[0], ts[1], m[1], m[2] == 1, m[2] == 2);
    }
    case kBf16Gemv: {  // dense bf16, one row (dense_gemv.cpp)
      static const auto h =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>(
              "fitserve_dense::bf16_gemv");
      return h.call(x, ts[0], third ? std::optional<at::Tensor>(ts[2]) : std::nullopt);
    }
  }
  TORCH_CHECK(false, "decode_layers: unknown linear kind ", m[0]);
}

struct Plan {
  std::vector<at::Tensor> norms, linears, k_caches, v_caches;
  std::vector<double> eps;
  std::vector<int64_t> meta;
  int64_t hq, hkv, hd, partition;
  double scale;
  bool interleaved;
  std::vector<at::Tensor> k_scales, v_scales;  // a quantized cache's (kv_codec >= 0)
  int64_t kv_codec;
  bool channel_keys;
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
  TORCH_CHECK(static_cast<int64_t>(linears.size()) == kLinearsPerLayer * kLinearTensors * layers &&
                  static_cast<int64_t>(meta.size()) == kLinearsPerLayer * kLinearMeta * layers,
              "decode_plan: ", kLinearsPerLayer, " linears of ", kLinearTensors,
              " tensors and ", kLinearMeta, " ints per layer");
  TORCH_CHECK(kv_codec < 0 || (static_cast<int64_t>(k_scales.size()) == layers &&
                               static_cast<int64_t>(v_scales.size()) == layers),
              "decode_plan: a quantized cache needs one K and one V scale tensor per layer");
  auto plan = std::make_shared<Plan>(Plan{
      norms.vec(), linears.vec(), k_caches.vec(), v_caches.vec(), eps.vec(), meta.vec(), hq,
      hkv, hd, partition, scale, interleaved, k_scales.vec(), v_scales.vec(), kv_codec,
      channel_keys});
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.emplace(next_plan, std::move(plan));
  return next_plan++;
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
  const at::TensorList norms = p.norms, linears = p.linears;
  const at::IntArrayRef meta = p.meta;
  const int64_t layers = static_cast<int64_t>(p.k_caches.size());
  const int64_t hq = p.hq, hkv = p.hkv, hd = p.hd;
  const int64_t n = x0.size(0), qk_cols = (hq + hkv) * hd, q_size = hq * hd;
  at::Tensor residual, x = x0;
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor h = l == 0 ? rms_norm(x, norms[0], p.eps[0])
                          : add_rms_norm_(residual, x, norms[2 * l], p.eps[2 * l]);
    if (l == 0) residual = x;
    const int64_t li = l * kLinearsPerLayer;
    const at::Tensor qkv = linear(h, linears, meta, li);
    at::Tensor qk = qkv.narrow(1, 0, qk_cols).view({n, hq + hkv, hd});
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
    h = add_rms_norm_(residual, linear(out.reshape({n, q_size}), linears, meta, li + 1),
                      norms[2 * l + 1], p.eps[2 * l + 1]);
    x = linear(silu_and_mul(linear(h, linears, meta, li + 2)), linears, meta, li + 3);
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
  m.def("decode_layers(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor slots, "
        "Tensor block_tables, Tensor seq_lens, int plan, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fitserve_step, CPU, m) { m.impl("decode_layers", &decode_layers); }
