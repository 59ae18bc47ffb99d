// Shared pieces of the GGUF block kernels (ggml_blocks.cpp): the tier switch, fp16 reads, and
// the activations, quantized once per call.
//
// Activations (llama.cpp's choice, for the same reason): each row of x is cut into blocks of
// kActBlock columns (256 for the K-quants: llama.cpp's Q8_K; 32 for Q5_0 / Q5_1: its Q8_0);
// block b gets d_b = absmax / 127 (fp32) and q = round(x / d_b) in [-127, 127], plus the
// integer sums of q over each 16 and each 32 columns. NOTE: one activation scale per K-quant
// super-block makes the whole 256-column super-block one integer dot (the 6-bit / int8 sub-block
// scales folded in with madd), so each super-block costs ONE fp32 FMA; the mins and the Q6_K
// offset come from the 16 / 32-column sums, never from the weights.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(FITSERVE_TIER_AVX2) || defined(FITSERVE_TIER_AVX512) || \
    defined(FITSERVE_TIER_AVX512_VNNI)
#define FS_GGML_AVX2 1
#include <immintrin.h>
#endif
#if defined(FITSERVE_TIER_AVX512_VNNI)
#define FS_GGML_VNNI 1
#endif
#if defined(FITSERVE_TIER_AVX512) || defined(FITSERVE_TIER_AVX512_VNNI)
#define FS_GGML_AVX512 1
#endif

#define FS_GGML_UNROLL _Pragma("GCC unroll 16")

namespace fitserve::ggml {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Every 64 B line of [p, p + n) requested (a hint: never faults, past the tensor included).
[[gnu::always_inline]] inline void prefetch_span(const uint8_t* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// An IEEE fp16 stored at p (ggml's d / dmin / m), as fp32 (exact).
inline float f16_at(const uint8_t* p) {
#ifdef FS_GGML_AVX2
  return _cvtsh_ss(load_u16(p));
#else
  return c10::detail::fp16_ieee_to_fp32_value(load_u16(p));
#endif
}

// One call's quantized activations, all M rows (row m at m * K, m * nd, ...).
struct Act {
  const int8_t* q;     // [M][K]
  const float* d;      // [M][nd]    scale per activation block
  const int16_t* s16;  // [M][K/16]  sum of q per 16 columns
  const int16_t* s32;  // [M][K/32]  sum of q per 32 columns
  const float* ds;     // [M][K/32]  d * (sum of q) per 32 columns (d of their block)
  int64_t K, nd;
  // q's 512-column chunks in the lanes-transposed order (quantize_row's `lanes_t`)
  bool lanes_t = false;
  const int8_t* qrow(int64_t m) const { return q + m * K; }
  const float* drow(int64_t m) const { return d + m * nd; }
  const int16_t* s16row(int64_t m) const { return s16 + m * (K / 16); }
  const int16_t* s32row(int64_t m) const { return s32 + m * (K / 32); }
  const float* dsrow(int64_t m) const { return ds + m * (K / 32); }
};

// Quantize one row of x (K columns, K a multiple of block) into q / d / s16 / s32 / ds; with
// perm128 (K a multiple of 128), q is stored in the order [0-31, 64-95, 32-63, 96-127] per 128
// columns (the AVX-512 Q4_K / Q5_K rows read it so), the sums stay in column order.
// With lanes_t, each whole 512 columns (16 blocks of 32) of q are stored as 8 x 64 bytes, piece
// c holding dword c of each block in block order (byte 64c + 4b + i = column 32b + 4c + i;
// the VNNI lanes' M > 1 tiles, ggml_blocks_lanes.h); the last K % 512 columns stay in order.
#ifdef FS_GGML_AVX512
// 16 values of x as fp32 (bf16: its bits << 16, exact).
template <class T>
[[gnu::always_inline]] inline __m512 load16_f32(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// One activation block (n columns, a multiple of 16) as quantize_row's scalar loop below, 16 at
// a time with the same values: amax ignores NaN as std::max does (max_ps returns its second
// operand for a NaN), the NaN / inf probe is a sum of v * 0, q = the round-to-even of the clamped
// t (cvtps under the default rounding mode: nearbyint), NaN t -> 0; s16 the sums of 16 q.
// NOTE: the scalar loop cost 1.8 ns per column (3.7 us per row of 2048): 15% of a 32-row
// batched decode's IQ4_NL GEMM on the AMX tiles.
template <class T>
inline void quantize_block16(const T* x, int64_t n, int8_t* q, float* d, int16_t* s16) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 vmax = _mm512_setzero_ps(), vprobe = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16_f32(x + i);
    vmax = _mm512_max_ps(_mm512_andnot_ps(sign, v), vmax);
    vprobe = _mm512_add_ps(vprobe, _mm512_mul_ps(v, _mm512_setzero_ps()));
  }
  const float amax = _mm512_reduce_max_ps(vmax), probe = _mm512_reduce_add_ps(vprobe);
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 t = _mm512_mul_ps(load16_f32(x + i), vid);
    const __mmask16 ok = _mm512_cmp_ps_mask(t, t, _CMP_ORD_Q);
    const __m512i r = _mm512_maskz_cvtps_epi32(ok, _mm512_min_ps(_mm512_max_ps(t, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(r));
    s16[i / 16] = static_cast<int16_t>(_mm512_reduce_add_epi32(r));
  }
  *d = amax / 127.f + probe;
}
#endif

template <class T>
void quantize_row(const T* x, int64_t K, int64_t block, bool perm128, int8_t* q, float* d,
                  int16_t* s16, int16_t* s32, float* ds, bool lanes_t = false) {
#ifdef FS_GGML_AVX512
  if (block % 16 == 0) {
    for (int64_t b0 = 0; b0 < K; b0 += block)
      quantize_block16(x + b0, block, q + b0, d + b0 / block, s16 + b0 / 16);
  } else
#endif
  {
    for (int64_t b0 = 0; b0 < K; b0 += block) {
      float amax = 0.f, probe = 0.f;
      for (int64_t i = b0; i < b0 + block; ++i) {
        const float v = static_cast<float>(x[i]);
        amax = std::max(amax, std::fabs(v));
        probe += v * 0.f;  // NOTE: NaN / inf in x make the block scale NaN: y is NaN, not finite
      }
      const float id = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t i = b0; i < b0 + block; ++i) {
        const float t = static_cast<float>(x[i]) * id;
        const float r = t == t ? std::nearbyint(std::clamp(t, -127.f, 127.f)) : 0.f;
        q[i] = static_cast<int8_t>(r);  // round half to even (the default rounding mode)
      }
      d[b0 / block] = amax / 127.f + probe;
    }
    for (int64_t j = 0; j < K / 16; ++j) {
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += q[16 * j + i];
      s16[j] = static_cast<int16_t>(s);
    }
  }
  for (int64_t j = 0; j < K / 32; ++j)
    s32[j] = static_cast<int16_t>(s16[2 * j] + s16[2 * j + 1]);
  if (perm128)  // the 32-column pieces 1 and 2 of each 128 swapped (after the sums above)
    for (int64_t c = 0; c < K; c += 128) {
      int8_t t[32];
      std::memcpy(t, q + c + 32, 32);
      std::memcpy(q + c + 32, q + c + 64, 32);
      std::memcpy(q + c + 64, t, 32);
    }
  for (int64_t j = 0; j < K / 32; ++j) ds[j] = d[j * 32 / block] * static_cast<float>(s32[j]);
  if (lanes_t)
    for (int64_t c0 = 0; c0 + 512 <= K; c0 += 512) {
      int8_t t[512];
      for (int b = 0; b < 16; ++b)
        for (int c = 0; c < 8; ++c) std::memcpy(t + 64 * c + 4 * b, q + c0 + 32 * b + 4 * c, 4);
      std::memcpy(q + c0, t, 512);
    }
}

// The 8 six-bit scales and 8 six-bit mins of a K-quant super-block (ggml's get_scale_min_k4,
// four at a time in 32-bit words): j < 4: sc = b[j] & 63, m = b[j+4] & 63; j >= 4: the low /
// high nibble of b[j+4] plus the top two bits of b[j-4] / b[j]. Bytes little-endian.
inline void scale_min_k4(const uint8_t* b, uint64_t& sc, uint64_t& mn) {
  const uint32_t u0 = load_u32(b), u1 = load_u32(b + 4), u2 = load_u32(b + 8);
  const uint32_t sc_lo = u0 & 0x3f3f3f3fu, mn_lo = u1 & 0x3f3f3f3fu;
  const uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
  const uint32_t mn_hi = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
  sc = sc_lo | (uint64_t{sc_hi} << 32);
  mn = mn_lo | (uint64_t{mn_hi} << 32);
}

#ifdef FS_GGML_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc + madd(pairs, s16): int16 pairs times int16 scales, summed in pairs into int32 lanes
// (one vpdpwssd on AVX512-VNNI).
inline __m256i madd_acc(__m256i acc, __m256i pairs, __m256i s16) {
#ifdef FS_GGML_VNNI
  return _mm256_dpwssd_epi32(acc, pairs, s16);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, s16));
#endif
}

// Sum of u8 * s8 products, 4 per int32 lane (u <= 63 here, so maddubs never saturates).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef FS_GGML_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Broadcast of int16 word w of each 128-bit lane (a vpshufb control).
constexpr short word_sel(int w) { return static_cast<short>(((2 * w + 1) << 8) | (2 * w)); }

// Bit p of every byte moved to bit 4 (0x10), other bits cleared (p a compile-time constant).
template <int P>
inline __m256i bit_to_0x10(__m256i v) {
  __m256i t = v;
  if constexpr (P < 4) t = _mm256_slli_epi16(v, 4 - P);
  if constexpr (P > 4) t = _mm256_srli_epi16(v, P - 4);
  return _mm256_and_si256(t, _mm256_set1_epi8(0x10));
}

// The 32 bits of `bits` as 32 bytes: byte j = 0x10 where bit j is set, else 0 (Q5's 5th bit).
inline __m256i bits_to_0x10(uint32_t bits) {
  const __m256i sel = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                        0x0101010101010101LL, 0);
  const __m256i bm = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), sel);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, bm), bm),
                          _mm256_set1_epi8(0x10));
}
#endif

}  // namespace fitserve::ggml
