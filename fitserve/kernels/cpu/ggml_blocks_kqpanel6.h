// Q6_K's "lane = output row" panel (ggml_blocks_kqpanel.h has the layout and the Q4_K / Q5_K
// one): codes in natural column order (x of Q6_K is not permuted), 16 chunks of 16 columns with
// an int8 scale each, the -32 offset as sum_s sc[s] * s16[s] (vpdpwssd on int16 pairs) << 5.
#pragma once

#ifdef FS_GGML_AVX512

namespace fitserve::ggml {

struct Q6KPanel {
  static constexpr int64_t kBytes = 210;
  static constexpr int kZmm = 64 + 16 + 8 + 1;  // codes, sc, sc pairs, d
  static constexpr int kChunkDwords = 4;          // codes' dwords per scale (16 columns)
  // NOTE: panel / row tiles per call as Q45KPanel's: M = 8 1.25, 12 0.94, 16 0.94 (Q6_K's three
  // transposes make its panel dearer to pack, its 16 scales to apply)
  static constexpr int kMinRows = 12;

  // kDigits (the AMX panel, ggml_blocks_kqamx.h): after the VNNI panel, its codes become three
  // signed planes, the centred codes (q - 32) times each base-8 digit of their chunk's scale
  // (digit_planes): p[0..63], p[kZmm..kZmm + 63], p[kZmm + 64..kZmm + 127].
  template <bool kDigits = false>
  static void pack(const uint8_t* const* rows, __m512i idx, int64_t sb, __m512i* p) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512i qh[16];
    FS_GGML_UNROLL for (int l = 0; l < 16; ++l) qh[l] = _mm512_loadu_si512(rows[l] + sb * kBytes + 128);
    transpose16(qh);  // qh[8h + e]: bytes 32h + 4e .. of each row
    FS_GGML_UNROLL for (int h = 0; h < 2; ++h) {
      __m512i r[16];
      FS_GGML_UNROLL for (int l = 0; l < 16; ++l) r[l] = _mm512_loadu_si512(rows[l] + sb * kBytes + 64 * h);
      transpose16(r);
      // ql dword e: e < 8 columns 4e.. of t = 0 (low nibble) / 2 (high); e >= 8: t = 1 / 3
      FS_GGML_UNROLL for (int e = 0; e < 16; ++e) {
        const int e8 = e % 8, tl = e / 8, th = tl + 2;
        const __m512i q = qh[8 * h + e8];
        const __m512i hl = tl == 0 ? _mm512_slli_epi16(q, 4) : _mm512_slli_epi16(q, 2);
        const __m512i hh = th == 2 ? q : _mm512_srli_epi16(q, 2);
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(r[e], m4), _mm512_and_si512(hl, m30));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(r[e], 4), m4),
                                           _mm512_and_si512(hh, m30));
        _mm512_store_si512(p + 32 * h + 8 * tl + e8, lo);
        _mm512_store_si512(p + 32 * h + 8 * th + e8, hi);
      }
    }
    const uint8_t* b0 = rows[0] + sb * kBytes;
    __m512i sc[16];
    FS_GGML_UNROLL for (int g = 0; g < 4; ++g) {
      const __m512i v = gather_rows(b0, idx, 192 + 4 * g);
      FS_GGML_UNROLL for (int i = 0; i < 4; ++i)  // byte i sign-extended
        sc[4 * g + i] = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24);
    }
    FS_GGML_UNROLL for (int k = 0; k < 16; ++k) _mm512_store_si512(p + 64 + k, sc[k]);
    FS_GGML_UNROLL for (int q = 0; q < 8; ++q)
      _mm512_store_si512(p + 80 + q, _mm512_or_si512(
          _mm512_and_si512(sc[2 * q], _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(sc[2 * q + 1], 16)));
    // d: the f16 at byte 208 (the dword at 206: never past the block's 210 bytes)
    _mm512_store_ps(reinterpret_cast<float*>(p + 88), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
        _mm512_srli_epi32(gather_rows(b0, idx, 206), 16))));
    if constexpr (kDigits) digit_planes(p);
  }

  // The scale of each chunk as sc = 64 a + 8 b + c with every digit in -3..4 (balanced base 8:
  // -3..4 is a complete residue system mod 8, and |sc| <= 128 leaves a in -2..2), and the
  // centred codes (q - 32, in -32..31) times each digit in signed bytes: products in -128..124,
  // so sum_col (q - 32) sc x = 64 C_a + 8 C_b + C_c exactly, three tile accumulators and no
  // multiply per chunk. NOTE: vpmullw on each byte sign-extended to a word, the low byte kept.
  static void digit_planes(__m512i* p) {
    const __m512i three = _mm512_set1_epi32(3), seven = _mm512_set1_epi32(7);
    const __m512i lo_byte = _mm512_set1_epi16(0x00FF), c32 = _mm512_set1_epi8(32);
    auto words = [](__m512i d) {  // the digit in both words of its dword
      return _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(d, 16));
    };
    auto times = [&](__m512i lo, __m512i hi, __m512i dw) {
      return _mm512_or_si512(_mm512_and_si512(_mm512_mullo_epi16(lo, dw), lo_byte),
                             _mm512_slli_epi16(_mm512_mullo_epi16(hi, dw), 8));
    };
    FS_GGML_UNROLL for (int k = 0; k < 16; ++k) {
      const __m512i sc = _mm512_load_si512(p + 64 + k);
      const __m512i c = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(sc, three), seven), three);
      const __m512i s1 = _mm512_srai_epi32(_mm512_sub_epi32(sc, c), 3);
      const __m512i b = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(s1, three), seven), three);
      const __m512i a = _mm512_srai_epi32(_mm512_sub_epi32(s1, b), 3);
      const __m512i da = words(a), db = words(b), dc = words(c);
      FS_GGML_UNROLL for (int j = 0; j < 4; ++j) {
        const __m512i q = _mm512_sub_epi8(_mm512_load_si512(p + 4 * k + j), c32);
        const __m512i lo = _mm512_srai_epi16(_mm512_slli_epi16(q, 8), 8), hi = _mm512_srai_epi16(q, 8);
        _mm512_store_si512(p + 4 * k + j, times(lo, hi, da));
        _mm512_store_si512(p + kZmm + 4 * k + j, times(lo, hi, db));
        _mm512_store_si512(p + kZmm + 64 + 4 * k + j, times(lo, hi, dc));
      }
    }
  }

  // A super-block's end from the exact sum_col (q - 32) sc x (the AMX planes): the VNNI finish
  // without its -32 offset, which that sum already holds (the same integer, the same fp32 ops).
  [[gnu::always_inline]] static void finish_centered(const __m512i* p, int64_t sb, const Act& a,
                                                     int64_t m, __m512i is, __m512& acc) {
    const __m512 d = _mm512_load_ps(reinterpret_cast<const float*>(p + 88));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(a.drow(m)[sb])), acc);
  }

  // One super-block's end for row m of x: the -32 offset (sum_s sc[s] * s16[s], << 5) and
  // kq512.h's canonical fp32 order. Shared by the VNNI and AMX tiles (the bits).
  [[gnu::always_inline]] static void finish(const __m512i* p, int64_t sb, const Act& a, int64_t m,
                                            __m512i isum, __m512& acc) {
    __m512i off = _mm512_setzero_si512();
    const uint8_t* s = reinterpret_cast<const uint8_t*>(a.s16row(m) + sb * 16);
    FS_GGML_UNROLL for (int q = 0; q < 8; ++q)
      off = madd_acc512(off, _mm512_load_si512(p + 80 + q),
                        _mm512_set1_epi32(static_cast<int>(load_u32(s + 4 * q))));
    const __m512 d = _mm512_load_ps(reinterpret_cast<const float*>(p + 88));
    const __m512i is = _mm512_sub_epi32(isum, _mm512_slli_epi32(off, 5));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(a.drow(m)[sb])), acc);
  }
};

}  // namespace fitserve::ggml

#endif  // FS_GGML_AVX512
