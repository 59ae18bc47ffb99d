// fp8 codes -> fp32 in registers, and the fp32 FMA row dots over them (fp8_gemv.cpp's
// conversion note); every tier: AVX-512 (16 codes per step), AVX2 + F16C (8), scalar (table).
#pragma once
#include <c10/util/Half.h>

#include <array>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fp8_gemv {

constexpr int kMaxRows = 8;  // rows of x that share one converted weight vector

// code value / the float16 a code's bits read as: 2^8 for e4m3 (bias 15 - 7), 1 for e5m2
constexpr float kFactor[2] = {256.f, 1.f};

// code -> float16 bit pattern (NaN for e4m3's NaN codes); value = float16 * kFactor[fmt]
inline uint16_t code_to_f16_bits(uint8_t c, bool e5m2) {
  if (e5m2) return static_cast<uint16_t>(c << 8);
  if ((c & 0x7F) == 0x7F) return 0x7E00;
  return static_cast<uint16_t>(((c & 0x80) << 8) | ((c & 0x7F) << 7));
}

struct Table {
  std::array<float, 256> v{};
  explicit Table(bool e5m2) {
    for (int c = 0; c < 256; ++c) {
      c10::Half h;
      h.x = code_to_f16_bits(static_cast<uint8_t>(c), e5m2);
      v[c] = static_cast<float>(h);
    }
  }
};

inline const float* table(bool e5m2) {
  static const Table e4(false), e5(true);
  return e5m2 ? e5.v.data() : e4.v.data();
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
template <bool E5M2>
inline Vec decode(const uint8_t* p) {  // 16 codes -> 16 fp32 (in float16 units)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i h;
  if constexpr (E5M2) {
    h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
  } else {
    // sign-extended byte << 7: magnitude to bits 7..13, sign to 14 and 15; bit 14 cleared
    h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                         _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)),
                                           _mm256_set1_epi16(0x3F80));
    h = _mm256_or_si256(h, nan);  // 0xFFFF: a float16 NaN
  }
  return _mm512_cvtph_ps(h);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
template <bool E5M2>
inline Vec decode(const uint8_t* p) {  // 8 codes -> 8 fp32 (in float16 units)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m128i h;
  if constexpr (E5M2) {
    h = _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);
  } else {
    h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7),
                      _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7FFF)),
                                        _mm_set1_epi16(0x3F80));
    h = _mm_or_si128(h, nan);
  }
  return _mm256_cvtph_ps(h);
}
#else
constexpr int kLanes = 0;  // scalar tier: the table loop only
#endif

// sums[m] = sum_{k in [k0, k1)} value(w[k]) * x[m * ldx + k]   for m < MB (fp32 FMAs)
template <int MB, bool E5M2>
void rows_dot(const uint8_t* w, const float* x, int64_t ldx, int64_t k0, int64_t k1,
              float* sums) {
  int64_t k = k0;
  for (int m = 0; m < MB; ++m) sums[m] = 0.f;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  // U independent accumulators per row: at least 4 FMA chains in flight whatever MB
  constexpr int U = MB >= 4 ? 1 : 4 / MB;
  Vec acc[MB][U];
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = vzero();
  for (; k + U * kLanes <= k1; k += U * kLanes) {
    for (int u = 0; u < U; ++u) {
      const Vec wv = decode<E5M2>(w + k + u * kLanes);
      for (int m = 0; m < MB; ++m)
        acc[m][u] = vfma(wv, vload(x + m * ldx + k + u * kLanes), acc[m][u]);
    }
  }
  for (; k + kLanes <= k1; k += kLanes) {
    const Vec wv = decode<E5M2>(w + k);
    for (int m = 0; m < MB; ++m) acc[m][0] = vfma(wv, vload(x + m * ldx + k), acc[m][0]);
  }
  for (int m = 0; m < MB; ++m) {
    Vec s = acc[m][0];
    for (int u = 1; u < U; ++u) s = vadd(s, acc[m][u]);
    sums[m] = vsum(s);
  }
#endif
  const float* t = table(E5M2);
  for (; k < k1; ++k) {
    const float wk = t[w[k]];
    for (int m = 0; m < MB; ++m) sums[m] += wk * x[m * ldx + k];
  }
  for (int m = 0; m < MB; ++m) sums[m] *= kFactor[E5M2];  // exact: a power of two
}

}  // namespace fp8_gemv
