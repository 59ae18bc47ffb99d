// The AVX512-VNNI M > 1 driver of the types whose tiles take x quantized lanes_t (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4: ggml_blocks_lanes.h; IQ4_XS: ggml_blocks_iq4.h): a block of
// weight rows has each row's whole 512-column steps decoded and transposed ONCE into the
// calling thread's panel (LanesStep, 640 bytes per step), then register tiles of 4 weight rows
// x 4 rows of x (then 2, 1) read them (lanes_panel_steps). rows_range instead decoded every
// weight row again for each tile of x (M / 8 times): decoding and transposing a step costs
// about what 3-4 rows' dots with it do. Each (weight row, row of x) runs its type's finish on
// exact integer dots, so a row's bits are the row alone's.
#pragma once

#include <vector>

#include "ggml_blocks_lanes.h"
#include "ggml_blocks_run.h"

namespace fitserve::ggml {
#ifdef FS_GGML_VNNI

// From this many rows of x a call's weight rows are decoded once (below, one tile of x per
// weight row: nothing to share). NOTE: at M = 4-8 the register tiles measured slower than
// rows_range's one 8-row tile (2 threads, Zen 4: 2048x2048 M = 8 about 0.6x), at 12 faster.
constexpr int64_t kLanesPanelMinRows = kTileRows + 1;

// What row m of x brings to a decoded step's finish, and the finish of one weight row's dots
// with it: the type's own ops (lanes_x / lanes_apply), those of its row alone. `step` counts 512-column steps.
template <class T>
[[gnu::always_inline]] inline LanesX lanes_step_x(const Act& a, int64_t m, int64_t step) {
  return lanes_x<T>(a, m, 16 * step, 0xFFFF);
}

template <class T>
[[gnu::always_inline]] inline void lanes_step_apply(__m512i dot, const LanesStep& s,
                                                    const LanesX& x, __m512& acc) {
  lanes_apply<T>(dot, s.g, s.dv, x, acc);
}

// The columns of a weight row past its whole steps, against MT rows of x, into acc.
template <class T, int MT>
void lanes_row_tail(const uint8_t* w, int64_t nblk, const Act& a, int64_t m0, __m512* acc) {
  const int64_t k = nblk / 16 * 16;
  if (k < nblk)
    lanes_step<T, MT, false>(w + k * T::kBytes, k, static_cast<int>(nblk - k), a, m0, acc);
}

// R decoded weight rows (dec[r * steps + k]) against MT rows of x from m0, every whole step,
// as a register tile: per 64-byte piece c, MT loads of x and R of weights feed R * MT VPDPBUSD.
// NOTE: the tiles before (one weight row, 8 rows of x) loaded a piece of x for every VPDPBUSD,
// and Zen 4 loads one zmm per cycle: they ran at 80-95 G MAC/s per core where the VPDPBUSD
// alone reach 200+. Here x's pieces are pinned in registers (GCC otherwise folds each use into
// the VPDPBUSD as a memory operand, the same loads again). The integer dots are exact whatever
// the order, and each (weight row, row of x) then runs its type's finish: the row alone's bits.
// NOTE: x's Act and the sums are copied into locals: through the caller's references GCC
// reloaded Act's fields and stored every sum twice per step (they might alias).
template <class T, int R, int MT>
[[gnu::noinline]] void lanes_panel_steps(const LanesStep* dec, int64_t steps, const Act& act,
                                         int64_t m0, __m512 (&out)[R][MT]) {
  const Act a = act;
  __m512 acc[R][MT];
  FS_GGML_UNROLL for (int r = 0; r < R; ++r)
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) acc[r][i] = _mm512_setzero_ps();
  const int8_t* aq[MT];
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i) aq[i] = a.qrow(m0 + i);
  for (int64_t k = 0; k < steps; ++k) {
    __m512i d[R][MT];
    FS_GGML_UNROLL for (int r = 0; r < R; ++r)
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) d[r][i] = _mm512_setzero_si512();
    FS_GGML_UNROLL for (int c = 0; c < 8; ++c) {
      __m512i xv[MT];
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
        xv[i] = _mm512_loadu_si512(aq[i] + 512 * k + 64 * c);
        asm("" : "+v"(xv[i]));
      }
      FS_GGML_UNROLL for (int r = 0; r < R; ++r) {
        const __m512i w = _mm512_load_si512(&dec[r * steps + k].wv[c]);
        FS_GGML_UNROLL for (int i = 0; i < MT; ++i)
          d[r][i] = _mm512_dpbusd_epi32(d[r][i], w, xv[i]);
      }
    }
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
      const LanesX x = lanes_step_x<T>(a, m0 + i, k);
      FS_GGML_UNROLL for (int r = 0; r < R; ++r)
        lanes_step_apply<T>(d[r][i], dec[r * steps + k], x, acc[r][i]);
    }
  }
  FS_GGML_UNROLL for (int r = 0; r < R; ++r)
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) out[r][i] = acc[r][i];
}

// Weight rows n .. n + R - 1 (decoded at dec) against rows m0 .. m0 + MT - 1 of x. With `ahead`
// (the first tile of rows of x only), the same rows of the next block are requested from memory
// (L2), so that block's decode finds them there: a decode step's weights stream from DRAM once,
// and the decode of a block is a burst with no compute beside it.
template <class T, int R, int MT>
void lanes_panel_group(const uint8_t* W, int64_t row_bytes, int64_t nblk, const Act& a,
                       int64_t m0, int64_t n, int64_t next, int64_t N, const LanesStep* dec,
                       int64_t steps, float* out, bool ahead) {
  if (ahead)
    for (int r = 0; r < R; ++r) {
      const uint8_t* nx = W + (n + r + next) * row_bytes;
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(nx + o, 0, 2);
    }
  __m512 acc[R][MT];
  lanes_panel_steps<T, R, MT>(dec, steps, a, m0, acc);
  for (int r = 0; r < R; ++r) {
    lanes_row_tail<T, MT>(W + (n + r) * row_bytes, nblk, a, m0, acc[r]);
    for (int i = 0; i < MT; ++i) out[(m0 + i) * N + n + r] = _mm512_reduce_add_ps(acc[r][i]);
  }
}

// NOTE: 4 x 4 (16 int32 dots; a few fp32 sums spill to L1) against 2 x 4 / 3 x 4 / 4 x 2 in a
// one-thread standalone sweep of this loop over a decoded panel at 2048 and 8192 columns (Zen
// 4): 4 x 4 and 3 x 4 135-145 G MAC/s, 2 x 4 and 4 x 2 95-125, the one-weight-row tiles before
// 60-85. In ggml_matmul (2 threads, M = 16-512) 1.4-2.2x the tiles before.
constexpr int kLanesPanelRows = 4;  // weight rows per register tile
constexpr int kLanesPanelX = 4;     // rows of x per register tile

template <class T, int MT>
void lanes_panel_rows(const uint8_t* W, int64_t row_bytes, int64_t nblk, const Act& a,
                      int64_t m0, int64_t n0, int64_t n1, int64_t N, const LanesStep* panel,
                      int64_t steps, float* out, bool ahead) {
  constexpr int R = kLanesPanelRows;
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    lanes_panel_group<T, R, MT>(W, row_bytes, nblk, a, m0, n, n1 - n0, N,
                                panel + (n - n0) * steps, steps, out, ahead);
  for (; n < n1; ++n)
    lanes_panel_group<T, 1, MT>(W, row_bytes, nblk, a, m0, n, n1 - n0, N,
                                panel + (n - n0) * steps, steps, out, ahead);
}

// Weight rows [n0, n1) against all M rows of x (quantized lanes_t); out[m * N + n].
template <class T>
void lanes_panel_range(const uint8_t* W, int64_t row_bytes, int64_t nblk, const Act& a,
                       int64_t M, int64_t n0, int64_t n1, int64_t N, float* out) {
  const int64_t steps = nblk * T::kQK / 512;
  static thread_local std::vector<LanesStep> panel;
  if (static_cast<int64_t>(panel.size()) < (n1 - n0) * steps) panel.resize((n1 - n0) * steps);
  for (int64_t n = n0; n < n1; ++n)
    lanes_decode_row<T>(W + n * row_bytes, nblk, panel.data() + (n - n0) * steps);
  const LanesStep* p = panel.data();
  constexpr int MT = kLanesPanelX;
  int64_t m = 0;  // M > MT: the first tile is a full one, and it alone prefetches
  for (; m + MT <= M; m += MT)
    lanes_panel_rows<T, MT>(W, row_bytes, nblk, a, m, n0, n1, N, p, steps, out, m == 0);
  if (m + 2 <= M) {
    lanes_panel_rows<T, 2>(W, row_bytes, nblk, a, m, n0, n1, N, p, steps, out, false);
    m += 2;
  }
  if (m < M) lanes_panel_rows<T, 1>(W, row_bytes, nblk, a, m, n0, n1, N, p, steps, out, false);
}

#endif  // FS_GGML_VNNI
}  // namespace fitserve::ggml
