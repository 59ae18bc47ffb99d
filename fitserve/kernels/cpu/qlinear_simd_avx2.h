// Simd for the avx2 tier (AVX2 + FMA + F16C): 32-byte chunks, 8 lanes.
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
  static constexpr int kBytes = 32;
  static constexpr int kLanes = 8;
  static constexpr int kFloatBytes = 8;
  static constexpr int kPanelMT = 4;
  static constexpr uint8_t kAct8Xor = 0x00;
  using B = __m256i;
  using I = __m256i;
  using F = __m256;

  static B load_bytes(const void* p, int n) {
    if (n >= kBytes) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
    if (n == 16)  // the half chunk ending an int4 group-32 row of an odd group count
      return _mm256_inserti128_si256(_mm256_setzero_si256(),
                                     _mm_loadu_si128(static_cast<const __m128i*>(p)), 0);
    alignas(32) uint8_t buf[kBytes] = {};  // a row's tail only: a short loop, no libc call
    for (int i = 0; i < n; ++i) buf[i] = static_cast<const uint8_t*>(p)[i];
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
  }
  static B nib_lo(B w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
  static B nib_hi(B w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F)); }
  static I izero() { return _mm256_setzero_si256(); }
  static I dot_u4(I acc, B u, B s) {
    const I pairs = _mm256_maddubs_epi16(u, s);  // 2 * 15 * 127 < 2^15
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  // dot_u4(dot_u4(0, lo, alo), hi, ahi) with the two byte-pair sums added as int16 first:
  // |lo pair + hi pair| <= 4 * 15 * 127 < 2^15
  static I dot_u4x2(B lo, B alo, B hi, B ahi) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
  // A whole span's 8 group scales -> each chunk's lane scales with in-lane shuffles only (one
  // cross-lane permute per span instead of one per chunk): int4 chunk j = groups 2j, 2j+1 on
  // lanes 0-3 / 4-7; int8 chunk j = group j on all lanes.
  struct Span4 { F p; };  // [s0 s2 s4 s6 | s1 s3 s5 s7]
  static Span4 span4(F sv) {
    return {_mm256_permutevar8x32_ps(sv, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7))};
  }
  template <int j>
  static F chunk4(const Span4& s) { return _mm256_permute_ps(s.p, j * 0x55); }
  struct Span8 { F lo, hi; };  // [s0..s3 | s0..s3], [s4..s7 | s4..s7]
  static Span8 span8(F sv) {
    return {_mm256_permute2f128_ps(sv, sv, 0x00), _mm256_permute2f128_ps(sv, sv, 0x11)};
  }
  template <int j>
  static F chunk8(const Span8& s) { return _mm256_permute_ps(j < 4 ? s.lo : s.hi, (j % 4) * 0x55); }
  // the batch-1 GEMV's int8 dot of plain (unbiased) activations: the sign trick below
  static constexpr bool kGemvW8Unsigned = false;
  static I gemv_dot_w8(B w, B a, I) { return dot_w8(prep_w8(w), a); }
  struct W8 { B absw; B w; };
  static W8 prep_w8(B w) { return {_mm256_sign_epi8(w, w), w}; }
  static I dot_w8(const W8& w, B a) {
    const B sa = _mm256_sign_epi8(a, w.w);  // |pair sum| <= 2 * 128 * 127 < 2^15
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w.absw, sa), _mm256_set1_epi16(1));
  }

  // ---- the canonical batch-1 rows (qlinear_rows.h)
  // 128-bit lane j of the result = [sum of the 4 dwords of lane j of a, of b, of c, of d]
  static I hsum128x4(I a, I b, I c, I d) {
    const I ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const I cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
  }
  // 128-bit lanes [a0 + a1, b0 + b1]
  static I pair128(I a, I b) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
  }
  // lane n of the natural group order <- lane kNat*[n] of hsum128x4 (int4: chunk j, 128-bit
  // lane k = group 2j + k) / pair128 (int8: chunk j = group j)
  static constexpr int32_t kNatU4[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  static constexpr int32_t kNatW8[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  // a * b rounded to fp32 and never fused into a later add (C++ lets the compiler contract
  // mul + add into an FMA, which rounds once: the canonical order needs the rounded product)
  static F mulr(F a, F b) {
    F p = mul(a, b);
    asm("" : "+x"(p));
    return p;
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }

  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  // lanes [0, n) set: a masked load / store instead of a variable-size memcpy (a libc call)
  static __m256i lane_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F loadf(const float* p, int n) {
    if (n >= kLanes) return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, lane_mask(n));
  }
  using HMask = int;
  static HMask hmask(int n) { return n; }
  // NOTE: a chunk of a group-32 row needs only 1-2 scales, loaded once per weight row and chunk:
  // a variable-size memcpy there compiled to a libc call and made act_quant 2-4x slower at M=1.
  // Each memcpy below has a constant size (one scalar load); other counts build on them.
  static F load_half(const at::Half* p, int n) {
    if (n >= kLanes) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if (n == 1) {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return _mm256_cvtph_ps(_mm_cvtsi32_si128(v));
    }
    if (n == 2) {
      int32_t v;
      std::memcpy(&v, p, 4);
      return _mm256_cvtph_ps(_mm_cvtsi32_si128(v));
    }
    if (n == 4) {
      long long v;
      std::memcpy(&v, p, 8);
      return _mm256_cvtph_ps(_mm_cvtsi64_si128(v));
    }
    return _mm256_cvtph_ps(load_u16(reinterpret_cast<const uint16_t*>(p), n));
  }
  // n < 8 uint16 into the low lanes of a zeroed vector from constant-size loads. NOTE: a loop
  // into a stack buffer read back as one vector stalls on store forwarding; where a row's group
  // count left 3, 5, 6 or 7 (K = 960: 30 groups) that made the batch-1 int4 GEMV 1.5x slower.
  static __m128i load_u16(const uint16_t* p, int n) {
    __m128i v = _mm_setzero_si128();
    int i = 0;
    if (n & 4) {
      long long q;
      std::memcpy(&q, p, 8);
      v = _mm_cvtsi64_si128(q);
      i = 4;
    }
    if (n & 2) {
      int32_t d;
      std::memcpy(&d, p + i, 4);
      v = i ? _mm_insert_epi32(v, d, 2) : _mm_insert_epi32(v, d, 0);
      i += 2;
    }
    if (n & 1) {
      switch (i) {
        case 0: v = _mm_insert_epi16(v, p[0], 0); break;
        case 2: v = _mm_insert_epi16(v, p[2], 2); break;
        case 4: v = _mm_insert_epi16(v, p[4], 4); break;
        default: v = _mm_insert_epi16(v, p[6], 6); break;
      }
    }
    return v;
  }
  using P = __m256i;
  static P load_perm(const int32_t* idx) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx));
  }
  static F permute(F v, P idx) { return _mm256_permutevar8x32_ps(v, idx); }
  static float h2f(at::Half h) { return _cvtsh_ss(h.x); }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void nib_f(const uint8_t* p, F& lo, F& hi) {
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  static F i8_f(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // ---- panel kernels (qlinear_panel.h): lanes are weight rows
  static B loadb(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static B bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I iset1(int32_t v) { return _mm256_set1_epi32(v); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static constexpr bool kW8Biased = false;
  static I dot_w8p(I acc, B w, B a) { return _mm256_add_epi32(acc, dot_w8(prep_w8(w), a)); }
  static void storef(float* p, F v, int n) {
    if (n >= kLanes) return _mm256_storeu_ps(p, v);
    _mm256_maskstore_ps(p, lane_mask(n), v);
  }
  static void transpose_dwords(const uint8_t* const* rows, int64_t off, uint32_t* out) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i)
      r[i] = _mm256_castsi256_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + off)));
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
      float* o = reinterpret_cast<float*>(out);
      _mm256_storeu_ps(o + i * 8, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
      _mm256_storeu_ps(o + (i + 4) * 8, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
  }

  static void quant32(const float* x, int8_t* q, float& da, int32_t& isum) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int i = 8; i < 32; i += 8)
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    alignas(32) int32_t t[32];
    for (int i = 0; i < 32; i += 8) {
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), id));
      _mm256_store_si256(reinterpret_cast<__m256i*>(t + i),
                         _mm256_max_epi32(_mm256_min_epi32(v, _mm256_set1_epi32(127)),
                                          _mm256_set1_epi32(-127)));
    }
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) {
      q[i] = static_cast<int8_t>(t[i]);
      s += t[i];
    }
    isum = s;
    // NOTE: a NaN / inf in x must not vanish in the rounding: its block scale becomes NaN
    __m256 z = _mm256_setzero_ps();
    for (int i = 0; i < 32; i += 8)
      z = _mm256_add_ps(z, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_setzero_ps()));
    da = amax / 127.f + hsum(z);
  }
};

}  // namespace fitserve::qlinear
