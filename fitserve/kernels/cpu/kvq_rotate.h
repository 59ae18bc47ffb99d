// The quantized cache write's rotation (kvq_write.cpp) on AVX-512, 16 pairs at a time, bit for
// bit what the scalar rotate_pair gives (and so RotaryEmbedding in the activation dtype T):
//   ct = T(c), st = T(s); out_a = T(T(x_a ct) - T(x_b st)), out_b = T(T(x_b ct) + T(x_a st))
// T = bf16: each rounding is c10's integer round-to-nearest-even on the fp32 bits (bias 0x7FFF
// + the kept lsb, NaN -> 0x7FC0), not VCVTNEPS2BF16 (which flushes subnormal inputs to zero).
// T = fp16: VCVTPS2PH with round-to-nearest-even, which is c10's conversion where F16C is on
// (C10_X86_F16); else its software path's NaN (sign | 0x7E00) is put back. A bf16 / fp16
// product is exact in fp32, and the integer rounding between the products and the sum keeps
// the compiler from fusing them into an FMA. fp32 / fp64 activations keep the scalar loop.
// NOTE: the scalar loop (6 conversions per pair, each with a NaN branch) was ~60% of the
// quantized write's time in a W1 step, 7x the bf16 cache's whole rope_write_kv_.
#pragma once
#include <cstdint>
#include <type_traits>

#include "kvq_encode.h"

namespace {

#if KVQ_ENCODE_AVX512
template <typename T>
constexpr bool kRotate512 = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// 16 fp32 lanes rounded to T, as fp32 values (exact in T).
inline __m512 round_to(c10::BFloat16*, __m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000)));
}

// fp32 lanes -> fp16 bits as c10::Half(float) makes them (see the header).
inline __m256i half_bits(__m512 f) {
  const __m256i h = _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#if defined(C10_X86_F16)
  return h;
#else
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  const __m256i sign = _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0x8000)));
  return _mm256_mask_mov_epi16(h, nan, _mm256_or_si256(sign, _mm256_set1_epi16(0x7E00)));
#endif
}

inline __m512 round_to(c10::Half*, __m512 f) { return _mm512_cvtph_ps(half_bits(f)); }

// 16 values already rounded to T -> T's 16-bit patterns in the low half of 32-bit lanes.
inline __m512i t_bits(c10::BFloat16*, __m512 r) {
  return _mm512_srli_epi32(_mm512_castps_si512(r), 16);
}
inline __m512i t_bits(c10::Half*, __m512 r) { return _mm512_cvtepu16_epi32(half_bits(r)); }

// The low (hi = false) or high 16 bits of each 32-bit lane as T -> fp32.
inline __m512 t_lanes(c10::BFloat16*, __m512i w, bool hi) {
  return _mm512_castsi512_ps(hi ? _mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))
                                : _mm512_slli_epi32(w, 16));
}
inline __m512 t_lanes(c10::Half*, __m512i w, bool hi) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hi ? _mm512_srli_epi32(w, 16) : w));
}

// One rotated pair of 16-lane vectors (x_a, x_b) by the T-rounded tables (ct, st).
template <typename T>
inline void rotate16(__m512& a, __m512& b, __m512 ct, __m512 st) {
  T* tag = nullptr;
  const __m512 p0 = round_to(tag, _mm512_mul_ps(a, ct)), p1 = round_to(tag, _mm512_mul_ps(b, st));
  const __m512 p2 = round_to(tag, _mm512_mul_ps(b, ct)), p3 = round_to(tag, _mm512_mul_ps(a, st));
  a = round_to(tag, _mm512_sub_ps(p0, p1));
  b = round_to(tag, _mm512_add_ps(p2, p3));
}

// tab[0..half) = T(c[i]), tab[half..2 half) = T(s[i]) as fp32 (one token's tables).
template <typename T>
inline void rounded_tables(const float* c, const float* s, int64_t half, float* tab) {
  T* tag = nullptr;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = enc_mask(half - i);
    _mm512_mask_storeu_ps(tab + i, m, round_to(tag, _mm512_maskz_loadu_ps(m, c + i)));
    _mm512_mask_storeu_ps(tab + half + i, m, round_to(tag, _mm512_maskz_loadu_ps(m, s + i)));
  }
}

// One head h[0..2 half) rotated in place by the tables of rounded_tables.
template <typename T>
inline void rotate_head_512(T* h, const float* tab, int64_t half, bool interleaved) {
  T* tag = nullptr;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = enc_mask(half - i);
    const __m512 ct = _mm512_maskz_loadu_ps(m, tab + i), st = _mm512_maskz_loadu_ps(m, tab + half + i);
    if (interleaved) {  // 16 pairs (x_2i, x_2i+1) as 32-bit lanes
      auto* w = reinterpret_cast<uint32_t*>(h) + i;
      const __m512i pairs = _mm512_maskz_loadu_epi32(m, w);
      __m512 a = t_lanes(tag, pairs, false), b = t_lanes(tag, pairs, true);
      rotate16<T>(a, b, ct, st);
      _mm512_mask_storeu_epi32(w, m, _mm512_or_si512(t_bits(tag, a), _mm512_slli_epi32(t_bits(tag, b), 16)));
    } else {
      __m512 a = enc_load(h + i, m), b = enc_load(h + half + i, m);
      rotate16<T>(a, b, ct, st);
      _mm256_mask_storeu_epi16(h + i, m, _mm512_cvtepi32_epi16(t_bits(tag, a)));
      _mm256_mask_storeu_epi16(h + half + i, m, _mm512_cvtepi32_epi16(t_bits(tag, b)));
    }
  }
}
#endif  // KVQ_ENCODE_AVX512

}  // namespace
