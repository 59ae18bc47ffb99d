// The K-quants' M > 1 panels (ggml_blocks_kqpanel.h) on AMX-INT8 tiles: 16 rows of x at a time
// against a panel of 16 weight rows. Compiled where the CPU has AMX-INT8 (isa.py's
// FITSERVE_AMX_INT8 at the avx512_vnni tier), taken at run time only when the kernel may use the
// tile registers (amx_usable) and from kKqAmxMinRows rows of x on.
//
// The decoded panel already is AMX's B layout: a chunk of CB columns (Q4_K / Q5_K 32, Q6_K 16)
// is CB / 4 storage dwords of 16 lanes, i.e. CB / 4 rows of 64 bytes with B[c][4 l + i] = code
// i of lane l's dword c, and x's quantized row m holds the same columns at the same offsets
// (Q4_K / Q5_K: kPerm128's order), so A = 16 rows of x's codes at stride K.
//
// Each chunk's integer dot is scaled by that chunk's scale (isum = sum_k sc_k dot_k), and a
// vpmulld per row and chunk (2 uops on port 0) cost more than the tiles themselves (Q6_K's first
// version: 0.78-0.87 of the VNNI panel's time). So the panel holds the codes times the digits of
// their chunk's scale instead, one plane per digit, and a plane's tile accumulator runs over the
// super-block's 256 columns (tdp* of K = 64) with no multiply:
//   Q4_K / Q5_K (scales 0..63, codes <= 31): sc = 8 hi + lo, hi and lo in 0..7; the planes are
//     codes * hi and codes * lo (<= 217: unsigned bytes, made by Q45KPanel::pack<true> as it
//     decodes); isum = 8 C_hi + C_lo (tdpbsud: x signed, planes unsigned).
//   Q6_K (int8 scales, codes 0..63 with a -32 offset): sc = 64 a + 8 b + c, digits in -3..4, and
//     the planes are the centred codes (q - 32) times a, b, c (-128..124: signed bytes,
//     Q6KPanel::digit_planes); 64 C_a + 8 C_b + C_c is the super-block's sum with the offset
//     already in it (tdpbssd), ended by Q6KPanel::finish_centered.
// Both are exact integers, and the super-block ends with the VNNI panel's own fp32 ops, so
// row m of the result has the bits of the VNNI panel, the row tiles and the GEMV (row m alone),
// whatever M.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#ifdef FS_GGML_AVX512
namespace fitserve::ggml {

// Digit planes of P's AMX panel (Q4_K / Q5_K: 2, Q6_K: 3): the VNNI panel's kZmm with its codes
// replaced by the first plane, then the other planes' 64 zmm each.
// Panels without an AMX layout (P::kNoAmx: IQ4_XS's) run their VNNI tiles whatever the CPU.
template <class P, class = void>
struct kq_no_amx : std::false_type {};
template <class P>
struct kq_no_amx<P, std::void_t<decltype(P::kNoAmx)>> : std::bool_constant<P::kNoAmx> {};

template <class P>
constexpr int kq_amx_planes() {
  return std::is_same_v<P, Q6KPanel> ? 3 : 2;
}
template <class P>
constexpr int64_t kq_amx_zmm() {
  return P::kZmm + 64 * (kq_amx_planes<P>() - 1);
}

}  // namespace fitserve::ggml
#endif  // FS_GGML_AVX512

#if defined(FS_GGML_AVX512) && defined(FITSERVE_AMX_INT8)

#include "amx_state.h"

namespace fitserve::ggml {

constexpr int64_t kKqAmxRows = 16;  // rows of x per tile
// NOTE: rows of x from which the tiles run (below: the VNNI panel tiles of kKqPanelTile rows).
// AMX / VNNI panel time (bench_ggml_blocks.py --msweep, one thread, Xeon with AMX): M = 16
// 0.75-0.87, M = 32 0.63-0.83; below 16 a tile would be mostly padding rows
constexpr int64_t kKqAmxMinRows = 16;

// Tiles: 0 .. planes - 1 = C of each digit plane (16 x 16 int32), 3 = A (16 rows of x x 64
// bytes), 4 .. 3 + planes = B of each plane (16 x 64: 64 columns of 16 weight rows).
template <class P>
inline void kq_amx_configure() {
  fitserve::AmxConfig c;
  for (int t = 0; t < kq_amx_planes<P>(); ++t) {
    c.rows[t] = 16, c.colsb[t] = 64;
    c.rows[4 + t] = 16, c.colsb[4 + t] = 64;
  }
  c.rows[3] = 16, c.colsb[3] = 64;
  fitserve::amx_load_config(c);
}

// Rows m0 .. m0 + rows - 1 (rows <= 16) of x against the AMX panel: out[(m0 + r) * N + n0 + l],
// lanes l in live. A short tile still loads 16 rows of x's codes: act_buffer's kActRowPad rows
// past M keep those loads inside the buffer, and their results are dropped.
template <class P>
void kq_amx_rows(const __m512i* panel, int64_t nsb, const Act& a, int64_t m0, int64_t rows,
                 int64_t n0, int64_t N, __mmask16 live, float* out) {
  constexpr bool k6 = kq_amx_planes<P>() == 3;
  alignas(64) int32_t C[kq_amx_planes<P>()][kKqAmxRows * 16];
  __m512 acc[kKqAmxRows];
  for (auto& v : acc) v = _mm512_setzero_ps();
  const int8_t* x = a.qrow(m0);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const __m512i* p = panel + sb * kq_amx_zmm<P>();
    const int8_t* xs = x + sb * 256;
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (k6) _tile_zero(2);
    FS_GGML_UNROLL for (int s = 0; s < 4; ++s) {  // 64 columns (16 storage dwords) a step
      _tile_loadd(3, xs + 64 * s, a.K);
      _tile_loadd(4, p + 16 * s, 64);
      _tile_loadd(5, p + P::kZmm + 16 * s, 64);
      if constexpr (k6) {
        _tile_loadd(6, p + P::kZmm + 64 + 16 * s, 64);
        _tile_dpbssd(0, 3, 4);
        _tile_dpbssd(1, 3, 5);
        _tile_dpbssd(2, 3, 6);
      } else {
        _tile_dpbsud(0, 3, 4);
        _tile_dpbsud(1, 3, 5);
      }
    }
    _tile_stored(0, C[0], 64);
    _tile_stored(1, C[1], 64);
    if constexpr (k6) _tile_stored(2, C[2], 64);
    FS_GGML_UNROLL for (int r = 0; r < kKqAmxRows; ++r) {
      if (r >= rows) continue;
      if constexpr (k6) {
        const __m512i is = _mm512_add_epi32(
            _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(C[0] + 16 * r), 6),
                             _mm512_slli_epi32(_mm512_load_si512(C[1] + 16 * r), 3)),
            _mm512_load_si512(C[2] + 16 * r));
        P::finish_centered(p, sb, a, m0 + r, is, acc[r]);
      } else {
        const __m512i is = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(C[0] + 16 * r), 3),
                                            _mm512_load_si512(C[1] + 16 * r));
        P::finish(p, sb, a, m0 + r, is, acc[r]);
      }
    }
  }
  FS_GGML_UNROLL for (int r = 0; r < kKqAmxRows; ++r)
    if (r < rows) _mm512_mask_storeu_ps(out + (m0 + r) * N + n0, live, acc[r]);
}

}  // namespace fitserve::ggml

#endif  // FS_GGML_AVX512 && FITSERVE_AMX_INT8

#ifdef FS_GGML_AVX512
namespace fitserve::ggml {

// Whether a thread's share of an M-row call runs the AMX tiles (then configured for P), and their
// release at its end (frees the 8 KB tile state: context switches no longer save it).
template <class P>
inline bool kq_amx_start(int64_t M) {
#ifdef FITSERVE_AMX_INT8
  if (!kq_no_amx<P>::value && M >= kKqAmxMinRows && fitserve::amx_usable()) {
    kq_amx_configure<P>();
    return true;
  }
#endif
  (void)M;
  return false;
}

inline void kq_amx_end(bool amx) {
#ifdef FITSERVE_AMX_INT8
  if (amx) _tile_release();
#endif
  (void)amx;
}

}  // namespace fitserve::ggml
#endif  // FS_GGML_AVX512
