// AMX-INT8 tiles for a weight HELD as panels (qlinear_held.h) with 32-column groups, M rows of x
// at a time in 16-row tiles. Compiled where the CPU has AMX-INT8 (isa.py adds -mamx-tile
// -mamx-int8 and FITSERVE_AMX_INT8 to the avx512_vnni tier), taken at run time only when the
// kernel may use the tile registers (amx_usable) and from kAmxMinRows rows on.
//
// The held panel is already AMX's B layout: one 32-column group of kLanes = 16 rows is 8 rows of
// 64 bytes (dword d of lane l at d * 64 + 4 l), i.e. B[k / 4][4 n + k % 4].
//   int8: the bytes are w + 128 (^ 0x80, for VNNI's vpdpbusd); each panel is copied back to
//         signed bytes once per call and chunk of x rows, and runs on tdpbssd (signed x signed):
//         the -128 * sum(x) correction per row and group would cost the float step 2 of its ~8
//         instructions, the copy ~1 per 16 rows.
//   int4: dwords 0-3 of a group hold columns 4d.. in their low nibbles and 16 + 4d.. in their
//         high ones, so the low nibbles of the 4 dwords then the high ones are B's 8 rows in
//         natural column order; each panel is unpacked to bytes (2x its codes) the same way, and
//         runs on tdpbsud (signed x, unsigned codes 0..15).
// x is quantized in natural column order (NatAct), so A is row m of x's codes at stride kp.
//
// One tile dot per group (tdpbssd / tdpbsud) makes each output's integer group sum; its float
// step is the one of int4_panel_tile / int8_panel_tile for G = 32 (the canonical order of
// qlinear_rows.h), so row m of the result has the same bits as the VNNI panels and held_gemv
// give it, whatever M.
#pragma once

#if defined(FITSERVE_AMX_INT8)

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

#include "amx_state.h"
#include "qlinear_held.h"

namespace fitserve::qlinear {

constexpr int64_t kAmxRows = 16;     // rows of x per tile
// NOTE: the crossover measured on a Xeon with AMX (1 thread, SmolLM2 shapes, K 576 / 1536):
// AMX / VNNI time 1.1-2.0 at M = 8-16, 0.74-0.98 at 32, 0.74-0.84 at 128-512. The float step
// (4-6 fp32 ops per output and group, the same as the panels') is most of a tile's time: the
// tiles remove the integer dots, not it.
constexpr int64_t kAmxMinRows = 32;
constexpr int64_t kAmxChunkRows = 256;  // rows of x per pass over the panels (codes in L2)

// The tile state (amx_usable, amx_set) and LDTILECFG block are the ones every AMX kernel shares.
using fitserve::AmxConfig;
using fitserve::amx_set;
using fitserve::amx_usable;

// Tiles: 0, 1 = C of two groups (16 x 16 int32); 2, 3 = A (16 rows x 32 bytes); 4, 5 = B (8 x 64).
inline void amx_configure() {
  AmxConfig c;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t : {2, 3}) c.rows[t] = 16, c.colsb[t] = 32;
  for (int t : {4, 5}) c.rows[t] = 8, c.colsb[t] = 64;
  fitserve::amx_load_config(c);
}

// A panel's int4 codes as bytes in B order: group g at b + g * 512.
inline void amx_unpack_int4(const uint8_t* c, int64_t ngroups, uint8_t* b) {
  const __m512i lo = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < ngroups; ++g) {
    _Pragma("GCC unroll 4") for (int d = 0; d < 4; ++d) {
      const __m512i w = _mm512_loadu_si512(c + g * 256 + d * 64);
      _mm512_storeu_si512(b + g * 512 + d * 64, _mm512_and_si512(w, lo));
      _mm512_storeu_si512(b + g * 512 + (4 + d) * 64,
                          _mm512_and_si512(_mm512_srli_epi16(w, 4), lo));
    }
  }
}

// A panel's int8 codes (held + 128) as signed bytes: group g at b + g * 512.
inline void amx_unbias_int8(const uint8_t* c, int64_t ngroups, uint8_t* b) {
  static_assert(S::kW8Biased, "AMX is built at the avx512_vnni tier, whose int8 panels are biased");
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < ngroups * 8; ++i)
    _mm512_storeu_si512(b + i * 64, _mm512_xor_si512(_mm512_loadu_si512(c + i * 64), bias));
}

// The float step of one group for the 16 rows of a tile (C: the group's int32 sums, [16][16]).
template <bool kInt4>
inline void amx_group_step(const int32_t* C, const NatAct& x, int64_t m0, int64_t g,
                           int64_t ngroups, S::F dv, S::F cv, S::F* acc) {
  _Pragma("GCC unroll 16") for (int r = 0; r < kAmxRows; ++r) {
    const int64_t m = m0 + r;
    const S::I ci = _mm512_load_si512(C + r * 16);
    const S::F t = S::mulr(S::cvt(ci), S::mulr(dv, S::set1(x.da[m * x.nblk + g])));
    if constexpr (kInt4) {
      const S::F off = S::mulr(cv, S::set1(x.sg[m * ngroups + g]));
      acc[r] = S::add(acc[r], S::add(t, off));
    } else {
      acc[r] = S::add(acc[r], t);
    }
  }
}

// C += A . B: int4 codes are unsigned, int8 ones signed (after amx_unbias_int8). A macro: the
// tile intrinsics take their register numbers as literal tokens.
#define FITSERVE_AMX_DOT(kInt4, c, a, b) \
  do {                                   \
    if constexpr (kInt4) _tile_dpbsud(c, a, b); \
    else _tile_dpbssd(c, a, b);          \
  } while (0)

// One 16-row tile of x (rows m0.. < me are stored) against panel p (B: its codes in B order).
template <bool kInt4, class O>
inline void amx_tile(const HeldWeight& h, const PanelView& v, const uint8_t* B, const NatAct& x,
                     int64_t m0, int64_t me, int64_t p, O* out, int64_t N) {
  constexpr int L = S::kLanes;
  alignas(64) int32_t C[2][kAmxRows * 16];
  const int64_t G = h.ngroups;
  S::F acc[kAmxRows];
  for (auto& a : acc) a = S::fzero();
  const int8_t* A = x.aq + m0 * x.kp;
  const auto step = [&](int c, int64_t g) {
    amx_group_step<kInt4>(C[c], x, m0, g, G, S::loadf(v.dv + g * L),
                          kInt4 ? S::loadf(v.cv + g * L) : S::fzero(), acc);
  };
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {  // two groups in flight: tile ops overlap the float steps
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, A + g * 32, x.kp);
    _tile_loadd(4, B + g * 512, 64);
    _tile_loadd(3, A + (g + 1) * 32, x.kp);
    _tile_loadd(5, B + (g + 1) * 512, 64);
    FITSERVE_AMX_DOT(kInt4, 0, 2, 4);
    FITSERVE_AMX_DOT(kInt4, 1, 3, 5);
    _tile_stored(0, C[0], 64);
    _tile_stored(1, C[1], 64);
    step(0, g);
    step(1, g + 1);
  }
  if (g < G) {
    _tile_zero(0);
    _tile_loadd(2, A + g * 32, x.kp);
    _tile_loadd(4, B + g * 512, 64);
    FITSERVE_AMX_DOT(kInt4, 0, 2, 4);
    _tile_stored(0, C[0], 64);
    step(0, g);
  }
  const int64_t rows = std::min<int64_t>(kAmxRows, me - m0);
  for (int64_t r = 0; r < rows; ++r) store_lanes(acc[r], out + (m0 + r) * N + p * L, N - p * L);
}

// Panels [p0, p1) x rows [0, M) of x (x's buffers padded with zero rows to a multiple of 16),
// kAmxChunkRows rows of x at a time (their codes stay in L2 across the panels).
template <bool kInt4, class O>
void amx_panels(const HeldWeight& h, const NatAct& x, int64_t M, int64_t p0, int64_t p1, O* out,
                int64_t N) {
  static thread_local std::vector<uint8_t> bbuf;
  static thread_local std::vector<float> dvb, cvb;
  const int64_t G = h.ngroups;
  if (static_cast<int64_t>(bbuf.size()) < G * 512) bbuf.resize(G * 512);
  amx_configure();
  for (int64_t mb = 0; mb < M; mb += kAmxChunkRows) {
    const int64_t me = std::min(M, mb + kAmxChunkRows);
    for (int64_t p = p0; p < p1; ++p) {
      const PanelView v = held_panel(h, kInt4, p, dvb, cvb);
      const uint8_t* codes = h.codes + p * h.panel_bytes();
      if constexpr (kInt4) amx_unpack_int4(codes, G, bbuf.data());
      else amx_unbias_int8(codes, G, bbuf.data());
      const uint8_t* B = bbuf.data();
      for (int64_t m0 = mb; m0 < me; m0 += kAmxRows) amx_tile<kInt4>(h, v, B, x, m0, me, p, out, N);
    }
  }
  _tile_release();  // NOTE: frees the 8 KB tile state (context switches no longer save it)
}

// y [M, N] for a held weight with 32-column groups on AMX; x quantized in xa with its rows
// padded to a multiple of kAmxRows (zero codes, zero scales).
template <class O>
void held_amx(const HeldWeight& h, bool int4, const NatAct& xa, int64_t M, O* out) {
  const int64_t N = h.P * S::kLanes;
  at::parallel_for(0, h.P, 1, [&](int64_t p0, int64_t p1) {
    if (int4) amx_panels<true>(h, xa, M, p0, p1, out, N);
    else amx_panels<false>(h, xa, M, p0, p1, out, N);
  });
}

#undef FITSERVE_AMX_DOT

}  // namespace fitserve::qlinear

#endif  // FITSERVE_AMX_INT8
