// fitserve::int4_linear / fitserve::int8_linear: y = x @ W^T with W in the packed layout of
// /work/notes/contract_packed.md (fitserve/quant/packed.py), on this CPU's tier (qlinear_simd.h).
//
//   act_quant=True   x quantized once per call to int8 per 32 columns, integer dots
//                    (vpdpbusd on AVX512-VNNI, maddubs on AVX2 / AVX-512), fp32 combine
//   act_quant=False  W dequantized to fp32 (exact) and FMA'd with fp32 x
//
// Which kernel runs for which M: qlinear_run.h. The M > 1 panels read the layout made once at
// load by qlinear_prepack where the weight has it (qlinear_prepack.h); the op signatures are
// unchanged (the weight is found by its qweight tensor). act_quant=True gives row m the same bits
// whatever M (qlinear_rows.h states the order); act_quant=False does with batch_invariant=True
// (register tiles for every M instead of at::mm from kMmMinRows rows on). The result is accumulated in fp32 and rounded
// once (to nearest even) into x's dtype.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "build_tier.h"
#include "qlinear_run.h"

namespace fitserve::qlinear {
namespace {

void check_common(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  int64_t group, int64_t kp) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "qlinear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qlinear: x must be a contiguous [M, K_padded]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "qlinear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(group > 0 && group % 32 == 0, "qlinear: group_size must be a multiple of 32");
  TORCH_CHECK(kp % group == 0, "qlinear: x width ", kp, " is not a multiple of G=", group);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qlinear: qweight must be 2-D");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == qweight.size(0) &&
                  scales.size(1) == kp / group,
              "qlinear: scales must be contiguous float16 [N, K_padded / G]");
}

// fp32 results of a bf16 call land here first (reused: no allocation per decode step).
thread_local std::vector<float> tl_f32_out;
constexpr size_t kKeepFloats = size_t{1} << 22;  // a larger buffer (> 16 MB) is freed after use

void round_into(const float* src, const at::Tensor& out) {
  auto* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, out.numel(), 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = c10::BFloat16(src[i]);  // round to nearest even
  });
}

at::Tensor run(const at::Tensor& x, const QWeight& w, bool int4, bool act_quant,
               bool batch_invariant, const uint8_t* prepacked, const HeldWeight* held = nullptr) {
  const int64_t M = x.size(0), kp = x.size(1);
  at::Tensor out = at::empty({M, w.N}, x.options());
  if (M == 0 || w.N == 0) return out;
  if (kp == 0) return out.zero_();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (held || (act_quant && (M >= kPanelMinRows || !canonical_rows_apply(w)))) {  // panels
    if (bf16)
      panels_int(x.data_ptr<c10::BFloat16>(), M, kp, w, int4, prepacked, held,
                 out.data_ptr<c10::BFloat16>());
    else
      panels_int(x.data_ptr<float>(), M, kp, w, int4, prepacked, held, out.data_ptr<float>());
    return out;
  }
  float* op = bf16 ? scratch(tl_f32_out, M * w.N) : out.data_ptr<float>();
  if (act_quant) {
    if (bf16) rows_int(x.data_ptr<c10::BFloat16>(), M, kp, w, int4, op);
    else rows_int(x.data_ptr<float>(), M, kp, w, int4, op);
  } else if (M >= kMmMinRows && !batch_invariant) {  // at::mm's order depends on M
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    f32_via_mm(w, int4, xf, at::from_blob(op, {M, w.N}, xf.options()));
  } else {
    static thread_local std::vector<float> xbuf;
    const float* xf = bf16 ? nullptr : x.data_ptr<float>();
    if (bf16) {
      float* t = scratch(xbuf, M * kp);
      const auto* xb = x.data_ptr<c10::BFloat16>();
      for (int64_t i = 0; i < M * kp; ++i) t[i] = static_cast<float>(xb[i]);
      xf = t;
    }
    rows_f32(xf, M, kp, w, int4, op);
  }
  if (bf16) {
    round_into(op, out);
    if (tl_f32_out.size() > kKeepFloats) std::vector<float>().swap(tl_f32_out);
  }
  return out;
}

// The weight's prepacked panels where a panel call will read them (held for the call).
at::Tensor prepacked_for(const at::Tensor& x, bool act_quant, const at::Tensor& qweight,
                         const at::Tensor& scales, const at::Tensor* mins, int64_t group,
                         bool int4) {
  if (!act_quant || x.size(0) < kPanelMinRows) return {};  // the rows / fp32 paths
  return PrepackRegistry::get().find(qweight, scales, mins, group, int4);
}

// A weight held as panels (qlinear_held.h): codes [P, nd * kLanes * 4], scales / mins
// [P, G, kLanes] f16. Only the int8-activation kernels read it.
HeldWeight held_weight(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor* mins, int64_t group, bool int4, bool act_quant) {
  constexpr int L = S::kLanes;
  const char* op = int4 ? "int4_linear" : "int8_linear";
  TORCH_CHECK(act_quant, op, ": a weight held as panels runs with int8 activations only "
              "(act_quant=True); hold it row-major for the weight-only kernels");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, K_padded]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              op, ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(group > 0 && group % 32 == 0, op, ": group_size must be a multiple of 32");
  const int64_t kp = x.size(1), row_bytes = int4 ? kp / 2 : kp;
  TORCH_CHECK(kp % group == 0 && row_bytes % 4 == 0, op, ": x width ", kp,
              " is not a multiple of G=", group);
  TORCH_CHECK(codes.is_contiguous() && codes.size(1) == row_bytes * L &&
                  codes.scalar_type() == (int4 ? at::kByte : at::kChar),
              op, ": held codes must be contiguous ", int4 ? "uint8" : "int8", " [P, ",
              row_bytes * L, "] for this tier's ", L, "-row panels, got ", codes.sizes());
  const int64_t P = codes.size(0), G = kp / group;
  const auto check_halves = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 &&
                    t.size(0) == P && t.size(1) == G && t.size(2) == L,
                op, ": held ", what, " must be contiguous float16 [", P, ", ", G, ", ", L, "]");
  };
  check_halves(scales, "scales");
  if (mins) check_halves(*mins, "mins");
  return {static_cast<const uint8_t*>(codes.const_data_ptr()), scales.data_ptr<at::Half>(),
          mins ? mins->data_ptr<at::Half>() : nullptr, P, row_bytes / 4, G, group};
}

at::Tensor run_held(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor* mins, int64_t group, bool int4, bool act_quant) {
  const HeldWeight h = held_weight(x, codes, scales, mins, group, int4, act_quant);
  return run(x, h.shape(), int4, true, false, nullptr, &h);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, int64_t group_size,
                       bool act_quant, bool batch_invariant) {
  const bool has_mins = mins.has_value() && mins->defined();
  if (scales.dim() == 3)
    return run_held(x, qweight, scales, has_mins ? &*mins : nullptr, group_size, true, act_quant);
  const int64_t kp = x.size(-1);
  check_common(x, qweight, scales, group_size, kp);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.size(1) * 2 == kp,
              "int4_linear: qweight must be uint8 [N, K_padded / 2]");
  const bool asym = mins.has_value() && mins->defined();
  if (asym)
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                    mins->sizes() == scales.sizes(),
                "int4_linear: mins must be contiguous float16 shaped like scales");
  const QWeight w{qweight.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                  asym ? mins->data_ptr<at::Half>() : nullptr, qweight.size(0), kp / 2,
                  kp / group_size, group_size};
  const at::Tensor blob = prepacked_for(x, act_quant, qweight, scales, asym ? &*mins : nullptr,
                                        group_size, true);
  return run(x, w, true, act_quant, batch_invariant,
             blob.defined() ? blob.data_ptr<uint8_t>() : nullptr);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t group_size, bool act_quant, bool batch_invariant) {
  if (scales.dim() == 3) return run_held(x, qweight, scales, nullptr, group_size, false, act_quant);
  const int64_t kp = x.size(-1);
  check_common(x, qweight, scales, group_size, kp);
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.size(1) == kp,
              "int8_linear: qweight must be int8 [N, K_padded]");
  const QWeight w{reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()),
                  scales.data_ptr<at::Half>(), nullptr, qweight.size(0), kp, kp / group_size,
                  group_size};
  const at::Tensor blob = prepacked_for(x, act_quant, qweight, scales, nullptr, group_size, false);
  return run(x, w, false, act_quant, batch_invariant,
             blob.defined() ? blob.data_ptr<uint8_t>() : nullptr);
}

// Makes qweight's panels once (qlinear_prepack.h) and registers them, so every later call of
// int4_linear / int8_linear with these tensors reads them; returns the blob, which the caller
// must hold (the registry keeps only weak references). bits: 4 or 8.
at::Tensor qlinear_prepack(const at::Tensor& qweight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, int64_t group_size,
                           int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "qlinear_prepack: bits must be 4 or 8, got ", bits);
  const bool int4 = bits == 4, asym = mins.has_value() && mins->defined();
  const int64_t kp = qweight.size(1) * (int4 ? 2 : 1);
  check_common(at::empty({0, kp}, at::kFloat), qweight, scales, group_size, kp);
  TORCH_CHECK(qweight.scalar_type() == (int4 ? at::kByte : at::kChar),
              "qlinear_prepack: qweight must be ", int4 ? "uint8" : "int8");
  TORCH_CHECK(!asym || (int4 && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                        mins->sizes() == scales.sizes()),
              "qlinear_prepack: mins must be contiguous float16 shaped like scales (int4 only)");
  const QWeight w{static_cast<const uint8_t*>(qweight.const_data_ptr()),
                  scales.data_ptr<at::Half>(), asym ? mins->data_ptr<at::Half>() : nullptr,
                  qweight.size(0), qweight.size(1), kp / group_size, group_size};
  // N rows of panel_row_bytes: the full panels, then the unused tail
  at::Tensor blob =
      at::zeros({w.N * panel_row_bytes(w, int4)}, qweight.options().dtype(at::kByte));
  prepack_panels(w, int4, blob.data_ptr<uint8_t>());
  PrepackRegistry::get().add(qweight, scales, asym ? &*mins : nullptr, group_size, int4, blob);
  return blob;
}

// The row-major weight laid out as held panels (qlinear_held.h): [codes, scales(, mins)], which
// replace qweight / scales / mins in later int4_linear / int8_linear calls. N must be a multiple
// of qlinear_held_layout()[0].
std::vector<at::Tensor> qlinear_hold(const at::Tensor& qweight, const at::Tensor& scales,
                                     const std::optional<at::Tensor>& mins, int64_t group_size,
                                     int64_t bits) {
  constexpr int L = S::kLanes;
  TORCH_CHECK(bits == 4 || bits == 8, "qlinear_hold: bits must be 4 or 8, got ", bits);
  const bool int4 = bits == 4, asym = mins.has_value() && mins->defined();
  const int64_t kp = qweight.size(1) * (int4 ? 2 : 1);
  check_common(at::empty({0, kp}, at::kFloat), qweight, scales, group_size, kp);
  TORCH_CHECK(qweight.scalar_type() == (int4 ? at::kByte : at::kChar),
              "qlinear_hold: qweight must be ", int4 ? "uint8" : "int8");
  TORCH_CHECK(!asym || (int4 && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                        mins->sizes() == scales.sizes()),
              "qlinear_hold: mins must be contiguous float16 shaped like scales (int4 only)");
  TORCH_CHECK(qweight.size(0) % L == 0, "qlinear_hold: ", qweight.size(0),
              " rows are not a multiple of the ", L, "-row panels");
  const QWeight w{static_cast<const uint8_t*>(qweight.const_data_ptr()),
                  scales.data_ptr<at::Half>(), asym ? mins->data_ptr<at::Half>() : nullptr,
                  qweight.size(0), qweight.size(1), kp / group_size, group_size};
  const int64_t P = w.N / L;
  at::Tensor codes = at::empty({P, w.row_bytes * L}, qweight.options());
  at::Tensor sc = at::empty({P, w.ngroups, L}, scales.options());
  at::Tensor mn = asym ? at::empty({P, w.ngroups, L}, scales.options()) : at::Tensor();
  hold_panels(w, int4, static_cast<uint8_t*>(codes.data_ptr()), sc.data_ptr<at::Half>(),
              asym ? mn.data_ptr<at::Half>() : nullptr);
  return asym ? std::vector<at::Tensor>{codes, sc, mn} : std::vector<at::Tensor>{codes, sc};
}

// [rows per panel, whether int8 codes are held + 128 (^ 0x80)]: what reading them back needs.
std::vector<int64_t> qlinear_held_layout() { return {S::kLanes, S::kW8Biased ? 1 : 0}; }

// Whether a panel call with these tensors would read prepacked panels (tests).
bool qlinear_is_prepacked(const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins, int64_t group_size,
                          int64_t bits) {
  const bool asym = mins.has_value() && mins->defined();
  return PrepackRegistry::get()
      .find(qweight, scales, asym ? &*mins : nullptr, group_size, bits == 4)
      .defined();
}

std::string qlinear_tier() { return build_tier_name(); }

// Whether held int4 / int8 weights run on AMX-INT8 tiles from kAmxMinRows rows (qlinear_amx.h):
// compiled for this CPU and granted by the OS. qlinear_set_amx turns the path on / off for later
// calls (benchmarks and tests compare it with the VNNI panels in one process).
bool qlinear_amx_active() {
#if defined(FITSERVE_AMX_INT8)
  return amx_usable();
#else
  return false;
#endif
}
bool qlinear_set_amx(bool on) {
#if defined(FITSERVE_AMX_INT8)
  return amx_set(on);
#else
  (void)on;
  return false;
#endif
}

}  // namespace
}  // namespace fitserve::qlinear

#include "qlinear_held_rows.h"

// NOTE: a FRAGMENT, so other sources (paged_attention.cpp) may add ops to namespace "fitserve".
TORCH_LIBRARY_FRAGMENT(fitserve, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int group_size, "
        "bool act_quant, bool batch_invariant=False) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, int group_size, "
        "bool act_quant, bool batch_invariant=False) -> Tensor");
  m.def("qlinear_tier() -> str", &fitserve::qlinear::qlinear_tier);
  m.def("qlinear_prepack(Tensor qweight, Tensor scales, Tensor? mins, int group_size, int bits) "
        "-> Tensor", &fitserve::qlinear::qlinear_prepack);
  m.def("qlinear_hold(Tensor qweight, Tensor scales, Tensor? mins, int group_size, int bits) "
        "-> Tensor[]", &fitserve::qlinear::qlinear_hold);
  m.def("qlinear_held_layout() -> int[]", &fitserve::qlinear::qlinear_held_layout);
  m.def("qlinear_held_rows(Tensor codes, Tensor scales, Tensor? mins, Tensor ids, int group_size, "
        "int k, ScalarType dtype) -> Tensor");
  m.def("qlinear_amx_active() -> bool", &fitserve::qlinear::qlinear_amx_active);
  m.def("qlinear_set_amx(bool on) -> bool", &fitserve::qlinear::qlinear_set_amx);
  m.def("qlinear_is_prepacked(Tensor qweight, Tensor scales, Tensor? mins, int group_size, "
        "int bits) -> bool", &fitserve::qlinear::qlinear_is_prepacked);
}

// CPU kernels only (no CompositeImplicitAutograd), so torch.compile sees opaque ops with the
// fake kernels registered in qlinear.py.
TORCH_LIBRARY_IMPL(fitserve, CPU, m) {
  m.impl("int4_linear", &fitserve::qlinear::int4_linear);
  m.impl("int8_linear", &fitserve::qlinear::int8_linear);
  m.impl("qlinear_held_rows", &fitserve::qlinear::qlinear_held_rows);
}
