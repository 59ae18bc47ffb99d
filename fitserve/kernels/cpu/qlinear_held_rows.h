// fitserve::qlinear_held_rows: rows `ids` of an int4 / int8 weight held as panels
// (qlinear_held.h: codes [P, nd * kLanes * 4], scales / mins [P, G, kLanes] f16), dequantized
// (row_lookup.h rounds them once to the asked dtype): a tied embedding's lookup over its
// lm_head's panels (model/linear.py's PackedEmbedding). The values of fitserve/quant/packed.py's
// dequantize, bit for bit: int4 with mins (s * q) + m, int4 symmetric s * (q - 8), int8 q * s,
// each op one fp32 rounding (rounded() keeps s * q from being contracted into an FMA). One
// token's row took ~54 us as gather_held_rows' and dequantize's torch ops, ~13 us as one call.
// Included by qlinear.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "fp_rounded.h"
#include "row_lookup.h"

namespace fitserve::qlinear {
namespace {

// row li of a panel (its codes, and its group's scales / mins at [g * L + li]) -> out[0, k)
void held_row(const uint8_t* panel, const at::Half* sc, const at::Half* mn, int64_t li, int64_t L,
              int64_t group, bool int4, bool biased, int64_t k, float* out) {
  for (int64_t c = 0; c < k; ++c) {
    const int64_t g = c / group, p = c % group;
    const int64_t j = int4 ? g * (group / 2) + p % (group / 2) : c;  // byte of the row
    const uint8_t byte = panel[((j / 4) * L + li) * 4 + j % 4];
    float q;
    if (int4) q = static_cast<float>(p < group / 2 ? byte & 0x0F : byte >> 4);
    else q = static_cast<float>(static_cast<int8_t>(biased ? byte ^ 0x80 : byte));
    const float s = static_cast<float>(sc[g * L + li]);
    if (mn != nullptr) out[c] = fitserve::rounded(s * q) + static_cast<float>(mn[g * L + li]);
    else if (int4) out[c] = s * (q - 8.f);
    else out[c] = q * s;
  }
}

}  // namespace

at::Tensor qlinear_held_rows(const at::Tensor& codes, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, const at::Tensor& ids,
                             int64_t group_size, int64_t k, at::ScalarType dtype) {
  constexpr int64_t L = S::kLanes;
  // int4 codes are held as uint8 (two per byte), int8 codes as int8 (qlinear_hold)
  const bool int4 = codes.scalar_type() == at::kByte, asym = mins.has_value() && mins->defined();
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 2 && codes.is_contiguous() &&
                  (int4 || codes.scalar_type() == at::kChar) && codes.size(1) % (4 * L) == 0,
              "qlinear_held_rows: codes must be contiguous uint8 (int4) or int8 [P, nd * ", L,
              " * 4] panels, got ", codes.sizes(), " ", codes.scalar_type());
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
  const int64_t G = scales.size(1);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.const_data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = asym ? mins->data_ptr<at::Half>() : nullptr;
  return lookup_rows("qlinear_held_rows", ids, P * L, k, dtype, scales.options(),
                     [&](int64_t id, float* row) {
                       const int64_t pi = id / L;
                       held_row(cp + pi * row_bytes * L, sp + pi * G * L,
                                mp == nullptr ? nullptr : mp + pi * G * L, id % L, L, group_size,
                                int4, S::kW8Biased, k, row);
                     });
}

}  // namespace fitserve::qlinear
