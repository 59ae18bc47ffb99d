// The quantized cache write's encoder (kvq_write.cpp) on AVX-512: 16 values at a time, bit for
// bit what the scalar Codes::encode gives (and so torch's quantizer):
//   int8    y = x / scale rounded half to even (VRNDSCALEPS, as std::nearbyint under the default
//           rounding mode), clamped to +-127, then the low byte
//   fp8     y clamped to +-qmax (NaN kept), then c10's fp32 -> e4m3fn / e5m2 bit recipe
//           (fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value) on 16 lanes: the normal-range
//           rounding bias and the subnormal float add both computed, the lane's one picked
// A W1 step writes one row per KV head and K/V (a few hundred values per layer); the scalar
// encoder's per-value branches and library calls made that write 3x the bf16 cache's.
#pragma once
#include <cstdint>
#include <limits>
#include <type_traits>

#if (defined(FITSERVE_TIER_AVX512_VNNI) || defined(FITSERVE_TIER_AVX512)) && \
    defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#define KVQ_ENCODE_AVX512 1
#else
#define KVQ_ENCODE_AVX512 0
#endif

namespace {

#if KVQ_ENCODE_AVX512
// the activation dtypes the encoder loads (float64 activations keep the scalar path)
template <typename T>
constexpr bool kEncode512 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
                            std::is_same_v<T, c10::Half>;

inline __mmask16 enc_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// 16 values of x (lanes past the mask read nothing and are 0) -> fp32, exactly.
inline __m512 enc_load(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }
inline __m512 enc_load(const c10::BFloat16* x, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 enc_load(const c10::Half* x, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, x));
}

// c10's fp32 -> fp8 recipe on 16 lanes (y already clamped; NaN lanes kept as NaN).
// MANT = mantissa bits kept (3: e4m3fn, 2: e5m2), BIAS its exponent bias.
template <int MANT, int BIAS>
inline __m512i fp8_bits(__m512 y) {
  constexpr uint32_t shift = 23 - MANT;
  constexpr uint32_t denorm = static_cast<uint32_t>((127 - BIAS) + (23 - MANT) + 1) << 23;
  constexpr uint32_t min_normal = static_cast<uint32_t>(1 - BIAS + 127) << 23;
  // e4m3fn: 480 (first value past its range); e5m2: 65536
  constexpr uint32_t over = MANT == 3 ? (UINT32_C(1087) << 20) : (UINT32_C(143) << 23);
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i f = _mm512_xor_si512(bits, sign);
  // normal range: exponent rebias + round half to even by the bias 0x7FFFF (0xFFFFF) + odd bit
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(f, shift), _mm512_set1_epi32(1));
  const uint32_t bias_add = (static_cast<uint32_t>(BIAS - 127) << 23) + ((1u << (shift - 1)) - 1u);
  __m512i normal = _mm512_add_epi32(_mm512_add_epi32(f, _mm512_set1_epi32(static_cast<int>(bias_add))), odd);
  normal = _mm512_srli_epi32(normal, shift);
  if constexpr (MANT == 3) {  // a carry into e4m3fn's NaN pattern saturates to 448
    const __mmask16 nan_pat = _mm512_cmpeq_epi32_mask(
        _mm512_and_si512(normal, _mm512_set1_epi32(0xFF)), _mm512_set1_epi32(0x7F));
    normal = _mm512_mask_mov_epi32(normal, nan_pat, _mm512_set1_epi32(0x7E));
  }
  // below the smallest normal: one float add places the subnormal's bits (rounded by the FPU)
  const __m512 dm = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(denorm)));
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(f), dm)), _mm512_set1_epi32(static_cast<int>(denorm)));
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(f, _mm512_set1_epi32(static_cast<int>(min_normal)));
  __m512i r = _mm512_mask_mov_epi32(normal, is_sub, sub);
  const __mmask16 is_over = _mm512_cmpge_epu32_mask(f, _mm512_set1_epi32(static_cast<int>(over)));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(f, _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_mov_epi32(r, is_over, _mm512_set1_epi32(MANT == 3 ? 0x7E : 0x7C));
  r = _mm512_mask_mov_epi32(r, is_nan, _mm512_set1_epi32(0x7F));
  return _mm512_or_si512(_mm512_and_si512(r, _mm512_set1_epi32(0xFF)), _mm512_srli_epi32(sign, 24));
}

// y = x / scale on 16 lanes -> the 16 code bytes (codec 0 int8, 1 e4m3fn, 2 e5m2).
inline __m128i encode16(int64_t codec, float qmax, __m512 y) {
  const __m512 hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
  if (codec == 0) {
    const __m512 r = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi)));
  }
  const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
  const __m512 c = _mm512_mask_mov_ps(_mm512_min_ps(_mm512_max_ps(y, lo), hi), nan, y);
  return _mm512_cvtepi32_epi8(codec == 1 ? fp8_bits<3, 7>(c) : fp8_bits<2, 15>(c));
}

// 16 code bytes -> their float values, exactly as c10's casts decode them (int8: the integer;
// e5m2: fp16's top byte; e4m3fn: placed in fp16's fields then times 2^8, its NaN codes NaN).
inline __m512 decode16(int64_t codec, __m128i x) {
  if (codec == 0) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
  if (codec == 2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(x), 8));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(x), 7),
                                     _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(x, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
  return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// Re-encode one head's block codes [bs, d] at grown per-channel scales: lanes with
// scale[i] > old[i] get encode(rounded(decode(code) * old) / scale), the others keep their byte
// (as the scalar loop). NOTE: 16 channels at a time down the block's rows, the lanes' old and
// new scales and the codec held across the rows (the row-outer loop reloaded them per row and
// branched on the codec per 16 bytes).
// NOTE: a lane whose scale grew by less than kNoChange[C] - 1 keeps every code, so it is
// skipped too: decode(c) * old / new moves a code c by less than half its gap below. int8:
// |c| (1 - old/new) <= 127 * 0.45/127 < 0.5; e4m3 / e5m2: the gap below a code is >= 1/16 /
// 1/8 of it (1/32 / 1/16 halved; subnormals and 0 have more room), against 1/37 / 1/19; the two
// fp32 roundings (2^-23 relative) are far inside those margins.
constexpr float kNoChange[3] = {1.f + 0.45f / 127.f, 1.f + 1.f / 36.f, 1.f + 1.f / 18.f};

template <int64_t C>
inline void reencode_block_512(float qmax, uint8_t* codes, int64_t bs, int64_t d, const float* old,
                               const float* scale) {
  const __m512 no_change = _mm512_set1_ps(kNoChange[C]);
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = enc_mask(d - i);
    const __m512 o = _mm512_maskz_loadu_ps(m, old + i), sc = _mm512_maskz_loadu_ps(m, scale + i);
    const __mmask16 grew = _mm512_mask_cmp_ps_mask(m, sc, _mm512_mul_ps(o, no_change), _CMP_GT_OQ);
    if (grew == 0) continue;
    const __m512 div = _mm512_mask_blend_ps(grew, _mm512_set1_ps(1.f), sc);
    for (uint8_t* row = codes + i; row < codes + bs * d; row += d) {
      const __m512 y = _mm512_div_ps(_mm512_mul_ps(decode16(C, _mm_maskz_loadu_epi8(grew, row)), o), div);
      _mm_mask_storeu_epi8(row, grew, encode16(C, qmax, y));
    }
  }
}

inline void reencode_block_512(int64_t codec, float qmax, uint8_t* codes, int64_t bs, int64_t d,
                               const float* old, const float* scale) {
  if (codec == 0) reencode_block_512<0>(qmax, codes, bs, d, old, scale);
  else if (codec == 1) reencode_block_512<1>(qmax, codes, bs, d, old, scale);
  else reencode_block_512<2>(qmax, codes, bs, d, old, scale);
}

// fm[i] = max(fm[i], |x[i]|), i < d (NaN ignored, as std::max(fm, NaN) keeps fm).
template <typename T>
inline void absmax_into_512(const T* x, int64_t d, float* fm) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = enc_mask(d - i);
    const __m512 a = _mm512_and_ps(enc_load(x + i, m), abs_mask);
    _mm512_mask_storeu_ps(fm + i, m, _mm512_max_ps(a, _mm512_maskz_loadu_ps(m, fm + i)));
  }
}

// One head's block scales, i < d: old = prev (null: a fresh block, 0), scale = std::max(old,
// fm / qmax), div = scale > 0 ? scale : 1, prev = scale; true where any scale grew.
inline bool grow_scales_512(float* prev, const float* fm, float qmax, int64_t d, float* old,
                            float* scale, float* div, bool fresh) {
  __mmask16 grew = 0;
  const __m512 q = _mm512_set1_ps(qmax), one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = enc_mask(d - i);
    const __m512 o = fresh ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, prev + i);
    const __m512 sc = _mm512_max_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(m, fm + i), q), o);
    grew |= _mm512_mask_cmp_ps_mask(m, sc, o, _CMP_GT_OQ);
    _mm512_mask_storeu_ps(old + i, m, o);
    _mm512_mask_storeu_ps(scale + i, m, sc);
    _mm512_mask_storeu_ps(prev + i, m, sc);
    const __mmask16 pos = _mm512_cmp_ps_mask(sc, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_mask_storeu_ps(div + i, m, _mm512_mask_blend_ps(pos, one, sc));
  }
  return grew != 0;
}

// max |x[i]| over d values (NaN ignored, as std::max(amax, NaN) keeps amax).
template <typename T>
inline float absmax_512(const T* x, int64_t d) {
  __m512 mx = _mm512_setzero_ps();
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 a = _mm512_and_ps(enc_load(x + i, enc_mask(d - i)), abs_mask);
    mx = _mm512_max_ps(a, mx);  // a NaN lane of a returns mx (the second operand)
  }
  return _mm512_reduce_max_ps(mx);
}

// codes[i] = encode(x[i] / div[i]) (div null: the one divisor div1), i < d.
template <typename T>
inline void encode_row_512(int64_t codec, float qmax, const T* x, const float* div, float div1,
                           int64_t d, uint8_t* codes) {
  const __m512 one = _mm512_set1_ps(div1);
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = enc_mask(d - i);
    const __m512 dv = div != nullptr ? _mm512_mask_loadu_ps(one, m, div + i) : one;
    const __m512 y = _mm512_div_ps(enc_load(x + i, m), dv);
    _mm_mask_storeu_epi8(codes + i, m, encode16(codec, qmax, y));
  }
}
#endif  // KVQ_ENCODE_AVX512

}  // namespace
