// The K-quant row drivers (Q4_K / Q5_K / Q6_K of ggml_blocks_kquant.h): the GEMV's four streamed
// quarters (kq_rows_quarters) and the M > 1 tiles (kq_rows_range), both running several weight rows
// per tile (T::tile<NW, MT> on AVX-512: one pass over x per super-block for all NW rows, their
// lane sums reduced together). Every output has the bits of row<1> for its row of x alone: the
// fp32 ops of a (weight row, x row) pair are the same whatever NW, MT and the split.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ggml_blocks_kquant.h"
#include "ggml_blocks_run.h"

namespace fitserve::ggml {

// Weight rows w[0 .. NW-1] against rows m0 .. m0+MT-1 of x: res[j * MT + i] (T::tile where the
// tier has one, else row by row).
template <class T, int NW, int MT>
[[gnu::always_inline]] inline void kq_tile(const uint8_t* const* w, int64_t nsb, const Act& a,
                                           int64_t m0, float* res, int64_t ahead = kKqAhead) {
#if defined(FS_GGML_AVX512)
  T::template tile<NW, MT>(w, nsb, a, m0, res, ahead);
#else
  (void)ahead;
  FS_GGML_UNROLL for (int j = 0; j < NW; ++j) T::template row<MT>(w[j], nsb, a, m0, res + j * MT);
#endif
}

// The GEMV (one row of x) over weight rows [n0, n1): rows_quarters (ggml_blocks_run.h) with
// T::tile's 4-row tiles (x read once per super-block for the four, their lane sums reduced
// together). Hot, one thread: Q6_K 1024x256 6.0 -> 3.5 ns per row, Q4_K 256x1024 17.3 -> 14.3
// (--hot) against one row at a time. Every output has row<1>'s bits.
template <class T>
void kq_rows_quarters(const uint8_t* W, int64_t row_bytes, int64_t nsb, const Act& a, int64_t n0,
                      int64_t n1, float* out) {
  rows_quarters<T>(W, row_bytes, nsb, a, n0, n1, out, [&](const uint8_t* const* w4, float* res) {
    kq_tile<T, 4, 1>(w4, nsb, a, 0, res);
  });
}

// Weight rows per tile for a tile of MT rows of x: more where the tile is short (the x rows'
// accumulators and the weight rows' share the registers).
template <int MT>
constexpr int kq_weight_rows() {
  return MT == 1 ? 4 : MT <= 4 ? 2 : 1;
}

// Weight rows [n0, n1) against x rows [m0, m0 + MT): out[m * N + n].
template <class T, int MT>
void kq_rows_tile(const uint8_t* W, int64_t rb, int64_t nsb, const Act& a, int64_t m0,
                  int64_t n0, int64_t n1, int64_t N, float* out) {
  constexpr int NW = kq_weight_rows<MT>();
  float res[NW * MT];
  int64_t n = n0;
  for (; n + NW <= n1; n += NW) {
    // NOTE: as rows_tile (ggml_blocks_run.h): the rows two tiles ahead requested, streamed
    const int64_t pf = std::min<int64_t>(NW, n1 - n - 2 * NW);
    for (int64_t o = 0; o < pf * rb; o += 64) __builtin_prefetch(W + (n + 2 * NW) * rb + o, 0, 0);
    const uint8_t* w[NW];
    FS_GGML_UNROLL for (int j = 0; j < NW; ++j) w[j] = W + (n + j) * rb;
    kq_tile<T, NW, MT>(w, nsb, a, m0, res);
    FS_GGML_UNROLL for (int j = 0; j < NW; ++j)
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) out[(m0 + i) * N + n + j] = res[j * MT + i];
  }
  for (; n < n1; ++n) {
    T::template row<MT>(W + n * rb, nsb, a, m0, res);
    for (int i = 0; i < MT; ++i) out[(m0 + i) * N + n] = res[i];
  }
}

// Weight rows [n0, n1) against x rows [m0, m1): tiles of kTileRows rows of x, then the rest as
// ONE tile of 1 .. kTileRows - 1 rows (M = 3 or 7: one pass over the weights, not 2 + 1 or
// 4 + 2 + 1 passes, each decoding them again).
template <class T>
void kq_rows_range(const uint8_t* W, int64_t rb, int64_t nsb, const Act& a, int64_t m0,
                   int64_t m1, int64_t n0, int64_t n1, int64_t N, float* out) {
  constexpr int kTile = kTileRows;
  int64_t m = m0;
  for (; m + kTile <= m1; m += kTile) kq_rows_tile<T, kTile>(W, rb, nsb, a, m, n0, n1, N, out);
  switch (m1 - m) {
    case 1: return kq_rows_tile<T, 1>(W, rb, nsb, a, m, n0, n1, N, out);
    case 2: return kq_rows_tile<T, 2>(W, rb, nsb, a, m, n0, n1, N, out);
    case 3: return kq_rows_tile<T, 3>(W, rb, nsb, a, m, n0, n1, N, out);
    default: break;
  }
  if constexpr (kTile > 4) {
    switch (m1 - m) {
      case 4: return kq_rows_tile<T, 4>(W, rb, nsb, a, m, n0, n1, N, out);
      case 5: return kq_rows_tile<T, 5>(W, rb, nsb, a, m, n0, n1, N, out);
      case 6: return kq_rows_tile<T, 6>(W, rb, nsb, a, m, n0, n1, N, out);
      case 7: return kq_rows_tile<T, 7>(W, rb, nsb, a, m, n0, n1, N, out);
      default: break;
    }
  }
}

}  // namespace fitserve::ggml
