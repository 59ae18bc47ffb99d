// SIMD building blocks of the fused paged decode kernels (paged_attention.cpp for 32/16-bit
// caches, paged_attention_kvq.cpp for int8/fp8 ones): the ISA tier macros, fp32 scores
// q . K rows, P @ V accumulation and the online-softmax step on AVX-512 and AVX2.
// Included by one .cpp each (every kernel source is its own extension): anonymous namespace.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if (defined(FITSERVE_TIER_AVX512_VNNI) || defined(FITSERVE_TIER_AVX512)) && \
    defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include "simd_exp.h"
#define FS_AVX512 1
#else
#define FS_AVX512 0
#endif
// The AVX2 + FMA tier (Zen 2/3, Haswell..Ice Lake client): the same tile in 8 lanes.
#if !FS_AVX512 && defined(FITSERVE_TIER_AVX2) && defined(__AVX2__) && defined(__FMA__) && \
    defined(__F16C__)
#include <immintrin.h>
#include "simd_exp.h"
#define FS_AVX2 1
#else
#define FS_AVX2 0
#endif
// bf16 q . k with VDPBF16PS (AVX512_BF16: Cooper Lake, Sapphire Rapids, Zen 4): the products of
// two bf16 values are exact in fp32 and the sums accumulate in fp32, so nothing is rounded that
// the fp32 path keeps, while K needs no widening and half the instructions.
#if FS_AVX512 && defined(__AVX512BF16__)
#define FS_BF16DOT 1
#else
#define FS_BF16DOT 0
#endif

namespace {

constexpr int64_t kTile = 64;   // keys per online-softmax step
constexpr int64_t kLanes = 16;  // fp32 lanes of one AVX-512 register
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if FS_AVX512
inline __mmask16 tail_mask(int64_t n) {
  return n >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

inline __m512 bf16x16_to_f32(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 x 16 dwords in registers: r[j] (key j's 16 pairs) -> out[i] (pair i of the 16 keys).
inline void transpose16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane L: rows 2k, 2k+1 of columns 4L .. 4L+3
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k + m], lane L: rows 4k .. 4k+3 of column 4L + m
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // 4 x 4 transpose of 128-bit lanes across u[m], u[4+m], ...
    const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    out[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    out[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    out[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    out[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// Horizontal sums of 16 registers at once: lane j of the result is the sum of a[j]'s lanes.
// A transpose-and-add tree (~45 ops) instead of 16 separate reductions (~130 ops).
inline __m512 reduce16(const __m512* a) {
  __m512 t[8];
  for (int i = 0; i < 8; ++i)  // lane-local pairs: [a0_0+a0_2, a1_0+a1_2, a0_1+a0_3, a1_1+a1_3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 u[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a(4i), a(4i+1), a(4i+2), a(4i+3)] partials
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 w[2];
  for (int i = 0; i < 2; ++i)  // [u(2i) l0+l1, u(2i) l2+l3, u(2i+1) l0+l1, u(2i+1) l2+l3]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                       _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// s[0..n) = q . rows[0..n) for one query head; NCH = ceil(D / 16) registers per row.
template <int NCH>
inline void scores_avx512(const float* q, const float* const* rows, int64_t n, __mmask16 tail,
                          float* s) {
  __m512 qv[NCH];
  for (int c = 0; c < NCH; ++c) qv[c] = _mm512_loadu_ps(q + c * kLanes);  // zero-padded
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const int64_t cnt = std::min<int64_t>(kLanes, n - i0);
    __m512 a[kLanes];
    // NOTE: branch-free and fully unrolled so a[] and qv[] stay in registers; lanes past cnt
    // recompute row i0 and are dropped by the masked store.
#pragma GCC unroll 16
    for (int64_t j = 0; j < kLanes; ++j) {
      const float* r = rows[i0 + (j < cnt ? j : 0)];
      __m512 acc = _mm512_mul_ps(qv[NCH - 1], _mm512_maskz_loadu_ps(tail, r + (NCH - 1) * kLanes));
#pragma GCC unroll 16
      for (int c = 0; c < NCH - 1; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(r + c * kLanes), acc);
      a[j] = acc;
    }
    _mm512_mask_storeu_ps(s + i0, tail_mask(cnt), reduce16(a));
  }
}

// av += p * row (NCH registers of one head's accumulator).
template <int NCH>
inline void pv_row(__m512* av, float p, const float* r, __mmask16 tail) {
  const __m512 pb = _mm512_set1_ps(p);
#pragma GCC unroll 16
  for (int c = 0; c < NCH - 1; ++c) av[c] = _mm512_fmadd_ps(pb, _mm512_loadu_ps(r + c * kLanes), av[c]);
  av[NCH - 1] = _mm512_fmadd_ps(pb, _mm512_maskz_loadu_ps(tail, r + (NCH - 1) * kLanes), av[NCH - 1]);
}

// acc[0..D) += sum_i p[i] rows[i] for one query head, the accumulator held in registers.
// NOTE: two accumulator sets (even / odd rows) when they fit in registers: one set is a chain
// of dependent FMAs per register, latency-bound at a fraction of the FMA throughput.
template <int NCH>
inline void pv_avx512(float* acc, const float* p, const float* const* rows, int64_t n,
                      __mmask16 tail) {
  constexpr int kSets = NCH <= 8 ? 2 : 1;
  __m512 av[kSets][NCH];
  for (int c = 0; c < NCH; ++c) {
    av[0][c] = _mm512_loadu_ps(acc + c * kLanes);
    if constexpr (kSets == 2) av[1][c] = _mm512_setzero_ps();
  }
  int64_t i = 0;
  if constexpr (kSets == 2) {
    for (; i + 1 < n; i += 2) {
      pv_row<NCH>(av[0], p[i], rows[i], tail);
      pv_row<NCH>(av[1], p[i + 1], rows[i + 1], tail);
    }
  }
  for (; i < n; ++i) pv_row<NCH>(av[0], p[i], rows[i], tail);
  for (int c = 0; c < NCH; ++c) {
    __m512 sum = av[0][c];
    if constexpr (kSets == 2) sum = _mm512_add_ps(sum, av[1][c]);
    _mm512_storeu_ps(acc + c * kLanes, sum);
  }
}

// Online-softmax update of one query head over a tile of n scores (in place: s becomes p).
inline void softmax_step_avx512(float* s, int64_t n, float* m, float* l, float* acc,
                                int64_t dpad) {
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < n; i += kLanes)
    mx = _mm512_mask_max_ps(mx, tail_mask(n - i), mx, _mm512_loadu_ps(s + i));
  const float m_new = std::max(*m, _mm512_reduce_max_ps(mx));
  if (m_new > *m) {  // NOTE: rescale only when the running max moves (often never after tile 1)
    const float alpha = std::exp(*m - m_new);  // exp(-inf) = 0 on the first tile
    const __m512 av = _mm512_set1_ps(alpha);
    for (int64_t c = 0; c < dpad; c += kLanes)
      _mm512_storeu_ps(acc + c, _mm512_mul_ps(av, _mm512_loadu_ps(acc + c)));
    *l *= alpha;
    *m = m_new;
  }
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
    sum = _mm512_mask_add_ps(sum, k, sum, p);
    _mm512_mask_storeu_ps(s + i, k, p);
  }
  *l += _mm512_reduce_add_ps(sum);
}
#endif  // FS_AVX512

#if FS_AVX2
constexpr int64_t kLanes8 = 8;  // fp32 lanes of one AVX2 register

// Lanes [0, n) set (n clipped to 0..8): the mask of _mm256_maskload_ps / a blend.
inline __m256i tail_mask8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, kLanes8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Lane j of the result = the sum of a[j]'s lanes (hadd tree + one cross-lane add).
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[0..n) = q . rows[0..n) for one query head; NCH = ceil(D / 8) registers per row, the last
// read through ``tail`` (never past the row: the cache's next bytes may be anything).
template <int NCH>
inline void scores_avx2(const float* q, const float* const* rows, int64_t n, __m256i tail,
                        float* s) {
  for (int64_t i0 = 0; i0 < n; i0 += kLanes8) {
    const int64_t cnt = std::min<int64_t>(kLanes8, n - i0);
    __m256 a[kLanes8];
#pragma GCC unroll 8
    for (int64_t j = 0; j < kLanes8; ++j) {
      const float* r = rows[i0 + (j < cnt ? j : 0)];
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q + (NCH - 1) * kLanes8),
                                 _mm256_maskload_ps(r + (NCH - 1) * kLanes8, tail));
#pragma GCC unroll 16
      for (int c = 0; c < NCH - 1; ++c)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * kLanes8), _mm256_loadu_ps(r + c * kLanes8),
                              acc);
      a[j] = acc;
    }
    _mm256_maskstore_ps(s + i0, tail_mask8(cnt), reduce8(a));
  }
}

// acc[0..D) += sum_i p[i] rows[i] for one query head, the accumulator held in registers (two
// sets, even / odd rows, where they fit in AVX2's 16 registers).
template <int NCH>
inline void pv_avx2(float* acc, const float* p, const float* const* rows, int64_t n,
                    __m256i tail) {
  constexpr int kSets = NCH <= 4 ? 2 : 1;
  __m256 av[kSets][NCH];
  for (int c = 0; c < NCH; ++c) {
    av[0][c] = _mm256_loadu_ps(acc + c * kLanes8);
    if constexpr (kSets == 2) av[1][c] = _mm256_setzero_ps();
  }
  auto row = [&](__m256* v, float pi, const float* r) {
    const __m256 pb = _mm256_set1_ps(pi);
#pragma GCC unroll 16
    for (int c = 0; c < NCH - 1; ++c)
      v[c] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(r + c * kLanes8), v[c]);
    v[NCH - 1] = _mm256_fmadd_ps(pb, _mm256_maskload_ps(r + (NCH - 1) * kLanes8, tail),
                                 v[NCH - 1]);
  };
  int64_t i = 0;
  if constexpr (kSets == 2) {
    for (; i + 1 < n; i += 2) {
      row(av[0], p[i], rows[i]);
      row(av[1], p[i + 1], rows[i + 1]);
    }
  }
  for (; i < n; ++i) row(av[0], p[i], rows[i]);
  for (int c = 0; c < NCH; ++c) {
    __m256 sum = av[0][c];
    if constexpr (kSets == 2) sum = _mm256_add_ps(sum, av[1][c]);
    _mm256_storeu_ps(acc + c * kLanes8, sum);
  }
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// Online-softmax update of one query head over a tile of n scores (in place: s becomes p).
inline void softmax_step_avx2(float* s, int64_t n, float* m, float* l, float* acc, int64_t dpad) {
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  __m256 mx = neg_inf;
  for (int64_t i = 0; i < n; i += kLanes8) {
    const __m256i k = tail_mask8(n - i);
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, _mm256_maskload_ps(s + i, k),
                                            _mm256_castsi256_ps(k)));
  }
  const float m_new = std::max(*m, hmax8(mx));
  if (m_new > *m) {  // NOTE: rescale only when the running max moves
    const float alpha = std::exp(*m - m_new);
    const __m256 av = _mm256_set1_ps(alpha);
    for (int64_t c = 0; c < dpad; c += kLanes8)
      _mm256_storeu_ps(acc + c, _mm256_mul_ps(av, _mm256_loadu_ps(acc + c)));
    *l *= alpha;
    *m = m_new;
  }
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes8) {
    const __m256i k = tail_mask8(n - i);
    const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(s + i, k), mv)),
                                   _mm256_castsi256_ps(k));
    sum = _mm256_add_ps(sum, p);
    _mm256_maskstore_ps(s + i, k, p);
  }
  *l += hsum8(sum);
}
#endif  // FS_AVX2

}  // namespace
