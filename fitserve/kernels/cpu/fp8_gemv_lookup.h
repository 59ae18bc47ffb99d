// The AVX512-BF16 + VBMI path of fp8_gemv.cpp: 64 codes -> 64 bf16 by two byte lookups, then
// VDPBF16PS against bf16 x.
//
//   codes c[0..63] (one zmm)    lo = VPERMT2B(LO, c)  hi = VPERMT2B(HI, c) | (c & 0x80)
//                               (128-entry tables of the bf16 bytes of |code|; index = c & 0x7F)
//   wa = unpacklo(lo, hi): per 128-bit lane L, words L*8 + i = bf16(code[L*16 + i])      i < 8
//   wb = unpackhi(lo, hi):                     words L*8 + i = bf16(code[L*16 + 8 + i])
//
// so x is laid out once per call in the same order (permute_x). Every e4m3 and e5m2 value is
// exact in bf16 (4 / 3 significant bits, exponents 2^-9..2^8 / 2^-16..2^15), NaN codes are bf16
// NaN, e5m2 infinities bf16 infinities; products are exact in fp32, sums fp32 (VDPBF16PS, which
// flushes fp32 subnormal products and sums to zero: an error below 2^-126 per term).
// NOTE: VBMI is not a fitserve tier flag (isa.py); these functions carry their own target
// attribute and run only where __builtin_cpu_supports("avx512vbmi") (Zen 4+, Ice Lake+).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

#include "simd_reduce4.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__GNUC__)
#define FP8_GEMV_LOOKUP 1
#include <immintrin.h>

namespace fp8_gemv {

#define FP8_VBMI __attribute__((target("avx512vbmi")))

struct LookupTables {
  __m512i lo0, lo1, hi0, hi1;  // bytes of bf16(value(c)) for c = 0..63 and 64..127
};

// values[c] * factor = the value of code c (c < 128, sign bit clear)
inline LookupTables make_lookup_tables(const float* values, float factor) {
  alignas(64) uint8_t lo[128], hi[128];
  for (int c = 0; c < 128; ++c) {
    const uint16_t b = c10::BFloat16(values[c] * factor).x;  // exact (see above); NaN stays NaN
    lo[c] = static_cast<uint8_t>(b & 0xFF);
    hi[c] = static_cast<uint8_t>(b >> 8);
  }
  return {_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi),
          _mm512_load_si512(hi + 64)};
}

inline bool lookup_supported() {
  static const bool ok = __builtin_cpu_supports("avx512vbmi");
  return ok;
}

// x (bf16 bits) [M, K] -> xp [M, K]: each whole 64-column block in the wa/wb word order above
inline void permute_x(const uint16_t* x, uint16_t* xp, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* s = x + m * K;
    uint16_t* d = xp + m * K;
    for (int64_t b = 0; b + 64 <= K; b += 64)
      for (int l = 0; l < 4; ++l)
        for (int i = 0; i < 8; ++i) {
          d[b + l * 8 + i] = s[b + l * 16 + i];
          d[b + 32 + l * 8 + i] = s[b + l * 16 + 8 + i];
        }
  }
}

// 64 codes at p -> bf16 in the wa / wb order above
FP8_VBMI inline void decode_lookup(const LookupTables& t, __m512i sign, const uint8_t* p,
                                   __m512bh& wa, __m512bh& wb) {
  const __m512i c = _mm512_loadu_si512(p);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, c, t.lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, c, t.hi1), c,
                                               sign, 0xF8);  // hi | (c & 0x80)
  wa = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
  wb = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}

// sums[m] += sum_{k in [k0, k1)} value(w[k]) * x[m][k]; k0, k1 - k0 multiples of 64
template <int MB>
FP8_VBMI void rows_dot_lookup(const uint8_t* w, const uint16_t* xp, int64_t ldx, int64_t k0,
                              int64_t k1, const LookupTables& t, float* sums) {
  constexpr int U = MB >= 2 ? 1 : 2;  // 64-code steps per iteration: >= 4 dot chains
  __m512 acc[MB][2 * U];
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < 2 * U; ++u) acc[m][u] = _mm512_setzero_ps();
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t k = k0;
  for (; k + 64 * U <= k1; k += 64 * U) {
    for (int u = 0; u < U; ++u) {
      __m512bh wa, wb;
      decode_lookup(t, sign, w + k + 64 * u, wa, wb);
      for (int m = 0; m < MB; ++m) {
        const uint16_t* xm = xp + m * ldx + k + 64 * u;
        acc[m][2 * u] = _mm512_dpbf16_ps(acc[m][2 * u], wa, (__m512bh)_mm512_loadu_si512(xm));
        acc[m][2 * u + 1] =
            _mm512_dpbf16_ps(acc[m][2 * u + 1], wb, (__m512bh)_mm512_loadu_si512(xm + 32));
      }
    }
  }
  for (; k < k1; k += 64) {  // one 64-code step left when U = 2
    __m512bh wa, wb;
    decode_lookup(t, sign, w + k, wa, wb);
    for (int m = 0; m < MB; ++m) {
      const uint16_t* xm = xp + m * ldx + k;
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wa, (__m512bh)_mm512_loadu_si512(xm));
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], wb, (__m512bh)_mm512_loadu_si512(xm + 32));
    }
  }
  for (int m = 0; m < MB; ++m) {
    __m512 s = acc[m][0];
    for (int u = 1; u < 2 * U; ++u) s = _mm512_add_ps(s, acc[m][u]);
    sums[m] += _mm512_reduce_add_ps(s);
  }
}

// rows_dot_lookup<1> of four weight rows w[r] over [k0, k1) (x's loads shared): sums[r] = its
// result for row r alone, bit for bit (the same accumulators, steps and final adds per row).
FP8_VBMI inline void rows_dot_lookup4(const uint8_t* const* w, const uint16_t* xp, int64_t k0,
                                      int64_t k1, const LookupTables& t, float* sums) {
  __m512 acc[4][4];
  for (auto& r : acc)
    for (auto& a : r) a = _mm512_setzero_ps();
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t k = k0;
  for (; k + 128 <= k1; k += 128) {
    for (int u = 0; u < 2; ++u) {
      const __m512bh xa = (__m512bh)_mm512_loadu_si512(xp + k + 64 * u);
      const __m512bh xb = (__m512bh)_mm512_loadu_si512(xp + k + 64 * u + 32);
      for (int r = 0; r < 4; ++r) {
        __m512bh wa, wb;
        decode_lookup(t, sign, w[r] + k + 64 * u, wa, wb);
        acc[r][2 * u] = _mm512_dpbf16_ps(acc[r][2 * u], wa, xa);
        acc[r][2 * u + 1] = _mm512_dpbf16_ps(acc[r][2 * u + 1], wb, xb);
      }
    }
  }
  for (; k < k1; k += 64) {
    const __m512bh xa = (__m512bh)_mm512_loadu_si512(xp + k);
    const __m512bh xb = (__m512bh)_mm512_loadu_si512(xp + k + 32);
    for (int r = 0; r < 4; ++r) {
      __m512bh wa, wb;
      decode_lookup(t, sign, w[r] + k, wa, wb);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wa, xa);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], wb, xb);
    }
  }
  __m512 s[4];
  for (int r = 0; r < 4; ++r)
    s[r] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), acc[r][2]),
                         acc[r][3]);
  float red[4];
  fitserve::reduce_add4(s, red);
  for (int r = 0; r < 4; ++r) sums[r] = 0.f + red[r];  // rows_dot_lookup<1>: 0 + the reduction
}

}  // namespace fp8_gemv

#endif
