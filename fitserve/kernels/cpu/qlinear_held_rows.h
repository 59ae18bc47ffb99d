// fitserve::qlinear_held_rows: rows `ids` of an int4 / int8 weight held as panels
// (qlinear_held.h: codes [P, nd * kLanes * 4], scales / mins [P, G, kLanes] f16), dequantized
// to float32 and rounded once to the asked dtype: a tied embedding's lookup over its lm_head's
// panels (model/linear.py's PackedEmbedding). The values of fitserve/quant/packed.py's
// dequantize, bit for bit: int4 with mins (s * q) + m, int4 symmetric s * (q - 8), int8 q * s,
// each op one fp32 rounding (rounded() keeps s * q from being contracted into an FMA). One
// token's row took ~54 us as gather_held_rows' and dequantize's torch ops, a few us here.
// Included by qlinear.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <optional>
#include <vector>

#include "fp_rounded.h"

namespace fitserve::qlinear {
namespace {

template <class O>
void held_row(const uint8_t* panel, const at::Half* sc, const at::Half* mn, int64_t li, int64_t L,
              int64_t group, bool int4, bool biased, int64_t k, O* out) {
  for (int64_t c = 0; c < k; ++c) {
    const int64_t g = c / group, p = c % group;
    const int64_t j = int4 ? g * (group / 2) + p % (group / 2) : c;  // byte of the row
    const uint8_t byte = panel[((j / 4) * L + li) * 4 + j % 4];
    float q;
    if (int4) q = static_cast<float>(p < group / 2 ? byte & 0x0F : byte >> 4);
    else q = static_cast<float>(static_cast<int8_t>(biased ? byte ^ 0x80 : byte));
    const float s = static_cast<float>(sc[g * L + li]);
    float v;
    if (mn != nullptr) v = fitserve::rounded(s * q) + static_cast<float>(mn[g * L + li]);
    else if (int4) v = s * (q - 8.f);
    else v = q * s;
    out[c] = static_cast<O>(v);  // one RNE rounding, as .to()
  }
}

}  // namespace

at::Tensor qlinear_held_rows(const at::Tensor& codes, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, const at::Tensor& ids,
                             int64_t group_size, int64_t bits, int64_t k, at::ScalarType dtype) {
  constexpr int64_t L = S::kLanes;
  TORCH_CHECK(bits == 4 || bits == 8, "qlinear_held_rows: bits must be 4 or 8, got ", bits);
  const bool int4 = bits == 4, asym = mins.has_value() && mins->defined();
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.scalar_type() == (int4 ? at::kByte : at::kChar) && codes.size(1) % (4 * L) == 0,
              "qlinear_held_rows: codes must be contiguous ", int4 ? "uint8" : "int8",
              " [P, nd * ", L, " * 4] panels, got ", codes.sizes(), " ", codes.scalar_type());
  const int64_t P = codes.size(0), row_bytes = codes.size(1) / L, kp = row_bytes * (int4 ? 2 : 1);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == P && scales.size(2) == L && scales.size(1) > 0 &&
                  group_size > 0 && scales.size(1) * group_size == kp && group_size % 2 == 0,
              "qlinear_held_rows: scales must be contiguous float16 [", P, ", G, ", L,
              "] with G * group_size = ", kp, ", got ", scales.sizes(), " and group size ",
              group_size);
  TORCH_CHECK(!asym || (int4 && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                        mins->sizes() == scales.sizes()),
              "qlinear_held_rows: mins must be contiguous float16 shaped like scales (int4 only)");
  TORCH_CHECK(k > 0 && k <= kp, "qlinear_held_rows: K=", k, " must be in [1, ", kp, "]");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "qlinear_held_rows: ids must be int64, got ",
              ids.scalar_type());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "qlinear_held_rows: dtype must be float32, bfloat16 or float16, got ", dtype);
  const at::Tensor flat = ids.reshape({-1}).contiguous();
  const int64_t R = flat.numel(), N = P * L, G = scales.size(1);
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK_INDEX(ip[r] >= 0 && ip[r] < N, "qlinear_held_rows: index ", ip[r],
                      " is out of bounds for ", N, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, scales.options().dtype(dtype));
  const uint8_t* cp = static_cast<const uint8_t*>(codes.const_data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = asym ? mins->data_ptr<at::Half>() : nullptr;
  const bool biased = S::kW8Biased;
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t pi = ip[r] / L, li = ip[r] % L;
      const uint8_t* panel = cp + pi * row_bytes * L;
      const at::Half* sc = sp + pi * G * L;
      const at::Half* mn = mp == nullptr ? nullptr : mp + pi * G * L;
      if (dtype == at::kFloat)
        held_row(panel, sc, mn, li, L, group_size, int4, biased, k, out.data_ptr<float>() + r * k);
      else if (dtype == at::kBFloat16)
        held_row(panel, sc, mn, li, L, group_size, int4, biased, k,
                 out.data_ptr<c10::BFloat16>() + r * k);
      else
        held_row(panel, sc, mn, li, L, group_size, int4, biased, k,
                 out.data_ptr<c10::Half>() + r * k);
    }
  });
  return out;
}

}  // namespace fitserve::qlinear
