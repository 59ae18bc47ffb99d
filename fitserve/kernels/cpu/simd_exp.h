// Shared vector exp for the fused C++ ops (included by fused_ops.cpp and paged_attention.cpp):
// exp512 for AVX-512 builds, exp256 for AVX2 + FMA builds, the same polynomial and clamps, so
// both tiers give bit-identical results lane by lane.
#pragma once
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// exp(x): Cephes' degree-6 polynomial on [-ln2/2, ln2/2] after x = n ln2 + r, scaled by 2^n
// (~1 ulp). x is clamped to [-87.3, 100]: exp -> 0 below (a very negative SiLU gate gives
// -0 as torch does; softmax scores minus their running max underflow to 0), inf above 88.7.
#if defined(__AVX512F__)
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(100.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
  return _mm512_scalef_ps(_mm512_add_ps(y, _mm512_set1_ps(1.0f)), n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 2^n for integral n in [-126, 145] as two exact power-of-two factors (AVX2 has no scalef):
// n = h + (n - h) with h = n / 2 keeps both exponents in the normal range, and the product
// overflows to inf exactly where scalef would (n >= 128).
inline __m256 exp2_int256(__m256 v, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i h = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(v, p1), p2);
}

inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(100.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
  return exp2_int256(_mm256_add_ps(y, _mm256_set1_ps(1.0f)), n);
}
#endif
