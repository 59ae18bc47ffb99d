// IQ4_NL and MXFP4 (32 columns, Q8_0-style activations) and IQ4_XS (256 columns, Q8_K-style)
// blocks, with the `row<MT>` interface of ggml_blocks_kquant.h. Each maps a nibble through a
// fixed 16-entry table: ggml's non-linear kIq4Values (kvalues_iq4nl), or the e2m1 values
// doubled, kMxfp4Values (kvalues_mxfp4); the tests check both against gguf-py's.
//
//   IQ4_NL  18 B: d f16, qs[16]; column j < 16: the low nibble of qs[j], else the high nibble
//                 of qs[j - 16]; w = d * kIq4Values[nibble]
//   MXFP4   17 B: e u8, qs[16] as IQ4_NL's; w = 2^(e - 128) * kMxfp4Values[nibble] (the e8m0
//                 scale halved to match the doubled table: ggml_e8m0_to_fp32_half)
//   IQ4_XS 136 B: d f16, scales_h u16, scales_l[4], qs[128]; sub-block s (32 columns, qs + 16s
//                 as IQ4_NL's qs) has the 6-bit ls = low / high nibble of scales_l[s / 2] | bits
//                 2s..2s+1 of scales_h << 4; w = d * (ls - 32) * kIq4Values[nibble]
//
// The table values are signed, so the SIMD dots use the sign trick (maddubs of |w| with x
// carrying w's sign: |pair| <= 2 * 127 * 127 < 2^15).
#pragma once

#include <array>

#include "ggml_blocks_act.h"
#include "ggml_blocks_lanes.h"

namespace fitserve::ggml {

inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// A 16-entry table + 128, as unsigned bytes (every table value is in [-128, 127])
constexpr std::array<uint8_t, 16> biased_table(const int8_t* values) {
  std::array<uint8_t, 16> t{};
  for (int j = 0; j < 16; ++j) t[j] = static_cast<uint8_t>(values[j] + 128);
  return t;
}

#ifdef FS_GGML_VNNI
// The table + 128 (biased_table) in every 128-bit lane: vpshufb's operand for nibble lookups.
template <const int8_t* kValues>
inline __m512i biased_table512() {
  static constexpr std::array<uint8_t, 16> kTabU = biased_table(kValues);
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kTabU.data())));
}
#endif

// 2^(e - 128) as float32, from its bits (e < 2: the subnormals 2^-128 and 2^-127)
inline float e8m0_half_at(const uint8_t* p) {
  const uint32_t e = p[0];
  const uint32_t bits = e < 2 ? (uint32_t{0x00200000} << e) : ((e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef FS_GGML_AVX2
// The 32 table values of the 16 bytes at qs, in column order; and their dot with x (32 int8)
// as 8 int32 lanes.
inline __m256i iq4_values32(const uint8_t* qs, const int8_t* values = kIq4Values) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v),
                                       _mm256_set1_epi8(0x0F));
  const __m256i table =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
  return _mm256_shuffle_epi8(table, nib);
}
inline __m256i iq4_pairs(__m256i w, __m256i x) {  // int16 pairs of w * x
  return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
#endif

// A 32-column block of one scale and 16 bytes of nibbles mapped through a table: IQ4_NL (f16
// d) and MXFP4 (e8m0 exponent byte).
template <bool kMx>
struct Table4Block {
  static constexpr int64_t kQK = 32, kBytes = kMx ? 17 : 18, kActBlock = 32;
  static constexpr bool kPerm128 = false;
  static constexpr int kQs = kMx ? 1 : 2;  // the codes' byte offset
  static constexpr const int8_t* kValues = kMx ? kMxfp4Values : kIq4Values;
  static float scale(const uint8_t* b) { return kMx ? e8m0_half_at(b) : f16_at(b); }

#ifdef FS_GGML_VNNI
  // ggml_blocks_lanes.h (16 blocks per step), the table read + 128 (unsigned): either table
  // (IQ4_NL's, MXFP4's doubled e2m1) fits in [-128, 127]
  static constexpr int kShift = 7;  // dot(v + 128, a) - 128 sum(a)
  static constexpr bool kHasMin = false;
  // IQ4_NL: the f16 d; MXFP4: e (byte k % 2 of dword k, S = 17) -> 2^(e - 128) as e8m0_half_at
  [[gnu::always_inline]] static inline __m512 lane_scales(__m512i g) {
    if constexpr (!kMx) {
      return low_f16s(g);
    } else {
      const __m512i e = _mm512_and_si512(
          _mm512_srlv_epi32(g, _mm512_setr_epi32(0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8)),
          _mm512_set1_epi32(0xFF));
      const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
      const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
      return _mm512_castsi512_ps(_mm512_mask_mov_epi32(
          normal, _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), sub));
    }
  }
  [[gnu::always_inline]] static inline __m512i pair(const uint8_t* b, bool two) {
    const __m512i table_u = biased_table512<kValues>();
    return _mm512_shuffle_epi8(table_u, nibbles_pair(b + kQs, b + kBytes + kQs, two));
  }
#endif

#ifdef FS_GGML_VNNI
  static constexpr bool kRowPrefetch = true;  // row(..., pf): ggml_blocks_run.h
  static constexpr bool kLanesTiles = true;   // M > 1: lanes_step_t (as Q5_0 / Q5_1 / Q8_0)
#endif
  template <int MT>
  static void row(const uint8_t* w, int64_t nb, const Act& a, int64_t m0, float* res,
                  [[maybe_unused]] int64_t pf = 0) {
#ifdef FS_GGML_VNNI
    lanes_row<Table4Block, MT>(w, nb, a, m0, res, pf);
#elif defined(FS_GGML_AVX2)
    __m256 acc[2][MT];  // even / odd blocks: two FMA chains (as Q5)
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < nb; ++k) {
      const uint8_t* b = w + k * kBytes;
      const __m256i wv = iq4_values32(b + kQs, kValues);
      const float d = scale(b);
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
        const __m256i av =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + i) + 32 * k));
        const __m256i dot = _mm256_madd_epi16(iq4_pairs(wv, av), _mm256_set1_epi16(1));
        acc[k & 1][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                        _mm256_set1_ps(d * a.drow(m0 + i)[k]), acc[k & 1][i]);
      }
    }
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) res[i] = hsum(_mm256_add_ps(acc[0][i], acc[1][i]));
#else
    float acc[MT] = {};
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* b = w + k * kBytes;
      const float d = scale(b);
      for (int i = 0; i < MT; ++i) {
        const int8_t* aq = a.qrow(m0 + i) + 32 * k;
        int32_t dot = 0;
        for (int j = 0; j < 16; ++j)
          dot += kValues[b[kQs + j] & 15] * aq[j] + kValues[b[kQs + j] >> 4] * aq[j + 16];
        acc[i] += d * a.drow(m0 + i)[k] * static_cast<float>(dot);
      }
    }
    for (int i = 0; i < MT; ++i) res[i] = acc[i];
#endif
  }
};

using IQ4NL = Table4Block<false>;
using MXFP4 = Table4Block<true>;

}  // namespace fitserve::ggml

#include "ggml_blocks_iq4panel.h"

namespace fitserve::ggml {

struct IQ4XS {
  static constexpr int64_t kQK = 256, kBytes = 136, kActBlock = 256;
  static constexpr bool kPerm128 = false;

  // the 8 sub-block scales ls - 32 (in -32..31)
  static void scales(const uint8_t* b, int16_t* ls) {
    const uint16_t h = load_u16(b + 2);
    for (int s = 0; s < 8; ++s)
      ls[s] = static_cast<int16_t>((((b[4 + s / 2] >> (4 * (s % 2))) & 15) |
                                    (((h >> (2 * s)) & 3) << 4)) - 32);
  }

#ifdef FS_GGML_AVX2
  // NOTE: the 8 scales ls - 32 as int16 words in SIMD (what scales() does, ~40 scalar ops per
  // super-block before): word s = nibble s % 2 of scales_l[s / 2] | bits 2s..2s+1 of scales_h
  // << 4, minus 32; the high bits by a multiply that puts bits 2s..2s+1 at the top of word s
  static __m128i scales8(const uint8_t* b) {
    const __m128i hmul = _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4,
                                        1 << 2, 1);
    const __m128i l4 = _mm_cvtsi32_si128(static_cast<int>(load_u32(b + 4)));
    const __m128i l8 = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(l4, l4));  // b0 b0 b1 b1 ...
    const __m128i nib = _mm_blend_epi16(_mm_and_si128(l8, _mm_set1_epi16(15)),
                                        _mm_srli_epi16(l8, 4), 0xAA);
    const __m128i hi = _mm_slli_epi16(
        _mm_srli_epi16(_mm_mullo_epi16(_mm_set1_epi16(static_cast<int16_t>(load_u16(b + 2))),
                                       hmul), 14), 4);
    return _mm_sub_epi16(_mm_or_si128(nib, hi), _mm_set1_epi16(32));
  }

  // scales8 of the super-blocks at b and b + kBytes in one ymm (words 0-7, 8-15), each op
  // once for the two
  static __m256i scales16(const uint8_t* b) {
    const __m256i hmul = _mm256_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4,
                                           1 << 2, 1, 1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6,
                                           1 << 4, 1 << 2, 1);
    const __m128i l4 = _mm_insert_epi32(_mm_cvtsi32_si128(static_cast<int>(load_u32(b + 4))),
                                        static_cast<int>(load_u32(b + kBytes + 4)), 1);
    const __m256i l8 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(l4, l4));  // b0 b0 b1 b1 ...
    const __m256i nib = _mm256_blend_epi16(_mm256_and_si256(l8, _mm256_set1_epi16(15)),
                                           _mm256_srli_epi16(l8, 4), 0xAA);
    const __m256i h =
        _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(load_u16(b + kBytes + 2))),
                         _mm_set1_epi16(static_cast<int16_t>(load_u16(b + 2))));
    const __m256i hi = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_mullo_epi16(h, hmul), 14), 4);
    return _mm256_sub_epi16(_mm256_or_si256(nib, hi), _mm256_set1_epi16(32));
  }
#endif

#ifdef FS_GGML_VNNI
  // NOTE: as ggml_blocks_lanes.h: the table read + 128, one VPDPBUSD per pair of sub-blocks and
  // row, the partials reduced to sub-block dots (lane = sub-block), - 128 sum(a) and the
  // scales ls applied as int32; a step is two super-blocks (16 sub-block lanes: one
  // block_sums16, 22 ops, where two block_sums8 cost 26), the last of an odd count alone.
  // The canonical order (batch invariance, shared with IQ4XSPanel's lane = output row tiles
  // from Panel::kMinRows rows of x): per (weight row, x row, super-block) the exact integer
  // R = sum_s ls_s * dot_s, then acc = fma(cvt(R), d * da, acc), one fp32 accumulator per
  // output, super-blocks in order.
  template <int MT, int S>
  [[gnu::always_inline]] static inline void step(const uint8_t* b, int64_t sb, const Act& a,
                                                 int64_t m0, const __m512i table_u, __m128* acc) {
    const __m256i ls16 = S == 2 ? scales16(b)
                                : _mm256_zextsi128_si256(scales8(b));
    const __m512i ls = _mm512_cvtepi16_epi32(ls16);
    __m512i wv[4 * S];
    FS_GGML_UNROLL for (int j = 0; j < 4 * S; ++j) {
      const uint8_t* q = b + (j / 4) * kBytes + 8 + 32 * (j % 4);
      wv[j] = _mm512_shuffle_epi8(table_u, nibbles_pair(q, q + 16, true));
    }
    const float d0 = f16_at(b), d1 = S == 2 ? f16_at(b + kBytes) : 0.f;
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
      const int8_t* aq = a.qrow(m0 + i) + sb * 256;
      __m512i v[8];
      FS_GGML_UNROLL for (int j = 0; j < 8; ++j)
        v[j] = j < 4 * S ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j],
                                               _mm512_loadu_si512(aq + 64 * j))
                         : _mm512_setzero_si512();
      const __m512i s32 = _mm512_cvtepi16_epi32(
          _mm256_maskz_loadu_epi16(S == 2 ? 0xFFFF : 0x00FF, a.s32row(m0 + i) + sb * 8));
      const __m512i dot = _mm512_mullo_epi32(
          _mm512_sub_epi32(S == 2 ? block_sums16(v) : _mm512_zextsi256_si512(block_sums8(v)),
                           _mm512_slli_epi32(s32, 7)), ls);
      // R of super-block sb in lane 0, of sb + 1 in lane 8 (integer adds: exact)
      __m512i t = _mm512_add_epi32(dot, _mm512_shuffle_i32x4(dot, dot, _MM_SHUFFLE(2, 3, 0, 1)));
      t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
      t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
      const float* da = a.drow(m0 + i) + sb;
      acc[i] = _mm_fmadd_ss(_mm_cvtepi32_ps(_mm512_castsi512_si128(t)), _mm_set_ss(d0 * da[0]),
                            acc[i]);
      if constexpr (S == 2)
        acc[i] = _mm_fmadd_ss(_mm_cvtepi32_ps(_mm512_extracti32x4_epi32(t, 2)),
                              _mm_set_ss(d1 * da[1]), acc[i]);
    }
  }

  static constexpr bool kRowPrefetch = true;  // row(..., pf): ggml_blocks_run.h
  using Panel = IQ4XSPanel;                   // M >= Panel::kMinRows (ggml_blocks_iq4panel.h)
  template <int MT>
  static void row(const uint8_t* w, int64_t nsb, const Act& a, int64_t m0, float* res,
                  int64_t pf = 0) {
    const __m512i tab = biased_table512<kIq4Values>();
    __m128 acc[MT];
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) acc[i] = _mm_setzero_ps();
    int64_t sb = 0;
    for (; sb + 2 <= nsb; sb += 2) {
      if (pf > 0) prefetch_span(w + sb * kBytes + pf, 2 * kBytes);
      step<MT, 2>(w + sb * kBytes, sb, a, m0, tab, acc);
    }
    if (sb < nsb) step<MT, 1>(w + sb * kBytes, sb, a, m0, tab, acc);
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) res[i] = _mm_cvtss_f32(acc[i]);
  }
#else
  template <int MT>
  static void row(const uint8_t* w, int64_t nsb, const Act& a, int64_t m0, float* res) {
#ifdef FS_GGML_AVX2
    __m256 acc[MT];
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + sb * kBytes;
      const __m256i sc16 = _mm256_broadcastsi128_si256(scales8(b));
      __m256i ia[2][MT];  // even / odd sub-blocks: two vpdpwssd / madd chains
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) ia[0][i] = ia[1][i] = _mm256_setzero_si256();
      FS_GGML_UNROLL for (int s = 0; s < 8; ++s) {
        const __m256i wv = iq4_values32(b + 8 + 16 * s);
        const __m256i sv = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(word_sel(s)));
        FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
          const __m256i av = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(a.qrow(m0 + i) + sb * 256 + 32 * s));
          ia[s & 1][i] = madd_acc(ia[s & 1][i], iq4_pairs(wv, av), sv);
        }
      }
      const float d = f16_at(b);
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ia[0][i], ia[1][i])),
                                 _mm256_set1_ps(d * a.drow(m0 + i)[sb]), acc[i]);
    }
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) res[i] = hsum(acc[i]);
#else
    float acc[MT] = {};
    int16_t ls[8];
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + sb * kBytes;
      scales(b, ls);
      const float d = f16_at(b);
      for (int i = 0; i < MT; ++i) {
        const int8_t* aq = a.qrow(m0 + i) + sb * 256;
        int32_t isum = 0;
        for (int s = 0; s < 8; ++s) {
          const uint8_t* qs = b + 8 + 16 * s;
          int32_t dot = 0;
          for (int j = 0; j < 16; ++j)
            dot += kIq4Values[qs[j] & 15] * aq[32 * s + j] +
                   kIq4Values[qs[j] >> 4] * aq[32 * s + 16 + j];
          isum += ls[s] * dot;
        }
        acc[i] += d * a.drow(m0 + i)[sb] * static_cast<float>(isum);
      }
    }
    for (int i = 0; i < MT; ++i) res[i] = acc[i];
#endif
  }
#endif
};

}  // namespace fitserve::ggml
