// fitserve_dense::bf16_gemv's row: one bf16 weight row . bf16 x in fp32, in one fixed order
// (VDPBF16PS with 4 accumulators where the CPU has it, else bf16 -> fp32 and FMA). Shared by
// dense_gemv.cpp and moe_experts.cpp (the MoE block's router rows, moe_block.h), so both give
// the same bits.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "simd_reduce4.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fitserve::dense {
namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16Dot = true;  // row_dot reads x as bf16 (no fp32 copy of x needed)
#else
constexpr bool kBf16Dot = false;
#endif

// xb: x as bf16; x: the same values in fp32 (only read where !kBf16Dot)
float row_dot(const c10::BFloat16* w, const c10::BFloat16* xb, const float* x, int64_t K) {
  int64_t k = 0;
  float s = 0.f;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)  // kBf16Dot
  // VDPBF16PS: pairs of bf16 products (exact in fp32) added in fp32, 32 weights per
  // instruction and no widening; 4 accumulators, the row's tail through a masked load
  (void)x;
  const auto* p = reinterpret_cast<const uint16_t*>(w);
  const auto* q = reinterpret_cast<const uint16_t*>(xb);
  auto dot = [&](__m512 acc, int64_t i) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(p + i),
                            (__m512bh)_mm512_loadu_si512(q + i));
  };
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 128 <= K; k += 128) {
    a0 = dot(a0, k);
    a1 = dot(a1, k + 32);
    a2 = dot(a2, k + 64);
    a3 = dot(a3, k + 96);
  }
  for (; k + 32 <= K; k += 32) a0 = dot(a0, k);
  if (k < K) {
    const __mmask32 m = static_cast<__mmask32>((1ULL << (K - k)) - 1);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m, p + k),
                          (__m512bh)_mm512_maskz_loadu_epi16(m, q + k));
    k = K;
  }
  s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__) && defined(__FMA__)
  (void)xb;
  const auto* p = reinterpret_cast<const uint16_t*>(w);
  auto load = [&](int64_t i) {  // 8 bf16 -> 8 fp32: the bits moved to the high half
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(load(k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(load(k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(load(k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(load(k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load(k), _mm256_loadu_ps(x + k), a0);
  const __m256 v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; k < K; ++k) s += static_cast<float>(w[k]) * x[k];
  return s;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// row_dot of four weight rows w[r] (x's loads shared, one reduction of four): out[r] has the
// bits row_dot(w[r], ...) gives (the same accumulators, steps and adds per row).
inline void row_dot4(const c10::BFloat16* const* w, const c10::BFloat16* xb, int64_t K,
                     float* out) {
  const auto* q = reinterpret_cast<const uint16_t*>(xb);
  const uint16_t* p[4];
  for (int r = 0; r < 4; ++r) p[r] = reinterpret_cast<const uint16_t*>(w[r]);
  __m512 a[4][4];
  for (auto& row : a)
    for (auto& v : row) v = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128)
    for (int j = 0; j < 4; ++j) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(q + k + 32 * j);
      for (int r = 0; r < 4; ++r)
        a[r][j] = _mm512_dpbf16_ps(a[r][j], (__m512bh)_mm512_loadu_si512(p[r] + k + 32 * j), xv);
    }
  for (; k + 32 <= K; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(q + k);
    for (int r = 0; r < 4; ++r)
      a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_loadu_si512(p[r] + k), xv);
  }
  if (k < K) {
    const __mmask32 m = static_cast<__mmask32>((1ULL << (K - k)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + k);
    for (int r = 0; r < 4; ++r)
      a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)_mm512_maskz_loadu_epi16(m, p[r] + k), xv);
  }
  __m512 s[4];
  for (int r = 0; r < 4; ++r)
    s[r] = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
  float red[4];
  fitserve::reduce_add4(s, red);
  for (int r = 0; r < 4; ++r) out[r] = red[r];
}
#endif

}  // namespace
}  // namespace fitserve::dense
