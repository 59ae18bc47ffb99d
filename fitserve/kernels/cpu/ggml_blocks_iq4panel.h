// IQ4_XS's "lane = output row" panel on AVX512-VNNI (ggml_blocks_kqpanel.h has the layout, the
// drivers and the K-quant panels): each super-block of 16 weight rows decoded once per call into
//
//   codes[8s + c][l] = the table values + 128 (unsigned bytes, 1..241) of columns 32s + 4c ..
//                      32s + 4c + 3 of row l: x's natural order (IQ4_XS's sub-block s holds
//                      columns 0-15 in the low nibbles of its 16 bytes, 16-31 in the high)
//   sc[s][l]         = row l's ls - 32 of sub-block s (-32..31), int32
//   mp[q][l]         = its (ls - 32) of sub-blocks 2q, 2q + 1 as int16 pairs (the +128's term)
//   d[l]             fp32
//
// so the tiles are Q4_K's (per 32 columns and row of x: 8 VPDPBUSD, one vpmulld by the scale),
// and a super-block ends as IQ4XS::step (the GEMV) ends it: the exact integer
// R = sum_s ls_s * (dot_s(v + 128, x) - 128 * sum_32 x) then acc = fma(cvt(R), d * da, acc).
// Bounds: |dot_s(v + 128, x)| <= 32 * 241 * 127 < 2^20, times |ls| <= 32, 8 sub-blocks: < 2^28.
// No AMX tiles (kNoAmx): an AMX plane of the codes would need unsigned codes times the scale's
// digits below 256, which the biased table values (up to 241) are not.
#pragma once

#include "ggml_blocks_kquant.h"

#ifdef FS_GGML_VNNI

namespace fitserve::ggml {

struct IQ4XSPanel {
  static constexpr int64_t kBytes = 136;
  static constexpr int kZmm = 64 + 8 + 4 + 1;  // codes, sc, mp, d
  static constexpr int kChunkDwords = 8;         // codes' dwords per scale (32 columns)
  static constexpr bool kNoAmx = true;
  // NOTE: M from which the panels run (M = 1: IQ4XS::row, the GEMV). G MAC/s against the
  // row tiles they replace (bench_m_rows.py --interleave, 2 threads, Zen 4, trees alternated):
  // 2048x2048 / 8192x2048 M = 2 74-91 vs 56-61, M = 3 96-117 vs 47-51; three shapes M = 32
  // 246-297 vs 193-226 (the lane tiles over transposed x before: docs/benchmarks.md)
  static constexpr int kMinRows = 2;

  // kDigits (the AMX planes): never taken (kNoAmx), the same decode
  template <bool kDigits = false>
  static void pack(const uint8_t* const* rows, __m512i idx, int64_t sb, __m512i* p) {
    const __m512i table = biased_table512<kIq4Values>();
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    FS_GGML_UNROLL for (int h = 0; h < 2; ++h) {  // qs bytes 64h .. 64h + 63: sub-blocks 4h .. 4h + 3
      __m512i r[16];
      FS_GGML_UNROLL for (int l = 0; l < 16; ++l)
        r[l] = _mm512_loadu_si512(rows[l] + sb * kBytes + 8 + 64 * h);
      transpose16(r);  // r[e]: bytes 4e .. 4e + 3 of each row's half
      FS_GGML_UNROLL for (int e = 0; e < 16; ++e) {
        const int s = 4 * h + e / 4, j = e % 4;
        _mm512_store_si512(p + 8 * s + j, _mm512_shuffle_epi8(table, _mm512_and_si512(r[e], m4)));
        _mm512_store_si512(p + 8 * s + 4 + j, _mm512_shuffle_epi8(
            table, _mm512_and_si512(_mm512_srli_epi16(r[e], 4), m4)));
      }
    }
    const uint8_t* b0 = rows[0] + sb * kBytes;
    const __m512i head = gather_rows(b0, idx, 0);  // d | scales_h << 16
    const __m512i sl = gather_rows(b0, idx, 4);    // scales_l[0..3]
    const __m512i hi2 = _mm512_srli_epi32(head, 16);
    __m512i ls[8];
    FS_GGML_UNROLL for (int s = 0; s < 8; ++s) {
      const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sl, 8 * (s / 2) + 4 * (s % 2)),
                                          _mm512_set1_epi32(15));
      const __m512i hi = _mm512_slli_epi32(
          _mm512_and_si512(_mm512_srli_epi32(hi2, 2 * s), _mm512_set1_epi32(3)), 4);
      ls[s] = _mm512_sub_epi32(_mm512_or_si512(lo, hi), _mm512_set1_epi32(32));
      _mm512_store_si512(p + 64 + s, ls[s]);
    }
    FS_GGML_UNROLL for (int q = 0; q < 4; ++q)
      _mm512_store_si512(p + 72 + q, _mm512_or_si512(
          _mm512_and_si512(ls[2 * q], _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(ls[2 * q + 1], 16)));
    _mm512_store_ps(reinterpret_cast<float*>(p + 76), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)));
  }

  // One super-block's end for row m of x: the +128's term (sum_s ls_s * x's 32-column sums, as
  // int16 pairs) taken off the exact sum, then IQ4XS::step's fp32 op.
  [[gnu::always_inline]] static void finish(const __m512i* p, int64_t sb, const Act& a, int64_t m,
                                            __m512i isum, __m512& acc) {
    __m512i msum = _mm512_setzero_si512();
    const uint8_t* s = reinterpret_cast<const uint8_t*>(a.s32row(m) + sb * 8);
    FS_GGML_UNROLL for (int q = 0; q < 4; ++q)
      msum = _mm512_dpwssd_epi32(msum, _mm512_load_si512(p + 72 + q),
                                 _mm512_set1_epi32(static_cast<int>(load_u32(s + 4 * q))));
    const __m512i r = _mm512_sub_epi32(isum, _mm512_slli_epi32(msum, 7));
    const __m512 d = _mm512_load_ps(reinterpret_cast<const float*>(p + 76));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r), _mm512_mul_ps(d, _mm512_set1_ps(a.drow(m)[sb])), acc);
  }
};

}  // namespace fitserve::ggml

#endif  // FS_GGML_VNNI
