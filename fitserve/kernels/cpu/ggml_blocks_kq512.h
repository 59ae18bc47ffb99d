// The AVX-512 (512-bit) rows of Q4_K / Q5_K / Q6_K (the avx512 and avx512_vnni tiers): the
// same integer scheme as the AVX2 code in ggml_blocks_kquant.h, 128 columns per vector op.
//
//   Q4_K / Q5_K: a 64-byte load of qs covers columns 128c .. 128c+127: its low nibbles are
//     sub-blocks 4c and 4c+2, its high nibbles 4c+1 and 4c+3. The activations of these types
//     are stored permuted per 128 columns ([0-31, 64-95, 32-63, 96-127]: Act built with
//     kPerm128), so one 64-byte load of x matches each nibble vector.
//   Q6_K: a 64-byte load of ql covers half h (128 columns): low nibbles = columns 0-63, high =
//     64-127 (natural order); qh's 32 bytes are broadcast to both 256-bit halves and shifted
//     per half (64-bit variable shifts: the 0x30 mask keeps each byte's own bits).
// Sub-block scales enter as int16 (madd / vpdpwssd); each super-block ends in the canonical fp32
// order (q45k_tile512's NOTE) shared with the M > 1 panels (ggml_blocks_kqpanel.h).
#pragma once

#include "ggml_blocks_act.h"

#ifdef FS_GGML_AVX512

namespace fitserve::ggml {

inline __m512i madd_acc512(__m512i acc, __m512i pairs, __m512i s16) {
#ifdef FS_GGML_VNNI
  return _mm512_dpwssd_epi32(acc, pairs, s16);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, s16));
#endif
}

inline float hsum512(__m512 v) {
  const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  return hsum(s);
}

// The lane sums of a, b, c, d (lanes 0-3 of the result), each in hsum512's order (lane i +
// lane i+8, then + 4, + 2, + 1: fp32 add is commutative, so the bits are hsum512's): 14 ops for
// four rows instead of 4 x 9, and one short dependency chain instead of four.
[[gnu::always_inline]] inline __m128 hsum512x4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // x = [a's s0-3 | a's s4-7 | b's s0-3 | b's s4-7] (s_i = lane i + lane i+8), y likewise
  const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));  // t0 + t2, t1 + t3 per row
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));  // (t0 + t2) + (t1 + t3)
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_castsi128_si512(_mm_setr_epi32(0, 4, 8, 12)), v));
}

// res[r] = hsum512(acc[r]) for r < N (the same bits), four at a time.
template <int N>
[[gnu::always_inline]] inline void hsum512_rows(const __m512* acc, float* res) {
  int r = 0;
  FS_GGML_UNROLL for (; r + 4 <= N; r += 4)
    _mm_storeu_ps(res + r, hsum512x4(acc[r], acc[r + 1], acc[r + 2], acc[r + 3]));
  if constexpr (N % 4 >= 2) {
    const __m512 z = _mm512_setzero_ps();
    const __m128 s = hsum512x4(acc[r], acc[r + 1], N % 4 == 3 ? acc[r + 2] : z, z);
    _mm_storel_pi(reinterpret_cast<__m64*>(res + r), s);
    if constexpr (N % 4 == 3) res[r + 2] = _mm_cvtss_f32(_mm_movehl_ps(s, s));
  } else if constexpr (N % 4 == 1) {
    res[r] = hsum512(acc[r]);
  }
}

// The int32 lane sums of a, b, c, d (lanes 0-3), exact (integer adds: any order).
[[gnu::always_inline]] inline __m128i isum512x4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i x = _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xEE));
  const __m512i y = _mm512_add_epi32(_mm512_shuffle_i32x4(c, d, 0x44), _mm512_shuffle_i32x4(c, d, 0xEE));
  const __m512i t = _mm512_add_epi32(_mm512_shuffle_i32x4(x, y, 0x88), _mm512_shuffle_i32x4(x, y, 0xDD));
  const __m512i u = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
  const __m512i v = _mm512_add_epi32(u, _mm512_shuffle_epi32(u, _MM_PERM_CDAB));
  return _mm512_castsi512_si128(
      _mm512_permutexvar_epi32(_mm512_castsi128_si512(_mm_setr_epi32(0, 4, 8, 12)), v));
}

// The int32 lane sums of four xmm (lanes 0-3), exact.
[[gnu::always_inline]] inline __m128i isum128x4(__m128i a, __m128i b, __m128i c, __m128i d) {
  const __m128i x = _mm_add_epi32(_mm_unpacklo_epi32(a, b), _mm_unpackhi_epi32(a, b));
  const __m128i y = _mm_add_epi32(_mm_unpacklo_epi32(c, d), _mm_unpackhi_epi32(c, d));
  return _mm_add_epi32(_mm_unpacklo_epi64(x, y), _mm_unpackhi_epi64(x, y));
}

// Lanes 4g .. 4g+3 of R scalars (zero past R), as an xmm built in registers (NOTE: not stored
// and reloaded as a vector: four scalar stores then a 16-byte load miss store forwarding, which
// cost the GEMV ~20% in a trial).
template <int R>
[[gnu::always_inline]] inline __m128 lanes4(const float* v, int g) {
  auto at = [&](int r) { return r < R ? v[r] : 0.f; };
  return _mm_setr_ps(at(4 * g), at(4 * g + 1), at(4 * g + 2), at(4 * g + 3));
}

// Lanes 4g .. 4g+3 of the R exact per-pair integer sums v[r] (zero past R), as an xmm.
template <int R>
[[gnu::always_inline]] inline __m128i isum_group(const __m512i* v, int g) {
  const __m512i z = _mm512_setzero_si512();
  auto at = [&](int r) { return r < R ? v[r] : z; };
  return isum512x4(at(4 * g), at(4 * g + 1), at(4 * g + 2), at(4 * g + 3));
}

// vpshufb control: word p in the low 256 bits, word q in the high 256 bits
inline __m512i word_sel2(int p, int q) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(word_sel(p))),
                            _mm256_set1_epi16(word_sel(q)), 1);
}

// 64-bit lanes rotated left by `lo` in the low 256 bits and `hi` in the high (Q5_K's bit plane:
// bit p of each byte to bit 4 is a rotation by 4 - p, mod 64)
inline __m512i rol_halves(__m512i v, int lo, int hi) {
  const __m512i cnt = _mm512_inserti64x4(_mm512_set1_epi64(lo & 63), _mm256_set1_epi64x(hi & 63), 1);
  return _mm512_rolv_epi64(v, cnt);
}

// NOTE: kSplit (tiles of 1-2 rows, the GEMV): the low / high nibble products go to separate
// integer accumulators, so each super-block's chain of dependent vpdpwssd is half as long (at
// M = 1 the latency of that chain, not the op count, set the speed); larger tiles interleave
// their rows instead and need the registers.
//
// The canonical order (batch invariance, shared with the panels of ggml_blocks_kqpanel.h): per
// (weight row, x row, super-block) the EXACT integers isum = sum_s sc[s] * dot_s and (Q4_K /
// Q5_K) msum = sum_s m[s] * s32[s] (any order: integer adds), then dd = d * da, dm = dmin * da,
// t = cvt(isum) * dd - cvt(msum) * dm (fmsub over a rounded product), acc += t (Q6_K: acc =
// fma(cvt(isum), dd, acc)), one fp32 accumulator per output, no horizontal fp32 sum. So every
// tile height, weight-row count, and the lane = output row panels give row m the same bits.
template <bool kHigh, int NW, int MT>
[[gnu::always_inline]] inline void q45k_tile512(const uint8_t* const* w, int64_t nsb, const Act& a,
                                                int64_t m0, float* res, int64_t ahead = kKqAhead) {
  constexpr int64_t kBytes = kHigh ? 176 : 144, kQsOff = kHigh ? 48 : 16;
  constexpr bool kSplit = NW * MT <= 2;
  constexpr int R = NW * MT, G = (R + 3) / 4;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
  __m128 acc[G];
  const int8_t* aq[MT];
  FS_GGML_UNROLL for (int g = 0; g < G; ++g) acc[g] = _mm_setzero_ps();
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i) aq[i] = a.qrow(m0 + i);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m512i isv[R];
    __m128i msv[R], isg[G], msg[G];
    float dd[R], dm[R];
    FS_GGML_UNROLL for (int j = 0; j < NW; ++j) {
      const uint8_t* b = w[j] + sb * kBytes;
      if constexpr (MT == 1) kq_prefetch_ahead<kBytes>(b, ahead);  // the GEMV's stream
      uint64_t scv, mnv;
      scale_min_k4(b + 4, scv, mnv);
      const __m512i sc16 = _mm512_broadcast_i32x4(
          _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(scv))));
      __m512i hb;
      if constexpr (kHigh) hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                               reinterpret_cast<const __m256i*>(b + 16)));
      __m512i ia[MT], ib[MT];
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) ia[i] = ib[i] = _mm512_setzero_si512();
      FS_GGML_UNROLL for (int c = 0; c < 2; ++c) {
        const __m512i v = _mm512_loadu_si512(b + kQsOff + 64 * c);
        __m512i lo = _mm512_and_si512(v, m4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if constexpr (kHigh) {  // sub-block s takes bit s of qh
          lo = _mm512_or_si512(lo, _mm512_and_si512(rol_halves(hb, 4 - 4 * c, 2 - 4 * c), m10));
          hi = _mm512_or_si512(hi, _mm512_and_si512(rol_halves(hb, 3 - 4 * c, 1 - 4 * c), m10));
        }
        const __m512i slo = _mm512_shuffle_epi8(sc16, word_sel2(4 * c, 4 * c + 2));
        const __m512i shi = _mm512_shuffle_epi8(sc16, word_sel2(4 * c + 1, 4 * c + 3));
        FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
          const int8_t* p = aq[i] + sb * 256 + 128 * c;  // permuted: [lo columns | hi columns]
          ia[i] = madd_acc512(ia[i], _mm512_maddubs_epi16(lo, _mm512_loadu_si512(p)), slo);
          __m512i& dst = kSplit ? ib[i] : ia[i];
          dst = madd_acc512(dst, _mm512_maddubs_epi16(hi, _mm512_loadu_si512(p + 64)), shi);
        }
      }
      // mins: m[s] (int16) against x's 32-column sums, 4 int32 partials per pair
      const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mnv)));
      const float d = f16_at(b), dmin = f16_at(b + 2);
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
        const int r = j * MT + i;
        isv[r] = kSplit ? _mm512_add_epi32(ia[i], ib[i]) : ia[i];
        msv[r] = _mm_madd_epi16(mn16, _mm_loadu_si128(
                                          reinterpret_cast<const __m128i*>(a.s32row(m0 + i) + sb * 8)));
        const float da = a.drow(m0 + i)[sb];
        dd[r] = d * da;
        dm[r] = dmin * da;
        if (r % 4 == 3 || r == R - 1) {  // a group of 4 lanes complete: reduced now (registers)
          const __m128i z = _mm_setzero_si128();
          auto m = [&](int q) { return q < R ? msv[q] : z; };
          const int g = r / 4;
          isg[g] = isum_group<R>(isv, g);
          msg[g] = isum128x4(m(4 * g), m(4 * g + 1), m(4 * g + 2), m(4 * g + 3));
        }
      }
    }
    FS_GGML_UNROLL for (int g = 0; g < G; ++g) {
      const __m128 u = _mm_mul_ps(_mm_cvtepi32_ps(msg[g]), lanes4<R>(dm, g));
      const __m128 t = _mm_fmsub_ps(_mm_cvtepi32_ps(isg[g]), lanes4<R>(dd, g), u);
      acc[g] = _mm_add_ps(acc[g], t);
    }
  }
  alignas(16) float out[4 * G];
  FS_GGML_UNROLL for (int g = 0; g < G; ++g) _mm_store_ps(out + 4 * g, acc[g]);
  FS_GGML_UNROLL for (int r = 0; r < R; ++r) res[r] = out[r];
}

template <bool kHigh, int MT>
[[gnu::always_inline]] inline void q45k_row512(const uint8_t* w, int64_t nsb, const Act& a,
                                               int64_t m0, float* res) {
  q45k_tile512<kHigh, 1, MT>(&w, nsb, a, m0, res);
}

template <int NW, int MT>
[[gnu::always_inline]] inline void q6k_tile512(const uint8_t* const* w, int64_t nsb, const Act& a,
                                               int64_t m0, float* res, int64_t ahead = kKqAhead) {
  constexpr bool kSplit = NW * MT <= 2;  // as in q45k_tile512
  constexpr int R = NW * MT, G = (R + 3) / 4;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m3f = _mm512_set1_epi8(0x3F);
  // per half: the low nibbles' qh bits sit at 0-1 (columns 0-31) and 2-3 (32-63), the high
  // nibbles' at 4-5 and 6-7: shifted to 4-5
  const __m512i sh_lo = _mm512_inserti64x4(_mm512_set1_epi64(4), _mm256_set1_epi64x(2), 1);
  const __m512i sh_hi = _mm512_inserti64x4(_mm512_set1_epi64(0), _mm256_set1_epi64x(2), 1);
  __m128 acc[G];
  const int8_t* aq[MT];
  FS_GGML_UNROLL for (int g = 0; g < G; ++g) acc[g] = _mm_setzero_ps();
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i) aq[i] = a.qrow(m0 + i);
  for (int64_t sb = 0; sb < nsb; ++sb) {
   __m512i isv[R];
   __m128i isg[G];
   float dd[R];
   FS_GGML_UNROLL for (int j = 0; j < NW; ++j) {
    const uint8_t* b = w[j] + sb * 210;
    if constexpr (MT == 1) kq_prefetch_ahead<210>(b, ahead);
    const __m256i sc16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    const __m512i sc512 = _mm512_castsi256_si512(sc16);
    // the -32 offset: -32 sc[s] (fits int16) against x's 16-column sums, one madd per row
    const __m256i scn = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc16, 5));
    __m512i ia[MT], ib[MT];
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
      ib[i] = _mm512_setzero_si512();
      ia[i] = _mm512_zextsi256_si512(_mm256_madd_epi16(scn, _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.s16row(m0 + i) + sb * 16))));
    }
    FS_GGML_UNROLL for (int h = 0; h < 2; ++h) {
      const __m512i l = _mm512_loadu_si512(b + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
      // bits 0-3 from the nibble, 4-7 from the shifted qh (0xE4: C ? A : B), 6-7 then cleared
      const __m512i ulo = _mm512_and_si512(
          _mm512_ternarylogic_epi32(l, _mm512_sllv_epi64(qh, sh_lo), m4, 0xE4), m3f);
      const __m512i uhi = _mm512_and_si512(
          _mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 4), _mm512_srlv_epi64(qh, sh_hi), m4, 0xE4),
          m3f);
      // 16 columns per 128-bit lane: scales 8h + 0..3 (low nibbles), 8h + 4..7 (high)
      const __m512i ilo = _mm512_set_epi64(
          0x0003000300030003LL + 0x0008000800080008LL * h, 0x0003000300030003LL + 0x0008000800080008LL * h,
          0x0002000200020002LL + 0x0008000800080008LL * h, 0x0002000200020002LL + 0x0008000800080008LL * h,
          0x0001000100010001LL + 0x0008000800080008LL * h, 0x0001000100010001LL + 0x0008000800080008LL * h,
          0x0008000800080008LL * h, 0x0008000800080008LL * h);
      const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(4));
      const __m512i slo = _mm512_permutexvar_epi16(ilo, sc512);
      const __m512i shi = _mm512_permutexvar_epi16(ihi, sc512);
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
        const int8_t* p = aq[i] + sb * 256 + 128 * h;
        ia[i] = madd_acc512(ia[i], _mm512_maddubs_epi16(ulo, _mm512_loadu_si512(p)), slo);
        __m512i& dst = kSplit ? ib[i] : ia[i];
        dst = madd_acc512(dst, _mm512_maddubs_epi16(uhi, _mm512_loadu_si512(p + 64)), shi);
      }
    }
    const float d = f16_at(b + 208);
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
      const int r = j * MT + i;
      isv[r] = kSplit ? _mm512_add_epi32(ia[i], ib[i]) : ia[i];
      dd[r] = d * a.drow(m0 + i)[sb];
      if (r % 4 == 3 || r == R - 1) isg[r / 4] = isum_group<R>(isv, r / 4);  // as q45k_tile512
    }
   }
   FS_GGML_UNROLL for (int g = 0; g < G; ++g)
     acc[g] = _mm_fmadd_ps(_mm_cvtepi32_ps(isg[g]), lanes4<R>(dd, g), acc[g]);
  }
  alignas(16) float out[4 * G];
  FS_GGML_UNROLL for (int g = 0; g < G; ++g) _mm_store_ps(out + 4 * g, acc[g]);
  FS_GGML_UNROLL for (int r = 0; r < R; ++r) res[r] = out[r];
}

template <int MT>
[[gnu::always_inline]] inline void q6k_row512(const uint8_t* w, int64_t nsb, const Act& a,
                                              int64_t m0, float* res) {
  q6k_tile512<1, MT>(&w, nsb, a, m0, res);
}

}  // namespace fitserve::ggml

#endif
