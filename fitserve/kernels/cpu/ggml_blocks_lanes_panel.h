// The AVX512-VNNI M > 1 driver of the types whose tiles take x quantized lanes_t (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4: ggml_blocks_lanes.h; IQ4_XS: ggml_blocks_iq4.h): a block of
// weight rows has each row's whole 512-column steps decoded and transposed ONCE into the
// calling thread's panel (LanesStep, 640 bytes per step), then x's rows in tiles of kTileRows,
// 4, 2, 1 read them. rows_range instead decoded every weight row again for each tile of x (M /
// 8 times): decoding and transposing a step costs about what 3-4 rows' dots with it do.
// Each row of x runs the tiles' ops on the same decoded values, so its bits are the row alone's.
#pragma once

#include <vector>

#include "ggml_blocks_lanes.h"
#include "ggml_blocks_run.h"

namespace fitserve::ggml {
#ifdef FS_GGML_VNNI

// From this many rows of x a call's weight rows are decoded once (below, one tile of x per
// weight row: nothing to share).
constexpr int64_t kLanesPanelMinRows = kTileRows + 1;

template <class T>
void lanes_decode_row_any(const uint8_t* w, int64_t nblk, LanesStep* out) {
  if constexpr (lanes_m1<T>::value)
    lanes_decode_row<T>(w, nblk, out);
  else
    T::decode_row(w, nblk, out);
}

// With `ahead` (the first tile only), each weight row's turn also requests the same row of the
// next block from memory (L2), so that block's decode finds its rows there: a decode step's
// weights stream from DRAM once, and the decode of a block is a burst with no compute beside it.
template <class T, int MT>
void lanes_panel_tile(const uint8_t* W, int64_t row_bytes, int64_t nblk, const Act& a,
                      int64_t m0, int64_t n0, int64_t n1, int64_t N, const LanesStep* panel,
                      int64_t steps, float* out, bool ahead) {
  float res[MT];
  for (int64_t n = n0; n < n1; ++n) {
    if (ahead) {
      const uint8_t* nx = W + (n + (n1 - n0)) * row_bytes;
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(nx + o, 0, 2);
    }
    const LanesStep* dec = panel + (n - n0) * steps;
    if constexpr (lanes_m1<T>::value)
      lanes_row<T, MT>(W + n * row_bytes, nblk, a, m0, res, 0, dec);
    else
      T::template row<MT>(W + n * row_bytes, nblk, a, m0, res, 0, dec);
    for (int i = 0; i < MT; ++i) out[(m0 + i) * N + n] = res[i];
  }
}

// Weight rows [n0, n1) against all M rows of x (quantized lanes_t); out[m * N + n].
template <class T>
void lanes_panel_range(const uint8_t* W, int64_t row_bytes, int64_t nblk, const Act& a,
                       int64_t M, int64_t n0, int64_t n1, int64_t N, float* out) {
  const int64_t steps = nblk * T::kQK / 512;
  static thread_local std::vector<LanesStep> panel;
  if (static_cast<int64_t>(panel.size()) < (n1 - n0) * steps) panel.resize((n1 - n0) * steps);
  for (int64_t n = n0; n < n1; ++n)
    lanes_decode_row_any<T>(W + n * row_bytes, nblk, panel.data() + (n - n0) * steps);
  const LanesStep* p = panel.data();
  int64_t m = 0;  // M > kTileRows: the first tile is a full one, and it alone prefetches
  for (; m + kTileRows <= M; m += kTileRows)
    lanes_panel_tile<T, kTileRows>(W, row_bytes, nblk, a, m, n0, n1, N, p, steps, out, m == 0);
  if constexpr (kTileRows > 4) {
    if (m + 4 <= M) {
      lanes_panel_tile<T, 4>(W, row_bytes, nblk, a, m, n0, n1, N, p, steps, out, false);
      m += 4;
    }
  }
  if (m + 2 <= M) {
    lanes_panel_tile<T, 2>(W, row_bytes, nblk, a, m, n0, n1, N, p, steps, out, false);
    m += 2;
  }
  if (m < M) lanes_panel_tile<T, 1>(W, row_bytes, nblk, a, m, n0, n1, N, p, steps, out, false);
}

#endif  // FS_GGML_VNNI
}  // namespace fitserve::ggml
