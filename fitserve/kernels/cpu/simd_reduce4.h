// _mm512_reduce_add_ps of four vectors at once, with each sum's bits: the same adds as GCC's
// tree for one vector (the 256-bit halves, the 128-bit halves, elements i and i + 2, then 0 and
// 1; a + b == b + a exactly), a quarter of its shuffles. For the batch-1 GEMVs that finish four
// weight rows together (dense_row_dot.h's row_dot4, fp8_gemv_lookup.h's rows_dot_lookup4).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace fitserve {

inline void reduce_add4(const __m512* s, float* out) {
  // [s0.lo256 | s1.lo256] + [s0.hi256 | s1.hi256], likewise s2, s3: the 8-wide sums
  const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x44),
                                 _mm512_shuffle_f32x4(s[0], s[1], 0xEE));
  const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x44),
                                 _mm512_shuffle_f32x4(s[2], s[3], 0xEE));
  // the 4-wide sums: 128-bit lane r = row r's lo128 + hi128
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88),
                                 _mm512_shuffle_f32x4(a, b, 0xDD));
  const __m512 d = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4E));  // [i] + [i + 2]
  const __m512 e = _mm512_add_ps(d, _mm512_permute_ps(d, 0xB1));  // [0] + [1]
  alignas(64) float v[16];
  _mm512_store_ps(v, e);
  for (int r = 0; r < 4; ++r) out[r] = v[4 * r];
}

}  // namespace fitserve

#endif
