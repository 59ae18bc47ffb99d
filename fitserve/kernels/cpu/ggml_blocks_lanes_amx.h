// The 32-column block types (ggml_blocks_lanes.h: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4)
// from kLanesAmxMinRows rows of x on AMX-INT8 tiles (IQ4_XS runs its VNNI panel there:
// ggml_blocks_iq4panel.h): 16 rows of x against 16 weight rows, one tile dot (K = 32) per block.
// Compiled where the CPU has AMX-INT8 (isa.py's FITSERVE_AMX_INT8 at the avx512_vnni tier),
// taken at run time only when the kernel may use the tile registers.
//
// Each thread decodes a panel of 16 weight rows once per call (B::pair, made signed: the value,
// not value + bias, so tdpbssd's integer dot is the lanes' dot - (sum(a) << kShift) exactly) in
// AMX's B layout (block b: 8 rows of 64 bytes, B[k / 4][4 n + k % 4]), with the 16 rows' scales
// (and Q*_1's mins) per block; x is quantized in natural column order, so A is 16 rows of x's
// codes of one block at stride K.
//
// Bits: the VNNI rows (lanes_row, lanes_rows_m1, lanes_step_t) keep one fp32 lane per block,
// lane b % 16, each updated once per 16-block step with fma(dot, d * da, acc) [+ fma(m, ds)],
// then _mm512_reduce_add_ps. Here block b's scaled dot goes into lane b % 16 of each row of x's
// sums (part[lane][row], a vector over the 16 weight rows) in block order with the same ops, and
// the 16 lanes are summed in GCC's reduce_add_ps tree (hi + lo halves: 8, 4, then [0]+[2],
// [1]+[3], then the two) -- so row m has the bits of the row alone, whatever M.
// NOTE: the VNNI rows' M = 32 tiles cost 77 us per row of x at 2048x2048 for IQ4_NL and 58 for
// Q5_1 (one thread, Xeon, bench_ggml_blocks --msweep; per-block reductions, the weights decoded
// again per 8-row tile); these tiles 27-41. The scaling (per block and row: cvt, mul, FMA and the
// lane's load / store) is most of it; two panels sharing x's tile (four tile dots in flight) were
// 10-20% slower, their 32 KB of lane sums no longer in L1.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml_blocks_iq4.h"
#include "ggml_blocks_kquant.h"  // transpose16 (ggml_blocks_kqpanel.h)
#include "ggml_blocks_lanes.h"

#if defined(FS_GGML_VNNI) && defined(FITSERVE_AMX_INT8)
#include "amx_state.h"
#endif

namespace fitserve::ggml {

#if defined(FS_GGML_VNNI) && defined(FITSERVE_AMX_INT8)

constexpr int64_t kLanesAmxMinRows = 16;  // below, a 16-row tile is mostly padding rows

// Tiles: 0, 1 = C of two blocks (16 x 16 int32); 2, 3 = A (16 rows of x x 32 bytes);
// 4, 5 = B (8 rows x 64 bytes: 32 columns of 16 weight rows).
inline void lanes_amx_configure() {
  fitserve::AmxConfig c;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t : {2, 3}) c.rows[t] = 16, c.colsb[t] = 32;
  for (int t : {4, 5}) c.rows[t] = 8, c.colsb[t] = 64;
  fitserve::amx_load_config(c);
}

// A thread's decoded panel: block b's B tile at codes + 512 b (one spare block for an odd count),
// its 16 weight rows' scales at d + 16 b (Q*_1's mins at mn + 16 b); rows past N zero.
struct LanesPanel {
  std::vector<int8_t> codes;
  std::vector<float> d, mn;
};

// The panel's codes from their first 64-byte boundary (the vector keeps 64 spare bytes).
inline int8_t* panel_codes(LanesPanel& p) {
  return p.codes.data() + (64 - reinterpret_cast<uintptr_t>(p.codes.data()) % 64) % 64;
}
inline const int8_t* panel_codes(const LanesPanel& p) {
  return panel_codes(const_cast<LanesPanel&>(p));
}

template <class B>
[[gnu::always_inline]] inline __m512i signed_pair(const uint8_t* b, bool two) {
  const __m512i u = B::pair(b, two);
  if constexpr (B::kShift >= 0)
    return _mm512_sub_epi8(u, _mm512_set1_epi8(static_cast<char>(1 << B::kShift)));
  else
    return u;
}

// How the tiles read a type, as its VNNI rows do: pair(row, j, two) = blocks 2j, 2j + 1 (of 32
// columns) of a weight row as signed bytes; scales(row, k, r) = blocks k .. k + r - 1's fp32
// scale (the d that multiplies da) and min as 16 lanes; kActPer = blocks per activation block
// (x's da index is b / kActPer).
template <class B>
struct AmxBlocks {
  static constexpr int64_t kActPer = 1;
  static constexpr bool kHasMin = B::kHasMin;
  [[gnu::always_inline]] static inline __m512i pair(const uint8_t* row, int64_t j, bool two) {
    return signed_pair<B>(row + 2 * j * B::kBytes, two);
  }
  // as lanes_step reads them: the heads of r blocks
  [[gnu::always_inline]] static inline void scales(const uint8_t* row, int64_t k, int r,
                                                   __m512& d, __m512& mn) {
    const __m512i g = lane_heads<B>(row + k * B::kBytes, r * B::kBytes);
    d = B::lane_scales(g);
    if constexpr (B::kHasMin) mn = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
  }
};

template <class T, class = void>
struct has_amx_blocks : std::false_type {};
template <class T>
struct has_amx_blocks<T, std::enable_if_t<lanes_m1<T>::value>> : std::true_type {};

template <class T>
void lanes_amx_decode(const uint8_t* W, int64_t row_bytes, int64_t nb, int64_t rows,
                      LanesPanel& p) {
  using S = AmxBlocks<T>;
  const int64_t npair = (nb + 1) / 2;
  p.codes.resize(npair * 1024 + 64);
  p.d.resize(nb * 16);
  if constexpr (S::kHasMin) p.mn.resize(nb * 16);
  int8_t* codes = panel_codes(p);
  for (int64_t j = 0; j < npair; ++j) {
    __m512i v[16];
    const bool two = 2 * j + 1 < nb;
    FS_GGML_UNROLL for (int l = 0; l < 16; ++l)
      v[l] = l < rows ? S::pair(W + l * row_bytes, j, two) : _mm512_setzero_si512();
    transpose16(v);  // v[c]: dword c of each row's pair = row c % 8 of block 2j + c / 8
    FS_GGML_UNROLL for (int c = 0; c < 16; ++c) _mm512_store_si512(codes + 1024 * j + 64 * c, v[c]);
  }
  alignas(64) float sc[16][16], mn[16][16];
  for (int64_t k = 0; k < nb; k += 16) {
    const int r = static_cast<int>(std::min<int64_t>(16, nb - k));
    for (int l = 0; l < 16; ++l) {
      __m512 dv = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
      if (l < rows) S::scales(W + l * row_bytes, k, r, dv, mv);
      _mm512_store_ps(sc[l], dv);
      _mm512_store_ps(mn[l], mv);
    }
    for (int i = 0; i < r; ++i)
      for (int l = 0; l < 16; ++l) {
        p.d[(k + i) * 16 + l] = sc[l][i];
        if constexpr (S::kHasMin) p.mn[(k + i) * 16 + l] = mn[l][i];
      }
  }
}

// Block b's tile dot C (rows of x x weight rows) into lane b % 16 of the rows' accumulators
// (part[lane][row]) as lanes_finish.
template <class T>
[[gnu::always_inline]] inline void lanes_amx_finish(const int32_t* C, const LanesPanel& p,
                                                    int64_t b, const Act& a, int64_t m0,
                                                    int64_t rows, float (*part)[16]) {
  using S = AmxBlocks<T>;
  const __m512 dv = _mm512_loadu_ps(p.d.data() + 16 * b);
  __m512 mv = _mm512_setzero_ps();
  if constexpr (S::kHasMin) mv = _mm512_loadu_ps(p.mn.data() + 16 * b);
  const float* da = a.d + m0 * a.nd + b / S::kActPer;
  FS_GGML_UNROLL for (int r = 0; r < 16; ++r) {
    if (r >= rows) continue;
    __m512 acc = _mm512_load_ps(part[r]);
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(C + 16 * r));
    acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(da[r * a.nd])), acc);
    if constexpr (S::kHasMin)
      acc = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.dsrow(m0 + r)[b]), acc);
    _mm512_store_ps(part[r], acc);
  }
}

// Rows m0 .. m0 + rows - 1 (rows <= 16) of x against the panel: out[(m0 + r) * N + n0 + l],
// lanes l in live. A short tile still loads 16 rows of x's codes (act_buffer's kActRowPad).
template <class B>
void lanes_amx_rows(const LanesPanel& p, int64_t nb, const Act& a, int64_t m0, int64_t rows,
                    int64_t n0, int64_t N, __mmask16 live, float* out) {
  alignas(64) float part[16][16][16];  // [lane][row of x][weight row]
  alignas(64) int32_t C[2][2][256];     // two blocks' dots, double-buffered
  std::memset(part, 0, sizeof part);
  const int8_t* x = a.qrow(m0);
  const int8_t* codes = panel_codes(p);
  // NOTE: blocks b, b + 1 are stored from the tiles while the previous pair is scaled: a tile
  // store read back at once stalls the scaling
  int cur = 0;
  for (int64_t b = 0; b < nb; b += 2, cur ^= 1) {
    const bool two = b + 1 < nb;
    _tile_zero(0);
    _tile_loadd(2, x + 32 * b, a.K);
    _tile_loadd(4, codes + 512 * b, 64);
    _tile_dpbssd(0, 2, 4);
    if (two) {
      _tile_zero(1);
      _tile_loadd(3, x + 32 * (b + 1), a.K);
      _tile_loadd(5, codes + 512 * (b + 1), 64);
      _tile_dpbssd(1, 3, 5);
    }
    _tile_stored(0, C[cur][0], 64);
    if (two) _tile_stored(1, C[cur][1], 64);
    if (b >= 2) {  // the previous pair (always two)
      lanes_amx_finish<B>(C[cur ^ 1][0], p, b - 2, a, m0, rows, part[(b - 2) % 16]);
      lanes_amx_finish<B>(C[cur ^ 1][1], p, b - 1, a, m0, rows, part[(b - 1) % 16]);
    }
  }
  const int64_t last = (nb - 1) / 2 * 2;  // the last pair's first block
  lanes_amx_finish<B>(C[cur ^ 1][0], p, last, a, m0, rows, part[last % 16]);
  if (last + 1 < nb)
    lanes_amx_finish<B>(C[cur ^ 1][1], p, last + 1, a, m0, rows, part[(last + 1) % 16]);
  FS_GGML_UNROLL for (int r = 0; r < 16; ++r) {
    if (r >= rows) continue;
    __m512 t8[8], t4[4];  // _mm512_reduce_add_ps's tree, one weight row per lane
    FS_GGML_UNROLL for (int i = 0; i < 8; ++i)
      t8[i] = _mm512_add_ps(_mm512_load_ps(part[i + 8][r]), _mm512_load_ps(part[i][r]));
    FS_GGML_UNROLL for (int i = 0; i < 4; ++i) t4[i] = _mm512_add_ps(t8[i + 4], t8[i]);
    const __m512 s = _mm512_add_ps(_mm512_add_ps(t4[0], t4[2]), _mm512_add_ps(t4[1], t4[3]));
    _mm512_mask_storeu_ps(out + (m0 + r) * N + n0, live, s);
  }
}

// Whether an M-row call of T runs here (then x is quantized in natural order: lanes_t off).
template <class T>
inline bool lanes_amx_runs(int64_t M) {
  return has_amx_blocks<T>::value && M >= kLanesAmxMinRows && fitserve::amx_usable();
}

// The whole call: panels of 16 weight rows split over the threads, each decoded once.
template <class B>
void lanes_amx_run(const uint8_t* W, int64_t row_bytes, int64_t nb, const Act& a, int64_t M,
                   int64_t N, float* out) {
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t p0, int64_t p1) {
    static thread_local LanesPanel panel;
    lanes_amx_configure();
    for (int64_t pn = p0; pn < p1; ++pn) {
      const int64_t n0 = 16 * pn, rows = std::min<int64_t>(16, N - n0);
      lanes_amx_decode<B>(W + n0 * row_bytes, row_bytes, nb, rows, panel);
      const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
      for (int64_t m0 = 0; m0 < M; m0 += 16)
        lanes_amx_rows<B>(panel, nb, a, m0, std::min<int64_t>(16, M - m0), n0, N, live, out);
    }
    _tile_release();
  });
}

#else

template <class B>
inline bool lanes_amx_runs(int64_t) {
  return false;
}

#endif  // FS_GGML_VNNI && FITSERVE_AMX_INT8

}  // namespace fitserve::ggml
