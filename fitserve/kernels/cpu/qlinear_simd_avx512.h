// Simd for the avx512 and avx512_vnni tiers: 64-byte chunks, 16 lanes.
// Included by qlinear_simd.h only (the vocabulary is explained there).
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace fitserve::qlinear {

struct Simd {
  static constexpr int kBytes = 64;
  static constexpr int kLanes = 16;
  static constexpr int kFloatBytes = 16;
  static constexpr int kPanelMT = 8;  // rows of x per panel tile
#if defined(FITSERVE_TIER_AVX512_VNNI)
  // NOTE: with vpdpbusd (u8 x s8) the int8 ACTIVATIONS are stored biased (a + 128 = a ^ 0x80, an
  // unsigned byte) and each (row, chunk) of weights gets a -128 * sum(w) starting value, so
  // dpbusd(bias, a + 128, w) is exactly dot(a, w) with no per-pair sign fix-up.
  static constexpr uint8_t kAct8Xor = 0x80;
#else
  static constexpr uint8_t kAct8Xor = 0x00;
#endif
  using B = __m512i;
  using I = __m512i;
  using F = __m512;

  static __mmask64 mask64(int n) { return n >= 64 ? ~0ULL : ((1ULL << n) - 1); }
  static B load_bytes(const void* p, int n) {
    return n >= kBytes ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(mask64(n), p);
  }
  static B nib_lo(B w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  static B nib_hi(B w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
  static I izero() { return _mm512_setzero_si512(); }

  // acc + per-lane sum of u[i] * s[i], u unsigned (int4 quants, <= 15), s signed.
  static I dot_u4(I acc, B u, B s) {
#if defined(FITSERVE_TIER_AVX512_VNNI)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    // maddubs pairs: 2 * 15 * 127 < 2^15, so no saturation
    const I pairs = _mm512_maddubs_epi16(u, s);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
  }

#if defined(FITSERVE_TIER_AVX512_VNNI)
  struct W8 { B w; I bias; };
  static W8 prep_w8(B w) {
    const I s = _mm512_dpbusd_epi32(izero(), _mm512_set1_epi8(static_cast<char>(0x80)), w);
    return {w, _mm512_sub_epi32(izero(), s)};
  }
  // per-lane dot(a, w) of int8 activations (stored a ^ 0x80) and int8 weights
  static I dot_w8(const W8& w, B a_biased) { return _mm512_dpbusd_epi32(w.bias, a_biased, w.w); }
#else
  // sign trick: |w| (unsigned) x (a with w's sign); |pair sum| <= 2 * 128 * 127 < 2^15
  struct W8 { B absw; __mmask64 neg; };
  static W8 prep_w8(B w) { return {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)}; }
  static I dot_w8(const W8& w, B a) {
    const B sa = _mm512_mask_sub_epi8(a, w.neg, _mm512_setzero_si512(), a);
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w.absw, sa), _mm512_set1_epi16(1));
  }
#endif

  // ---- the batch-1 GEMV (qlinear_gemv.h)
  // dot_u4(dot_u4(0, lo, alo), hi, ahi); without VNNI the two byte-pair sums are added as int16
  // first (|lo pair + hi pair| <= 4 * 15 * 127 < 2^15)
  static I dot_u4x2(B lo, B alo, B hi, B ahi) {
#if defined(FITSERVE_TIER_AVX512_VNNI)
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(izero(), lo, alo), hi, ahi);
#else
    const I pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, alo), _mm512_maddubs_epi16(hi, ahi));
    return _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#endif
  }
  // A span's 16 group scales -> each chunk's lane scales with one in-lane permute per chunk
  // (the cross-lane permutes happen once per span). int4 chunk j = groups 4j..4j+3, one per
  // 128-bit lane: the span is the 4 x 4 transpose, [s0 s4 s8 s12 | s1 s5 s9 s13 | ...], and
  // chunk j broadcasts element j within each 128-bit lane.
  struct Span4 { F p; };
  static Span4 span4(F sv) {
    return {_mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sv)};
  }
  template <int j>
  static F chunk4(const Span4& s) { return _mm512_permute_ps(s.p, j * 0x55); }
  // int8 chunk j = groups 2j (lanes 0-7), 2j+1 (lanes 8-15): lo = [s0 s2 s4 s6] x 2 then
  // [s1 s3 s5 s7] x 2 for chunks 0-3, hi the same from s8 for chunks 4-7
  struct Span8 { F lo, hi; };
  static Span8 span8(F sv) {
    return {_mm512_permutexvar_ps(
                _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7), sv),
            _mm512_permutexvar_ps(
                _mm512_setr_epi32(8, 10, 12, 14, 8, 10, 12, 14, 9, 11, 13, 15, 9, 11, 13, 15), sv)};
  }
  template <int j>
  static F chunk8(const Span8& s) { return _mm512_permute_ps(j < 4 ? s.lo : s.hi, (j % 4) * 0x55); }
#if defined(FITSERVE_TIER_AVX512_VNNI)
  // NOTE: the weights are read unsigned (w ^ 0x80 = w + 128), so dpbusd gives dot(w, a) +
  // 128 * sum(a); the per-lane -128 * sum(a) is computed once per call (QAct::lane_bias) and is
  // the accumulator's start: exact, one xor per chunk instead of prep_w8's second dpbusd.
  static constexpr bool kGemvW8Unsigned = true;
  static I gemv_dot_w8(B w, B a, I lane_bias) {
    return _mm512_dpbusd_epi32(lane_bias, _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))), a);
  }
#else
  static constexpr bool kGemvW8Unsigned = false;
  static I gemv_dot_w8(B w, B a, I) { return dot_w8(prep_w8(w), a); }
#endif

  // ---- the canonical batch-1 rows (qlinear_rows.h)
  // 128-bit lane j of the result = [sum of the 4 dwords of lane j of a, of b, of c, of d]
  static I hsum128x4(I a, I b, I c, I d) {
    const I ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const I cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  }
  // 128-bit lanes [a0 + a1, a2 + a3, b0 + b1, b2 + b3]
  static I pair128(I a, I b) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
  }
  // lane n of the natural group order <- lane kNat*[n] of hsum128x4 (int4: chunk j, 128-bit
  // lane k = group 4j + k) / pair128 (int8: chunk j holds groups 2j, 2j + 1)
  static constexpr int32_t kNatU4[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
  static constexpr int32_t kNatW8[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
  // a * b rounded to fp32 and never fused into a later add (C++ lets the compiler contract
  // mul + add into an FMA, which rounds once: the canonical order needs the rounded product)
  static F mulr(F a, F b) {
    F p = mul(a, b);
    asm("" : "+v"(p));
    return p;
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }

  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F loadf(const float* p, int n) {
    return n >= kLanes ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((1U << n) - 1, p);
  }
  using HMask = __mmask16;  // which of kLanes halves to load
  static HMask hmask(int n) { return n >= kLanes ? 0xFFFF : static_cast<__mmask16>((1U << n) - 1); }
  static F load_half(const at::Half* p, HMask m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
  static F load_half(const at::Half* p, int n) { return load_half(p, hmask(n)); }
  // out[l] = v[idx[l]]
  using P = __m512i;
  static P load_perm(const int32_t* idx) { return _mm512_loadu_si512(idx); }
  static F permute(F v, P idx) { return _mm512_permutexvar_ps(idx, v); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static float h2f(at::Half h) { return _cvtsh_ss(h.x); }

  // fp32 path: kFloatBytes bytes of int4 -> low / high nibbles as floats
  static void nib_f(const uint8_t* p, F& lo, F& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  static F i8_f(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // ---- panel kernels (qlinear_panel.h): lanes are weight rows
  static B loadb(const void* p) { return _mm512_loadu_si512(p); }
  static B bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I iset1(int32_t v) { return _mm512_set1_epi32(v); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
#if defined(FITSERVE_TIER_AVX512_VNNI)
  // panel int8 weights are stored as w ^ 0x80 (= w + 128, unsigned); the caller starts each
  // block's sum at -128 * sum(a) so that dpbusd(w + 128, a) gives dot(w, a)
  static constexpr bool kW8Biased = true;
  static I dot_w8p(I acc, B wu, B a) { return _mm512_dpbusd_epi32(acc, wu, a); }
#else
  static constexpr bool kW8Biased = false;
  static I dot_w8p(I acc, B w, B a) { return _mm512_add_epi32(acc, dot_w8(prep_w8(w), a)); }
#endif
  static void storef(float* p, F v, int n) {
    if (n >= kLanes) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1U << n) - 1), v);
  }

  // out[d * kLanes + l] = dword d of rows[l], for the kLanes dwords at byte offset `off`
  static void transpose_dwords(const uint8_t* const* rows, int64_t off, uint32_t* out) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i] + off);
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // r[4a + b] holds, in 128-bit lane c, dword 4c + b' of rows 4a .. 4a+3 (b' = 0, 1, 2, 3)
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
      t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
      t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
      t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; ++i) {
      // dword index d = 4c + b: c from the final shuffle, b = i
      const __m512i lo0 = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
      const __m512i hi0 = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
      const __m512i lo1 = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
      const __m512i hi1 = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
      _mm512_storeu_si512(out + (0 + i) * 16, lo0);
      _mm512_storeu_si512(out + (8 + i) * 16, hi0);
      _mm512_storeu_si512(out + (4 + i) * 16, lo1);
      _mm512_storeu_si512(out + (12 + i) * 16, hi1);
    }
  }

  // 32 floats -> int8 round-half-even(x * 127 / absmax), da = absmax / 127, isum = sum(q)
  static void quant32(const float* x, int8_t* q, float& da, int32_t& isum) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i lim = _mm512_set1_epi32(127);
    auto cv = [&](__m512 v) {
      const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v, id));  // MXCSR: round half even
      return _mm512_max_epi32(_mm512_min_epi32(i, lim),
                              _mm512_sub_epi32(_mm512_setzero_si512(), lim));
    };
    const __m512i qa = cv(a), qb = cv(b);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
    isum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    // NOTE: a NaN / inf in x must not vanish in the rounding: its block scale becomes NaN
    const float probe =
        _mm512_reduce_add_ps(_mm512_mul_ps(_mm512_add_ps(a, b), _mm512_setzero_ps()));
    da = amax / 127.f + probe;
  }
};

}  // namespace fitserve::qlinear
