// Q4_0, Q4_1, Q5_0 and Q5_1 blocks (32 columns) against Q8_0-style activations (one scale per
// 32 columns, ggml_blocks_act.h), with the same `row<MT>` interface as ggml_blocks_kquant.h.
//
//   Q4_0 18 B: d f16, qs[16]           q = nibble (column j: the low nibble of qs[j] for j < 16,
//              the high nibble of qs[j - 16] above); w = d * (q - 8)
//   Q4_1 20 B: d f16, m f16, qs[16]; w = d * q + m
//   Q5_0 22 B: d f16, qh u32, qs[16]   q = nibble | bit j of qh << 4; w = d * (q - 16)
//   Q5_1 24 B: d f16, m f16, qh u32, qs[16]; w = d * q + m
//
// Per block and row of x: y += d * da * sum(q * a) + c * da * sum(a), c = -8 d / -16 d (Q4_0 /
// Q5_0) or m (da * sum(a) precomputed per activation block: Act::ds). For Q4_0 / Q5_0 the
// offsets are summed as d * ds and multiplied by -8 / -16 once per row.
#pragma once

#include "ggml_blocks_act.h"
#include "ggml_blocks_lanes.h"

namespace fitserve::ggml {

// kMin: a second f16 (m) after d; kFifth: a u32 of 5th bits (qh) before the nibbles.
template <bool kMin, bool kFifth>
struct NibbleBlock {
  static constexpr int64_t kQK = 32, kQhOff = kMin ? 4 : 2, kQsOff = kQhOff + (kFifth ? 4 : 0);
  static constexpr int64_t kBytes = kQsOff + 16, kActBlock = 32;
  static constexpr bool kPerm128 = false;

  // c / kOffMul: Q4_1 / Q5_1's m, or Q4_0 / Q5_0's d (times -8 / -16 once at the end)
  static float offset(const uint8_t* b, float d) { return kMin ? f16_at(b + 2) : d; }
  static constexpr float kOffMul = kMin ? 1.f : (kFifth ? -16.f : -8.f);

#if defined(FS_GGML_VNNI)
  // ggml_blocks_lanes.h: 16 blocks per step, one lane per block
  static constexpr int kShift = kMin ? -1 : (kFifth ? 4 : 3);  // Q5_0: dot(q, a) - 16 sum(a)
  static constexpr bool kHasMin = kMin;
  [[gnu::always_inline]] static inline __m512 lane_scales(__m512i g) { return low_f16s(g); }
  [[gnu::always_inline]] static inline __m512i pair(const uint8_t* b, bool two) {
    const __m512i u = nibbles_pair(b + kQsOff, b + kBytes + kQsOff, two);
    if constexpr (!kFifth) return u;
    const uint64_t qh = load_u32(b + kQhOff) |
                        (two ? uint64_t{load_u32(b + kBytes + kQhOff)} << 32 : uint64_t{0});
    return _mm512_mask_add_epi8(u, static_cast<__mmask64>(qh), u, _mm512_set1_epi8(0x10));
  }
  static constexpr bool kRowPrefetch = true;  // row(..., pf): ggml_blocks_run.h
  static constexpr bool kLanesTiles = true;   // M > 1: lanes_step_t
  template <int MT>
  static void row(const uint8_t* w, int64_t nb, const Act& a, int64_t m0, float* res,
                  int64_t pf = 0) {
    lanes_row<NibbleBlock, MT>(w, nb, a, m0, res, pf);
  }
#elif !defined(FS_GGML_AVX2)
  template <int MT>
  static void row(const uint8_t* w, int64_t nb, const Act& a, int64_t m0, float* res) {
    float acc[MT] = {};
    uint8_t q[32];
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* b = w + k * kBytes;
      const float d = f16_at(b), c = offset(b, d);
      const uint32_t qh = kFifth ? load_u32(b + kQhOff) : 0;
      for (int j = 0; j < 16; ++j) {
        q[j] = (b[kQsOff + j] & 15) | (((qh >> j) & 1) << 4);
        q[j + 16] = (b[kQsOff + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      for (int i = 0; i < MT; ++i) {
        const int8_t* aq = a.qrow(m0 + i) + 32 * k;
        int32_t dot = 0;
        for (int j = 0; j < 32; ++j) dot += q[j] * aq[j];
        acc[i] += d * a.drow(m0 + i)[k] * static_cast<float>(dot) +
                  kOffMul * c * a.dsrow(m0 + i)[k];
      }
    }
    for (int i = 0; i < MT; ++i) res[i] = acc[i];
  }
#else
  // One block against MT rows of x, into acc / off.
  template <int MT>
  [[gnu::always_inline]] static inline void block(const uint8_t* b, int64_t k, const Act& a,
                                                  int64_t m0, __m256* acc, float* off) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQsOff));
    __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v),
                                 _mm256_set1_epi8(0x0F));
    if constexpr (kFifth) {
#ifdef FS_GGML_AVX512  // the 5th bits straight from a mask register
      u = _mm256_mask_add_epi8(u, static_cast<__mmask32>(load_u32(b + kQhOff)), u,
                               _mm256_set1_epi8(0x10));
#else
      u = _mm256_or_si256(u, bits_to_0x10(load_u32(b + kQhOff)));
#endif
    }
    const float d = f16_at(b), c = offset(b, d);
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
      const __m256i av =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + i) + 32 * k));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, av)),
                               _mm256_set1_ps(d * a.drow(m0 + i)[k]), acc[i]);
      off[i] = std::fma(c, a.dsrow(m0 + i)[k], off[i]);
    }
  }

  // NOTE: two sets of accumulators (even / odd blocks): at M = 1 one FMA chain per block was
  // the limit (its latency), not the op count
  template <int MT>
  static void row(const uint8_t* w, int64_t nb, const Act& a, int64_t m0, float* res) {
    __m256 acc[2][MT];
    float off[2][MT];
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
      acc[0][i] = acc[1][i] = _mm256_setzero_ps();
      off[0][i] = off[1][i] = 0.f;
    }
    int64_t k = 0;
    for (; k + 2 <= nb; k += 2) {
      block<MT>(w + k * kBytes, k, a, m0, acc[0], off[0]);
      block<MT>(w + (k + 1) * kBytes, k + 1, a, m0, acc[1], off[1]);
    }
    if (k < nb) block<MT>(w + k * kBytes, k, a, m0, acc[0], off[0]);
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i)
      res[i] = hsum(_mm256_add_ps(acc[0][i], acc[1][i])) + kOffMul * (off[0][i] + off[1][i]);
  }
#endif
};

using Q4_0 = NibbleBlock<false, false>;
using Q4_1 = NibbleBlock<true, false>;
using Q5_0 = NibbleBlock<false, true>;
using Q5_1 = NibbleBlock<true, true>;

}  // namespace fitserve::ggml
