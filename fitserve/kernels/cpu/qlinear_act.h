// Activations quantized once per call for the integer path, laid out in the weight's byte order.
//
// Each row of x [M, Kp] is cut into 32-column blocks; block b gets da_b = absmax / 127 (fp32)
// and a_q = round(x * 127 / absmax) in [-127, 127] (llama.cpp's Q8_0 / Q8_1 activations). The
// bytes are then permuted to the order of the packed weight row (qlinear_tiles.h), with one
// fp32 da per 4-byte lane, so the tiles never shuffle weights.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <tuple>
#include <type_traits>
#include <vector>

#include "qlinear_gemv.h"  // FITSERVE_QLINEAR_GEMV (and qlinear_tiles.h)

namespace fitserve::qlinear {

constexpr int64_t kActBlock = 32;

// Sizes of one call's activation buffers and chunk map, for a weight row of row_bytes bytes in
// groups of group_bytes bytes (int4: G / 2 bytes hold G columns; int8: G bytes).
struct ActLayout {
  int64_t row_bytes, group_bytes, halves, nchunks, a_stride, d_stride;
  ActLayout(int64_t row_bytes_, int64_t group_bytes_, int64_t halves_)
      : row_bytes(row_bytes_), group_bytes(group_bytes_), halves(halves_),
        nchunks((row_bytes_ + S::kBytes - 1) / S::kBytes),
        a_stride(nchunks * halves_ * S::kBytes), d_stride(nchunks * halves_ * S::kLanes) {}
};

// Block-quantize one row: aq [kp], da / isum [kp / 32].
template <class T>
inline void quantize_row(const T* x, int64_t kp, int8_t* aq, float* da, int32_t* isum) {
  for (int64_t b = 0; b < kp / kActBlock; ++b) {
    if constexpr (std::is_same_v<T, float>) {
      S::quant32(x + b * kActBlock, aq + b * kActBlock, da[b], isum[b]);
    } else {
      float v[kActBlock];
      for (int i = 0; i < kActBlock; ++i) v[i] = static_cast<float>(x[b * kActBlock + i]);
      S::quant32(v, aq + b * kActBlock, da[b], isum[b]);
    }
  }
}

// S_g = sum over the 32-column blocks b of group g of da_b * sum(a_q in b) (the int4 offsets).
inline void group_sums(const float* da, const int32_t* isum, int64_t kp, int64_t group, float* sg) {
  const int64_t per_group = group / kActBlock;
  for (int64_t g = 0; g < kp / group; ++g) {
    float s = 0.f;
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b)
      s += da[b] * static_cast<float>(isum[b]);
    sg[g] = s;
  }
}

#ifdef FITSERVE_QLINEAR_GEMV
// The batch-1 GEMV's int4 layout for G = 32 (qlinear_gemv.h reads the bytes and S_g, never the
// lane scales): a chunk holds GPC = kBytes / 16 groups; block g's low 16 columns go to the lo
// half of chunk g / GPC, its high 16 to the hi half, at byte 16 * (g % GPC): the tiles'
// order, as 16-byte copies instead of a loop over bytes (it runs on every linear of a decode
// step).
inline void layout_int4_g32_gemv(const int8_t* aq, const float* da, const int32_t* isum,
                                 int64_t kp, const ActLayout& L, int8_t* A, float* Sg) {
  constexpr int64_t GPC = S::kBytes / 16;
  const int64_t G = kp / kActBlock;
  for (int64_t g = 0; g < G; ++g) {
    int8_t* dst = A + (g / GPC) * 2 * S::kBytes + 16 * (g % GPC);
    std::memcpy(dst, aq + g * kActBlock, 16);
    std::memcpy(dst + S::kBytes, aq + g * kActBlock + 16, 16);
  }
  for (int64_t g = G; g % GPC; ++g) {  // the last chunk's groups past the row
    int8_t* dst = A + (g / GPC) * 2 * S::kBytes + 16 * (g % GPC);
    std::memset(dst, 0, 16);
    std::memset(dst + S::kBytes, 0, 16);
  }
  group_sums(da, isum, kp, kActBlock, Sg);
}

// The int8 GEMV's per-lane start where it reads weights unsigned (S::kGemvW8Unsigned):
// bias[l] = -128 * (sum of aq[4l .. 4l+3]), 0 past the row; nchunks * kLanes entries.
inline void gemv_w8_lane_bias(const int8_t* aq, int64_t kp, const ActLayout& L, int32_t* bias) {
  for (int64_t l = 0; l < L.nchunks * S::kLanes; ++l) {
    int32_t s = 0;
    if (4 * l < kp) s = aq[4 * l] + aq[4 * l + 1] + aq[4 * l + 2] + aq[4 * l + 3];
    bias[l] = -128 * s;
  }
}
#endif

}  // namespace fitserve::qlinear
