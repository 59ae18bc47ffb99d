// Shared AVX-512 math for the fused C++ ops (included by fused_ops.cpp and paged_attention.cpp).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

// exp(x): Cephes' degree-6 polynomial on [-ln2/2, ln2/2] after x = n ln2 + r, scaled by 2^n
// (~1 ulp). x is clamped to [-87.3, 100]: exp -> 0 below (a very negative SiLU gate gives
// -0 as torch does; softmax scores minus their running max underflow to 0), inf above 88.7.
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
