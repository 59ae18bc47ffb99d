// Q5_0 and Q5_1 blocks (32 columns) against Q8_0-style activations (one scale per 32 columns,
// ggml_blocks_act.h), with the same `row<MT>` interface as ggml_blocks_kquant.h.
//
//   Q5_0 22 B: d f16, qh u32, qs[16]   q = nibble | bit j of qh << 4 (column j: the low nibble
//              of qs[j] for j < 16, the high nibble of qs[j - 16] above); w = d * (q - 16)
//   Q5_1 24 B: d f16, m f16, qh u32, qs[16]; w = d * q + m
//
// Per block and row of x: y += d * da * sum(q * a) + c * da * sum(a), c = -16 d (Q5_0) or m.
#pragma once

#include "ggml_blocks_act.h"

namespace fitserve::ggml {

template <bool kMin>
struct Q5 {
  static constexpr int64_t kQK = 32, kBytes = kMin ? 24 : 22, kActBlock = 32;
  static constexpr int64_t kQhOff = kMin ? 4 : 2, kQsOff = kQhOff + 4;

  static float offset(const uint8_t* b, float d) { return kMin ? f16_at(b + 2) : -16.f * d; }

#ifndef FS_GGML_AVX2
  template <int MT>
  static void row(const uint8_t* w, int64_t nb, const Act& a, int64_t m0, float* res) {
    float acc[MT] = {};
    uint8_t q[32];
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* b = w + k * kBytes;
      const float d = f16_at(b), c = offset(b, d);
      const uint32_t qh = load_u32(b + kQhOff);
      for (int j = 0; j < 16; ++j) {
        q[j] = (b[kQsOff + j] & 15) | (((qh >> j) & 1) << 4);
        q[j + 16] = (b[kQsOff + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      for (int i = 0; i < MT; ++i) {
        const int8_t* aq = a.qrow(m0 + i) + 32 * k;
        int32_t dot = 0;
        for (int j = 0; j < 32; ++j) dot += q[j] * aq[j];
        const float da = a.drow(m0 + i)[k];
        acc[i] += d * da * static_cast<float>(dot) +
                  c * da * static_cast<float>(a.s32row(m0 + i)[k]);
      }
    }
    for (int i = 0; i < MT; ++i) res[i] = acc[i];
  }
#else
  template <int MT>
  static void row(const uint8_t* w, int64_t nb, const Act& a, int64_t m0, float* res) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MT];
    float off[MT];
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
      acc[i] = _mm256_setzero_ps();
      off[i] = 0.f;
    }
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* b = w + k * kBytes;
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQsOff));
      const __m256i u = _mm256_or_si256(
          _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4),
          bits_to_0x10(load_u32(b + kQhOff)));
      const float d = f16_at(b), c = offset(b, d);
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
        const __m256i av =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + i) + 32 * k));
        const float da = a.drow(m0 + i)[k];
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, av)), _mm256_set1_ps(d * da),
                                 acc[i]);
        off[i] += c * da * static_cast<float>(a.s32row(m0 + i)[k]);
      }
    }
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) res[i] = hsum(acc[i]) + off[i];
  }
#endif
};

using Q5_0 = Q5<false>;
using Q5_1 = Q5<true>;

}  // namespace fitserve::ggml
