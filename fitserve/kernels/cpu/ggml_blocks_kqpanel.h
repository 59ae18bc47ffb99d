// The K-quants' M > 1 path on AVX-512: "lane = output row" panels (as qlinear_panel.h does for
// the packed int4 / int8 weights). Each super-block of 16 weight rows is decoded ONCE per call
// into a thread-local panel, dword by dword transposed:
//
//   codes[c][l] = the 4 u8 codes at x's storage dword c (of the super-block's 64) of row n0 + l
//   sc[k][l]    = row l's scale of the 32 (Q6_K: 16) columns of chunk k, int32
//   mp[p][l]    = Q4_K / Q5_K: row l's mins m[2p] | m[2p+1] << 16 (int16 pairs, column order)
//                 Q6_K: its scales sc[2p] | sc[2p+1] << 16 (the -32 offset's pairs)
//   d[l], dmin[l] fp32
//
// then every tile of MT rows of x reads it: per dword one VPDPBUSD with x's 4 int8 values
// broadcast covers 16 outputs (no horizontal sums), per chunk one vpmulld by the scales, per
// super-block 4 (Q6_K 8) vpdpwssd for the mins (offset) against x's int16 sums. Against the row
// tiles (ggml_blocks_kq512.h: per 64 weights and row of x a maddubs and a vpdpwssd, plus the
// per-pair reductions) that is about half the ops per output at M >= 8.
//
// Batch invariance: each lane computes the canonical order of q45k_tile512 / q6k_tile512 (the
// exact integers isum, msum per super-block, then the same fp32 ops), so row m has the bits of
// row m alone (the GEMV) whatever M and tile.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ggml_blocks_act.h"

#ifdef FS_GGML_AVX512

namespace fitserve::ggml {

constexpr int kPanelLanes = 16;
// NOTE: rows of x per panel tile: 4 (one thread, CPU clock, 2048x2048 M = 30, alternated in one
// process, loaded host: Q4_K 2 / 4 / 6 rows 715 / 625 / 698 us, 5 and 8 spill: 1.8x slower)
constexpr int kKqPanelTile = 4;

// acc + the u8 x s8 dot of each 4-byte lane group (VPDPBUSD; two ops without VNNI: codes <= 63,
// so maddubs never saturates).
[[gnu::always_inline]] inline __m512i dpbusd512(__m512i acc, __m512i u, __m512i s) {
#ifdef FS_GGML_VNNI
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

// r[0..15] (16 dwords each) transposed in place: r[c] dword l = old r[l] dword c.
[[gnu::always_inline]] inline void transpose16(__m512i* r) {
  __m512i t[16];
  FS_GGML_UNROLL for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  FS_GGML_UNROLL for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + e]: 128-bit lane L holds dword e of 4-row group L of rows 4q .. 4q + 3 ... as
  // [row 4q, 4q+1, 4q+2, 4q+3] of column 4L + e
  FS_GGML_UNROLL for (int e = 0; e < 4; ++e) {
    const __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88);
    const __m512i b = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88);
    const __m512i d = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xDD);
    t[e] = _mm512_shuffle_i32x4(a, c, 0x88);       // column e
    t[8 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);   // column 8 + e
    t[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88);   // column 4 + e
    t[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);  // column 12 + e
  }
  FS_GGML_UNROLL for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// The 16 rows' dwords at byte `off` of their super-block (lanes past `live` repeat row 0).
[[gnu::always_inline]] inline __m512i gather_rows(const uint8_t* base, __m512i idx, int off) {
  return _mm512_i32gather_epi32(idx, reinterpret_cast<const int*>(base + off), 1);
}

// MT rows of x against one panel of P (kq_panel_rows): per storage dword of codes one VPDPBUSD
// with x's 4 bytes broadcast, per chunk of P::kChunkDwords dwords one vpmulld by the chunk's
// scale (codes at p[0..63], scales at p[64 + k]), then P::finish per super-block. The integers
// are exact in any order, so row m keeps its own bits.
template <class P, int MT>
[[gnu::always_inline]] inline void panel_tile(const __m512i* panel, int64_t nsb, const Act& a,
                                              int64_t m0, __m512* acc) {
  constexpr int kDw = P::kChunkDwords, kChunks = 64 / kDw;
  const int8_t* aq[MT];
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i) aq[i] = a.qrow(m0 + i);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const __m512i* p = panel + sb * P::kZmm;
    __m512i isum[MT];
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) isum[i] = _mm512_setzero_si512();
    FS_GGML_UNROLL for (int k = 0; k < kChunks; ++k) {
      __m512i d0[MT], d1[MT];
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) d0[i] = d1[i] = _mm512_setzero_si512();
      FS_GGML_UNROLL for (int c = 0; c < kDw; c += 2) {
        const __m512i w0 = _mm512_load_si512(p + kDw * k + c), w1 = _mm512_load_si512(p + kDw * k + c + 1);
        FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
          const uint8_t* x = reinterpret_cast<const uint8_t*>(aq[i] + sb * 256 + 4 * (kDw * k + c));
          d0[i] = dpbusd512(d0[i], w0, _mm512_set1_epi32(static_cast<int>(load_u32(x))));
          d1[i] = dpbusd512(d1[i], w1, _mm512_set1_epi32(static_cast<int>(load_u32(x + 4))));
        }
      }
      const __m512i sc = _mm512_load_si512(p + 64 + k);
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i)
        isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(_mm512_add_epi32(d0[i], d1[i]), sc));
    }
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) P::finish(p, sb, a, m0 + i, isum[i], acc[i]);
  }
}

// Per type: kZmm per super-block, kChunkDwords, pack(rows, idx, sb, panel), finish(...).
template <bool kHigh>
struct Q45KPanel {
  static constexpr int64_t kBytes = kHigh ? 176 : 144, kQsOff = kHigh ? 48 : 16;
  static constexpr int kZmm = 64 + 8 + 4 + 2;  // codes, sc, mp, d / dmin
  static constexpr int kChunkDwords = 8;         // codes' dwords per scale (32 columns)
  // NOTE: M from which the panels run: panel / row tiles per call, 2048x2048, one thread, CPU
  // clock, alternated: M = 4 1.03, 6 0.94, 8 0.92, 12 0.73, 16 0.74 (Q4_K)
  static constexpr int kMinRows = 6;

  // kDigits (the AMX panel, ggml_blocks_kqamx.h): the codes times their chunk scale's high
  // digit (sc >> 3) in place of the codes, times its low digit (sc & 7) at p + kZmm.
  template <bool kDigits = false>
  static void pack(const uint8_t* const* rows, __m512i idx, int64_t sb, __m512i* p) {
    const uint8_t* b0 = rows[0] + sb * kBytes;
    // scales and mins (get_scale_min_k4 lane-wise), d / dmin
    const __m512i hd = gather_rows(b0, idx, 0), u0 = gather_rows(b0, idx, 4),
                  u1 = gather_rows(b0, idx, 8), u2 = gather_rows(b0, idx, 12);
    const __m512i k3f = _mm512_set1_epi32(0x3f3f3f3f), k0f = _mm512_set1_epi32(0x0f0f0f0f),
                  k03 = _mm512_set1_epi32(0x03030303), kff = _mm512_set1_epi32(0xFF);
    const __m512i sc_lo = _mm512_and_si512(u0, k3f), mn_lo = _mm512_and_si512(u1, k3f);
    const __m512i sc_hi = _mm512_or_si512(
        _mm512_and_si512(u2, k0f), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), k03), 4));
    const __m512i mn_hi = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32(u2, 4), k0f),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), k03), 4));
    // chunk k = 4c + 2h + e' (storage order) is sub-block 4c + h + 2e'
    FS_GGML_UNROLL for (int k = 0; k < 8; ++k) {
      const int s = 4 * (k / 4) + (k % 4) / 2 + 2 * (k % 2);
      const __m512i v = s < 4 ? sc_lo : sc_hi;
      _mm512_store_si512(p + 64 + k, _mm512_and_si512(_mm512_srli_epi32(v, 8 * (s % 4)), kff));
    }
    const __m512i kw = _mm512_set1_epi32(0x00FF00FF);
    FS_GGML_UNROLL for (int q = 0; q < 4; ++q) {  // m[2q] | m[2q+1] << 16
      const __m512i v = _mm512_and_si512(_mm512_srli_epi32(q < 2 ? mn_lo : mn_hi, 16 * (q % 2)),
                                         _mm512_set1_epi32(0xFFFF));
      _mm512_store_si512(p + 72 + q, _mm512_and_si512(
          _mm512_or_si512(v, _mm512_slli_epi32(v, 8)), kw));
    }
    _mm512_store_ps(reinterpret_cast<float*>(p + 76), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hd)));
    _mm512_store_ps(reinterpret_cast<float*>(p + 77),
                    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hd, 16))));
    // the 8 chunk scales' digits as words (both halves of each lane's dword)
    alignas(64) __m512i dg[kDigits ? 16 : 1];
    if constexpr (kDigits)
      FS_GGML_UNROLL for (int k = 0; k < 8; ++k) {
        const __m512i sc = _mm512_load_si512(p + 64 + k);
        const __m512i hi = _mm512_srli_epi32(sc, 3), lo = _mm512_and_si512(sc, _mm512_set1_epi32(7));
        dg[2 * k] = _mm512_or_si512(hi, _mm512_slli_epi32(hi, 16));
        dg[2 * k + 1] = _mm512_or_si512(lo, _mm512_slli_epi32(lo, 16));
      }
    const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F), m10 = _mm512_set1_epi8(0x10);
    // qs: 32 dwords per row, transposed in two halves; lo / hi nibbles -> storage dwords
    // 32c + e / 32c + 16 + e (c = half, e = dword in it: x's permuted order, see kq512.h)
    __m512i qh[8];
    if constexpr (kHigh) {
      __m512i r[16];
      FS_GGML_UNROLL for (int l = 0; l < 16; ++l)
        r[l] = _mm512_zextsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[l] + sb * kBytes + 16)));
      transpose16(r);
      FS_GGML_UNROLL for (int e = 0; e < 8; ++e) qh[e] = r[e];
    }
    FS_GGML_UNROLL for (int c = 0; c < 2; ++c) {
      __m512i r[16];
      FS_GGML_UNROLL for (int l = 0; l < 16; ++l)
        r[l] = _mm512_loadu_si512(rows[l] + sb * kBytes + kQsOff + 64 * c);
      transpose16(r);
      FS_GGML_UNROLL for (int e = 0; e < 16; ++e) {
        __m512i lo = _mm512_and_si512(r[e], m4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(r[e], 4), m4);
        if constexpr (kHigh) {  // sub-block s takes bit s of qh byte (column % 32)
          const int s_lo = 4 * c + 2 * (e / 8), s_hi = s_lo + 1;
          const __m512i h = qh[e % 8];
          lo = _mm512_or_si512(lo, _mm512_and_si512(bit_to_0x10_512(h, s_lo), m10));
          hi = _mm512_or_si512(hi, _mm512_and_si512(bit_to_0x10_512(h, s_hi), m10));
        }
        store_codes<kDigits>(p, 32 * c + e, lo, dg);
        store_codes<kDigits>(p, 32 * c + 16 + e, hi, dg);
      }
    }
  }

  // Storage dword c's 16 lanes of codes, or (kDigits) their two digit products.
  // NOTE: vpmullw on words: a code (<= 31) times a digit (<= 7) stays below 256, no carry crosses.
  template <bool kDigits>
  [[gnu::always_inline]] static void store_codes(__m512i* p, int c, __m512i q, const __m512i* dg) {
    if constexpr (kDigits) {
      _mm512_store_si512(p + c, _mm512_mullo_epi16(q, _mm512_load_si512(dg + 2 * (c / 8))));
      _mm512_store_si512(p + kZmm + c, _mm512_mullo_epi16(q, _mm512_load_si512(dg + 2 * (c / 8) + 1)));
    } else {
      (void)dg;
      _mm512_store_si512(p + c, q);
    }
  }

  // Bit s of every byte moved to bit 4 (other bits are masked by the caller's 0x10).
  [[gnu::always_inline]] static __m512i bit_to_0x10_512(__m512i v, int s) {
    return s < 4 ? _mm512_slli_epi16(v, 4 - s) : _mm512_srli_epi16(v, s - 4);
  }

  // One super-block's end for row m of x: the mins' term (msum, against x's int16 sums per 32
  // columns) and kq512.h's canonical fp32 order. Shared by the VNNI and AMX tiles (the bits).
  [[gnu::always_inline]] static void finish(const __m512i* p, int64_t sb, const Act& a, int64_t m,
                                            __m512i isum, __m512& acc) {
    __m512i msum = _mm512_setzero_si512();
    const uint8_t* s = reinterpret_cast<const uint8_t*>(a.s32row(m) + sb * 8);
    FS_GGML_UNROLL for (int q = 0; q < 4; ++q)
      msum = madd_acc512(msum, _mm512_load_si512(p + 72 + q),
                         _mm512_set1_epi32(static_cast<int>(load_u32(s + 4 * q))));
    const __m512 d = _mm512_load_ps(reinterpret_cast<const float*>(p + 76));
    const __m512 dmin = _mm512_load_ps(reinterpret_cast<const float*>(p + 77));
    const __m512 da = _mm512_set1_ps(a.drow(m)[sb]);
    const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, da));
    const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, da), u);
    acc = _mm512_add_ps(acc, t);
  }
};

}  // namespace fitserve::ggml

#include "ggml_blocks_kqpanel6.h"
#include "ggml_blocks_kqamx.h"

namespace fitserve::ggml {

// MT rows of x (m0 ..) against one panel: out[(m0 + i) * N + n0 + l] for lanes l < live.
template <class P, int MT>
void kq_panel_rows(const __m512i* panel, int64_t nsb, const Act& a, int64_t m0, int64_t n0,
                   int64_t N, __mmask16 live, float* out) {
  __m512 acc[MT];
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  panel_tile<P, MT>(panel, nsb, a, m0, acc);
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i)
    _mm512_mask_storeu_ps(out + (m0 + i) * N + n0, live, acc[i]);
}

// MT rows of x against two panels (32 weight rows) as one register tile: per dword of codes,
// MT broadcasts of x (pinned in registers) and 2 loads of codes feed 2 * MT VPDPBUSD.
// NOTE: panel_tile (one panel) folds each broadcast of x into its VPDPBUSD as a memory operand,
// a load per VPDPBUSD (Zen 4 loads one zmm per cycle): Q4_K ran at ~125 G MAC/s per core. Each
// chunk's integer dot and its product with the scale are the same numbers, then P::finish:
// each lane keeps its row-alone bits.
template <class P, int MT>
[[gnu::noinline]] void kq_panel_rows2(const __m512i* panel0, const __m512i* panel1,
                                      int64_t nsb, const Act& act, int64_t m0, int64_t n0,
                                      int64_t N, __mmask16 live1, float* out) {
  constexpr int kDw = P::kChunkDwords, kChunks = 64 / kDw;
  const Act a = act;  // a local copy: GCC reloads a reference's fields past every store
  const __m512i* pn[2] = {panel0, panel1};
  __m512 acc[2][MT];
  FS_GGML_UNROLL for (int q = 0; q < 2; ++q)
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) acc[q][i] = _mm512_setzero_ps();
  const int8_t* aq[MT];
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i) aq[i] = a.qrow(m0 + i);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m512i isum[2][MT];
    FS_GGML_UNROLL for (int q = 0; q < 2; ++q)
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) isum[q][i] = _mm512_setzero_si512();
    FS_GGML_UNROLL for (int k = 0; k < kChunks; ++k) {
      __m512i d[2][MT];
      FS_GGML_UNROLL for (int q = 0; q < 2; ++q)
        FS_GGML_UNROLL for (int i = 0; i < MT; ++i) d[q][i] = _mm512_setzero_si512();
      FS_GGML_UNROLL for (int c = 0; c < kDw; ++c) {
        __m512i xb[MT];
        FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
          xb[i] = _mm512_set1_epi32(static_cast<int>(
              load_u32(reinterpret_cast<const uint8_t*>(aq[i] + sb * 256 + 4 * (kDw * k + c)))));
          asm("" : "+v"(xb[i]));
        }
        FS_GGML_UNROLL for (int q = 0; q < 2; ++q) {
          const __m512i w = _mm512_load_si512(pn[q] + sb * P::kZmm + kDw * k + c);
          FS_GGML_UNROLL for (int i = 0; i < MT; ++i) d[q][i] = dpbusd512(d[q][i], w, xb[i]);
        }
      }
      FS_GGML_UNROLL for (int q = 0; q < 2; ++q) {
        const __m512i sc = _mm512_load_si512(pn[q] + sb * P::kZmm + 64 + k);
        FS_GGML_UNROLL for (int i = 0; i < MT; ++i)
          isum[q][i] = _mm512_add_epi32(isum[q][i], _mm512_mullo_epi32(d[q][i], sc));
      }
    }
    FS_GGML_UNROLL for (int q = 0; q < 2; ++q)
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i)
        P::finish(pn[q] + sb * P::kZmm, sb, a, m0 + i, isum[q][i], acc[q][i]);
  }
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
    _mm512_storeu_ps(out + (m0 + i) * N + n0, acc[0][i]);
    _mm512_mask_storeu_ps(out + (m0 + i) * N + n0 + kPanelLanes, live1, acc[1][i]);
  }
}

// Weight rows [n0, min(n0 + 16, N)) packed into panel (zs zmm per super-block; amx: the AMX
// layout). Rows past N repeat row n0 (masked on store).
// NOTE: while packing, the rows of the panel after next (16 * rb contiguous bytes) are
// requested into L2, 16 super-blocks' worth per step: the pack reads 16 rows at once, which
// the hardware prefetchers did not follow from DRAM (8192x2048 Q4_K M = 8: 1.6-2x the row
// tiles' time without; one panel ahead 1.3x; two ahead 0.8x; one thread, loaded host)
template <class P>
__mmask16 kq_panel_pack(const uint8_t* W, int64_t rb, int64_t nsb, int64_t n0, int64_t N,
                        __m512i* panel, int64_t zs, bool amx) {
  const int live_n = static_cast<int>(std::min<int64_t>(kPanelLanes, N - n0));
  const uint8_t* rows[kPanelLanes];
  alignas(64) int32_t off[kPanelLanes];
  for (int l = 0; l < kPanelLanes; ++l) {
    const int64_t r = l < live_n ? l : 0;
    rows[l] = W + (n0 + r) * rb;
    off[l] = static_cast<int32_t>(r * rb);
  }
  const __m512i idx = _mm512_load_si512(off);
  const uint8_t* next = W + (n0 + 2 * kPanelLanes) * rb;
  const int64_t next_bytes = std::max<int64_t>(0, std::min<int64_t>(N - n0 - 2 * kPanelLanes,
                                                                    kPanelLanes) * rb);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    for (int64_t o = sb * kPanelLanes * P::kBytes;
         o < std::min<int64_t>(next_bytes, (sb + 1) * kPanelLanes * P::kBytes); o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T1);
    if (amx)
      P::template pack<true>(rows, idx, sb, panel + sb * zs);
    else
      P::pack(rows, idx, sb, panel + sb * zs);
  }
  return static_cast<__mmask16>((1u << live_n) - 1);
}

// Weight rows [n0, min(n0 + 16, N)) packed into a thread-local panel, then rows [0, M) of x:
// with amx (the caller configured the tiles) in AMX tiles of 16 rows, the last one short
// (ggml_blocks_kqamx.h), else in tiles of kKqPanelTile (the last of 1 .. kKqPanelTile - 1 rows).
// With `two` (not amx; n0 + 16 < N), rows [n0, min(n0 + 32, N)) as two panels in one register
// tile of kKqPanelTile rows of x (kq_panel_rows2), the last rows of x one panel at a time.
template <class P>
void kq_panel_run(const uint8_t* W, int64_t rb, int64_t nsb, const Act& a, int64_t M, int64_t n0,
                  int64_t N, float* out, bool amx, bool two = false) {
  static thread_local std::vector<__m512i> buf;
  const int64_t zs = amx ? kq_amx_zmm<P>() : P::kZmm;  // zmm per super-block
  if (static_cast<int64_t>(buf.size()) < 2 * nsb * zs) buf.resize(2 * nsb * zs);
  __m512i* p0 = buf.data();
  const __mmask16 live = kq_panel_pack<P>(W, rb, nsb, n0, N, p0, zs, amx);
#ifdef FITSERVE_AMX_INT8
  if (amx) {
    for (int64_t m = 0; m < M; m += kKqAmxRows)
      kq_amx_rows<P>(p0, nsb, a, m, std::min(kKqAmxRows, M - m), n0, N, live, out);
    return;
  }
#endif
  // rows [m, M) of x against one panel: tiles of kKqPanelTile, the last of 1 .. kKqPanelTile - 1
  auto rows = [&](const __m512i* p, int64_t n, __mmask16 lv, int64_t m) {
    for (; m + kKqPanelTile <= M; m += kKqPanelTile)
      kq_panel_rows<P, kKqPanelTile>(p, nsb, a, m, n, N, lv, out);
    switch (M - m) {
      case 1: return kq_panel_rows<P, 1>(p, nsb, a, m, n, N, lv, out);
      case 2: return kq_panel_rows<P, 2>(p, nsb, a, m, n, N, lv, out);
      case 3: return kq_panel_rows<P, 3>(p, nsb, a, m, n, N, lv, out);
      default: return;
    }
  };
  if (!two) return rows(p0, n0, live, 0);
  const int64_t n1 = n0 + kPanelLanes;
  __m512i* p1 = buf.data() + nsb * zs;
  const __mmask16 live1 = kq_panel_pack<P>(W, rb, nsb, n1, N, p1, zs, false);
  int64_t m = 0;
  for (; m + kKqPanelTile <= M; m += kKqPanelTile)
    kq_panel_rows2<P, kKqPanelTile>(p0, p1, nsb, a, m, n0, N, live1, out);
  rows(p0, n0, live, m);
  rows(p1, n1, live1, m);
}

}  // namespace fitserve::ggml

#endif  // FS_GGML_AVX512
