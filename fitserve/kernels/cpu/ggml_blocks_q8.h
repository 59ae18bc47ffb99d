// Q8_0 blocks (32 columns) against Q8_0-style activations (one scale per 32 columns,
// ggml_blocks_act.h), with the `row<MT>` interface of ggml_blocks_kquant.h.
//
//   Q8_0 34 B: d f16, qs[32] int8; w = d * qs[j]
//
// Per block and row of x: y += d * da * sum(qs * a). The VNNI rows (ggml_blocks_lanes.h, 16
// blocks per step) take the codes + 128 as unsigned bytes (one xor) and subtract 128 * sum(a)
// in integers (exact: |dot| <= 32 * 255 * 127 < 2^31); AVX2 uses maddubs with the sign trick
// (|w| <= 128, |pair| <= 2 * 128 * 127 < 2^15: no saturation).
#pragma once

#include "ggml_blocks_act.h"
#include "ggml_blocks_lanes.h"

namespace fitserve::ggml {

struct Q8_0 {
  static constexpr int64_t kQK = 32, kBytes = 34, kActBlock = 32, kQsOff = 2;
  static constexpr bool kPerm128 = false;

#if defined(FS_GGML_VNNI)
  static constexpr int kShift = 7;  // dot(qs + 128, a) - 128 sum(a)
  static constexpr bool kHasMin = false;
  // The 16 d of a step (word 17 t, t < 16, of its 544 bytes) as the low words of a zmm's
  // dwords: 4 x 128 bytes (the lines the step reads anyway), one word permute each, 4 blends.
  // NOTE: head_dwords16 needs the high word too (5 parts at 34 B); Q8_0 only uses d.
  [[gnu::always_inline]] static inline __m512i heads16(const uint8_t* b, int64_t nbytes) {
    __m512i g = _mm512_setzero_si512();
    FS_GGML_UNROLL for (int p = 0; p < 4; ++p) {
      __m512i ld[2];
      FS_GGML_UNROLL for (int h = 0; h < 2; ++h) {
        const int64_t o = 128 * p + 64 * h, n = std::clamp<int64_t>(nbytes - o, 0, 64);
        ld[h] = n >= 64 ? _mm512_loadu_si512(b + o)
                        : _mm512_maskz_loadu_epi8(n > 0 ? (~0ull >> (64 - n)) : 0, b + o);
      }
      // word 2t of the result (the low word of dword t) = word 17 t of the 544 bytes, t in
      // part p (17 t / 64 == p: t = 4p .. 4p + 3)
      alignas(64) int16_t idx[32] = {};
      uint32_t mine = 0;
      for (int t = 4 * p; t < 4 * p + 4; ++t) {
        idx[2 * t] = static_cast<int16_t>((17 * t) & 63);
        mine |= 1u << (2 * t);
      }
      g = _mm512_mask_mov_epi16(g, mine,
                                _mm512_permutex2var_epi16(ld[0], _mm512_load_si512(idx), ld[1]));
    }
    return g;
  }
  [[gnu::always_inline]] static inline __m512 lane_scales(__m512i g) { return low_f16s(g); }
  [[gnu::always_inline]] static inline __m512i pair(const uint8_t* b, bool two) {
    // NOTE: two ymm loads and an insert: ~10% faster in L2 than a masked zmm load pair
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kQsOff));
    const __m512i v =
        two ? _mm512_inserti64x4(_mm512_castsi256_si512(lo),
                                 _mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(b + kBytes + kQsOff)),
                                 1)
            : _mm512_zextsi256_si512(lo);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  static constexpr bool kRowPrefetch = true;  // row(..., pf): ggml_blocks_run.h
  static constexpr bool kLanesTiles = true;   // M > 1: lanes_step_t
#endif

  template <int MT>
  static void row(const uint8_t* w, int64_t nb, const Act& a, int64_t m0, float* res,
                  [[maybe_unused]] int64_t pf = 0) {
#if defined(FS_GGML_VNNI)
    lanes_row<Q8_0, MT>(w, nb, a, m0, res, pf);
#elif defined(FS_GGML_AVX2)
    __m256 acc[2][MT];  // even / odd blocks: two FMA chains (as Q5)
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* b = w + k * kBytes;
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kQsOff));
      const __m256i wabs = _mm256_sign_epi8(wv, wv);
      const float d = f16_at(b);
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
        const __m256i av =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + i) + 32 * k));
        const __m256i dot = _mm256_madd_epi16(
            _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(av, wv)), _mm256_set1_epi16(1));
        acc[k & 1][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                        _mm256_set1_ps(d * a.drow(m0 + i)[k]), acc[k & 1][i]);
      }
    }
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) res[i] = hsum(_mm256_add_ps(acc[0][i], acc[1][i]));
#else
    float acc[MT] = {};
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* b = w + k * kBytes;
      const int8_t* qs = reinterpret_cast<const int8_t*>(b + kQsOff);
      const float d = f16_at(b);
      for (int i = 0; i < MT; ++i) {
        const int8_t* aq = a.qrow(m0 + i) + 32 * k;
        int32_t dot = 0;
        for (int j = 0; j < 32; ++j) dot += qs[j] * aq[j];
        acc[i] += d * a.drow(m0 + i)[k] * static_cast<float>(dot);
      }
    }
    for (int i = 0; i < MT; ++i) res[i] = acc[i];
#endif
  }
};

}  // namespace fitserve::ggml
