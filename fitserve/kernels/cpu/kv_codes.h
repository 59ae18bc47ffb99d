// One-byte KV codes (int8, fp8 e4m3fn, fp8 e5m2) widened to fp32 in registers, for the fused
// quantized paged decode kernel (paged_attention_kvq.cpp). Include after paged_attention_simd.h.
//
// A code's *raw* value r is what these functions produce; the real value before its scale is
// r * kCodeFactor[codec]. The factor (a power of two) is folded into the scales the kernel
// multiplies anyway, so every widening is a few integer ops and one conversion:
//
//   int8      r = the signed integer                             factor 1
//   e5m2      fp16 bits = code << 8 (e5m2 is fp16's top byte)  factor 1
//   e4m3fn    fp16 bits = (code & 0x80) << 8 | (code & 0x7F) << 7, factor 256: the 4 exponent
//             and 3 mantissa bits land in fp16's field with bias 15 instead of 7 (2^-8), and an
//             e4m3 subnormal lands on an fp16 subnormal with the same 2^-8 (exact throughout).
//             NOTE: e4m3fn's NaN code (0x7F / 0xFF) would read as 480; the writer never makes it
//             (values are clamped to 448 before the cast).
#pragma once
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>

namespace {

enum KVCodec : int { kInt8 = 0, kE4M3 = 1, kE5M2 = 2 };

inline float code_factor(int codec) { return codec == kE4M3 ? 256.f : 1.f; }

// The raw value of one code (scalar tier, tails).
template <int C>
inline float raw_code(uint8_t b) {
  if constexpr (C == kInt8) return static_cast<float>(static_cast<int8_t>(b));
  else if constexpr (C == kE5M2)
    return static_cast<float>(c10::Float8_e5m2(b, c10::Float8_e5m2::from_bits()));
  else
    return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits())) *
           (1.f / 256.f);
}

// dst[0..d) = raw values of src[0..d); dst[d..dpad) = 0.
template <int C>
inline void codes_to_float_scalar(const uint8_t* src, float* dst, int64_t d, int64_t dpad) {
  for (int64_t c = 0; c < d; ++c) dst[c] = raw_code<C>(src[c]);
  for (int64_t c = d; c < dpad; ++c) dst[c] = 0.f;
}

#if FS_AVX512
// 16 codes (the low 16 bytes of x) -> 16 raw fp32 values.
template <int C>
inline __m512 codes16_to_f32(__m128i x) {
  if constexpr (C == kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
  } else {
    if constexpr (C == kE5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(x), 8));
    // NOTE: e4m3 sign-extended to 16 bits and shifted by 7: bits 7..13 hold eeeemmm and bit 15
    // the sign (an extension bit); bit 14 (the code's own sign bit) is cleared: 3 ops, not 6
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(x), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xBFFF))));
  }
}

// 32 fp8 codes (the 32 bytes of x) -> 2 x 16 raw fp32 values (lo: codes 0-15): codes16_to_f32's
// fp16 bits made in one zmm for all 32 (e4m3: 3 ops per 32 codes, not per 16), then two
// conversions. int8 has no such step (widen_row keeps codes16_to_f32 for it).
template <int C>
inline void codes32_to_f32(__m256i x, __m512& lo, __m512& hi) {
  static_assert(C != kInt8, "int8 codes widen 16 at a time");
  const __m512i h =
      C == kE5M2 ? _mm512_slli_epi16(_mm512_cvtepu8_epi16(x), 8)
                 : _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(x), 7),
                                    _mm512_set1_epi16(static_cast<short>(0xBFFF)));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

template <int C>
inline void codes_to_float_avx512(const uint8_t* src, float* dst, int64_t d, int64_t dpad) {
  int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes)
    _mm512_storeu_ps(dst + c, codes16_to_f32<C>(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(src + c))));
  if (c < d)  // the masked load never reads past the row; lanes past d become 0
    _mm512_storeu_ps(dst + c, codes16_to_f32<C>(_mm_maskz_loadu_epi8(tail_mask(d - c), src + c)));
  (void)dpad;  // dpad = d rounded up to 16: the last store filled it
}
#endif

#if FS_AVX2
// 8 codes (the low 8 bytes of x) -> 8 raw fp32 values.
template <int C>
inline __m256 codes8_to_f32(__m128i x) {
  if constexpr (C == kInt8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
  } else {
    if constexpr (C == kE5M2) return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(x), 8));
    const __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(x), 7);  // as the AVX-512 path
    return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0xBFFF))));
  }
}

template <int C>
inline void codes_to_float_avx2(const uint8_t* src, float* dst, int64_t d, int64_t dpad) {
  int64_t c = 0;
  for (; c + kLanes8 <= d; c += kLanes8)
    _mm256_storeu_ps(dst + c, codes8_to_f32<C>(_mm_loadl_epi64(
                                  reinterpret_cast<const __m128i*>(src + c))));
  for (; c < d; ++c) dst[c] = raw_code<C>(src[c]);
  for (; c < dpad; ++c) dst[c] = 0.f;
}
#endif

}  // namespace
