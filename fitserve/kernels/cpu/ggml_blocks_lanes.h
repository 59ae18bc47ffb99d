// The AVX512-VNNI rows of the 32-column block types whose weights are a byte each after
// decoding (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4): 16 blocks (512 columns) per step, one fp32 lane per block.
//
//   per pair of blocks: 64 unsigned weight bytes (B::pair: Q5's q in 0..31, IQ4_NL's table
//   value + 128), one VPDPBUSD per row of x -> 8 int32 partials per block
//   per 16 blocks and row: the 8 vectors of partials reduced to one (lane = block: 21 ops,
//   block_sums16), the offset folded in as an integer (Q5_0: - 16 * sum(a), IQ4_NL:
//   - 128 * sum(a), from Act's 32-column sums: exact), then ONE cvt + mul + FMA for 16 blocks
//   with the weight scales read once per step (shared by the tile's rows); Q5_1's mins are
//   one more FMA against Act's d * sum(a).
//
// Before, each block and row paid a cvt, a scalar d * da, a broadcast and an FMA (and Q5's
// scalar offset FMA): the M > 1 tiles cost 2-4x Q4_K's per weight. Each row of x runs the same
// instructions whatever the tile's height, so row r of any M is bit for bit the row alone.
#pragma once

#include <algorithm>
#include <type_traits>

#include "ggml_blocks_act.h"

namespace fitserve::ggml {

// Whether B's M > 1 tiles take x quantized lanes_t (Act) and transpose their weights once per
// step (lanes_step_t): B::kLanesTiles, VNNI rows only.
template <class B, class = void>
struct lanes_tiles : std::false_type {};
#ifdef FS_GGML_VNNI
template <class B>
struct lanes_tiles<B, std::void_t<decltype(B::kLanesTiles)>>
    : std::bool_constant<B::kLanesTiles> {};

// The permute indices of transpose_pairs: [stage s][output vector v][16], computed once by
// following each element (block b, dword c): stage s pairs vectors v and v | 1 << s, output v
// takes the elements of both whose bit s of c is 0, v | 1 << s those where it is 1, each in
// (b, c) order; after 3 stages vector c holds dword c of blocks 0-15 in block order.
inline const int32_t* transpose_idx() {
  struct Table {
    alignas(64) int32_t idx[3][8][16];
  };
  static const Table table = [] {
    Table t{};
    int lay[8][16][2], next[8][16][2];  // (b, c) of each element
    for (int v = 0; v < 8; ++v)
      for (int p = 0; p < 16; ++p) lay[v][p][0] = 2 * v + p / 8, lay[v][p][1] = p % 8;
    for (int s = 0; s < 3; ++s) {
      for (int v = 0; v < 8; ++v) {
        if (v & (1 << s)) continue;
        const int w = v | (1 << s);
        auto elem = [&](int i) { return lay[i < 16 ? v : w][i % 16]; };
        for (int side = 0; side < 2; ++side) {
          int cand[16], n = 0;
          for (int i = 0; i < 32 && n < 16; ++i)
            if (((elem(i)[1] >> s) & 1) == side) cand[n++] = i;
          std::sort(cand, cand + 16, [&](int x, int y) {
            return elem(x)[0] != elem(y)[0] ? elem(x)[0] < elem(y)[0] : elem(x)[1] < elem(y)[1];
          });
          const int out = side ? w : v;
          for (int p = 0; p < 16; ++p) {
            t.idx[s][out][p] = cand[p];
            next[out][p][0] = elem(cand[p])[0];
            next[out][p][1] = elem(cand[p])[1];
          }
        }
      }
      std::memcpy(lay, next, sizeof lay);
    }
    return t;
  }();
  return &table.idx[0][0][0];
}

// v[j]: lanes 0-7 the partial dots of block 2j, 8-15 of block 2j + 1 -> lane b the dot of
// block b (b < 16). unpack lo/hi epi32 then epi64 sum within 128-bit lanes, one 128-bit lane
// shuffle across the two halves, and a permute back to block order.
[[gnu::always_inline]] inline __m512i block_sums16(const __m512i* v) {
  __m512i a[4];
  FS_GGML_UNROLL for (int p = 0; p < 4; ++p)
    a[p] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * p], v[2 * p + 1]),
                            _mm512_unpackhi_epi32(v[2 * p], v[2 * p + 1]));
  const __m512i b0 = _mm512_add_epi32(_mm512_unpacklo_epi64(a[0], a[1]),
                                      _mm512_unpackhi_epi64(a[0], a[1]));
  const __m512i b1 = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2], a[3]),
                                      _mm512_unpackhi_epi64(a[2], a[3]));
  // 128-bit lane L of b0 holds [v0.L, v1.L, v2.L, v3.L] (each the sum of v_j's 4 lanes in L);
  // L = 0, 1 are block 2j's, 2, 3 block 2j + 1's: element 4L' + i is block
  // 8 (L' / 2) + L' % 2 + 2i after the sums below
  const __m512i s = _mm512_add_epi32(_mm512_shuffle_i64x2(b0, b1, 0x88),
                                     _mm512_shuffle_i64x2(b0, b1, 0xDD));
  const __m512i to_block = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  return _mm512_permutexvar_epi32(to_block, s);
}

// v[j] (j < 4) as block_sums16's -> lane s of a ymm the dot of sub-block s (s < 8).
[[gnu::always_inline]] inline __m256i block_sums8(const __m512i* v) {
  const __m512i a0 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]),
                                      _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i a1 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]),
                                      _mm512_unpackhi_epi32(v[2], v[3]));
  const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi64(a0, a1),
                                     _mm512_unpackhi_epi64(a0, a1));
  // 128-bit lanes [L0 + L1, L2 + L3]: sub-blocks 0, 2, 4, 6 then 1, 3, 5, 7
  const __m512i s = _mm512_add_epi32(_mm512_shuffle_i64x2(b, b, 0x08),
                                     _mm512_shuffle_i64x2(b, b, 0x0D));
  return _mm256_permutevar8x32_epi32(_mm512_castsi512_si256(s),
                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The 4 bytes at b + S * k for k < 16 (each block's head: Q5's d and Q5_1's m, IQ4_NL's d;
// for an odd S the dword starts one byte early at odd k: MXFP4's e is then its byte 1) as the
// 16 dwords of a zmm; bytes past nbytes read as zero (never loaded).
// NOTE: contiguous loads (the lines the step reads anyway) and word permutes instead of a 16-way
// gather, which was ~20% of a Q5_0 step's time at M = 1 on Zen 5 (the permutes: 3 + 2 blends)
template <int S>
[[gnu::always_inline]] inline __m512i head_dwords16(const uint8_t* b, int64_t nbytes) {
  static_assert(S * 15 / 2 + 1 < 3 * 64, "block heads within 3 x 128 bytes");
  __m512i part[3];
  FS_GGML_UNROLL for (int p = 0; p < 3; ++p) {
    __m512i ld[2];
    FS_GGML_UNROLL for (int h = 0; h < 2; ++h) {
      const int64_t o = 128 * p + 64 * h, n = std::clamp<int64_t>(nbytes - o, 0, 64);
      ld[h] = n >= 64 ? _mm512_loadu_si512(b + o)
                      : _mm512_maskz_loadu_epi8(n > 0 ? (~0ull >> (64 - n)) : 0, b + o);
    }
    // word t of the result: word S * (t / 2) / 2 + t % 2 of the 192, here of [64p, 64p + 64)
    alignas(64) int16_t idx[32];
    for (int t = 0; t < 32; ++t) idx[t] = static_cast<int16_t>((S * (t / 2) / 2 + t % 2) & 63);
    part[p] = _mm512_permutex2var_epi16(ld[0], _mm512_load_si512(idx), ld[1]);
  }
  uint32_t in1 = 0, in2 = 0;  // the words from part 1, part 2
  for (int t = 0; t < 32; ++t) {
    in1 |= static_cast<uint32_t>((S * (t / 2) / 2 + t % 2) / 64 == 1) << t;
    in2 |= static_cast<uint32_t>((S * (t / 2) / 2 + t % 2) / 64 == 2) << t;
  }
  return _mm512_mask_mov_epi16(_mm512_mask_mov_epi16(part[0], in1, part[1]), in2, part[2]);
}

// The f16 in the low word of each dword, as 16 floats (Q5's d, IQ4_NL's d).
[[gnu::always_inline]] inline __m512 low_f16s(__m512i g) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
}

// Whether B reads its own 16 block heads (B::heads16(b, nbytes), Q8_0's 34-byte blocks) instead
// of head_dwords16<B::kBytes>.
template <class B, class = void>
struct has_heads16 : std::false_type {};
template <class B>
struct has_heads16<B, std::void_t<decltype(&B::heads16)>> : std::true_type {};

template <class B>
[[gnu::always_inline]] inline __m512i lane_heads(const uint8_t* b, int64_t nbytes) {
  if constexpr (has_heads16<B>::value)
    return B::heads16(b, nbytes);
  else
    return head_dwords16<B::kBytes>(b, nbytes);
}

// What a row m of x brings to the finish of its 16 block dots at block k (lanes `live`): the
// integer offset sum(a) << kShift, the scales da and (Q*_1) d * sum(a). Loaded once per row of x
// and step for every weight row of a register tile (ggml_blocks_lanes_panel.h).
struct LanesX {
  __m512i off;
  __m512 da, ds;
};

template <class B>
[[gnu::always_inline]] inline LanesX lanes_x(const Act& a, int64_t m, int64_t k, __mmask16 live) {
  LanesX x;
  if constexpr (B::kShift >= 0)
    x.off = _mm512_slli_epi32(
        _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(live, a.s32row(m) + k)), B::kShift);
  x.da = _mm512_maskz_loadu_ps(live, a.drow(m) + k);
  if constexpr (B::kHasMin) x.ds = _mm512_maskz_loadu_ps(live, a.dsrow(m) + k);
  return x;
}

// A row of x's 16 block dots (lane = block) scaled into acc: the integer offset, then d * da
// (and Q*_1's mins against d * sum(a)).
template <class B>
[[gnu::always_inline]] inline void lanes_apply(__m512i dot, __m512i g, __m512 dv, const LanesX& x,
                                               __m512& acc) {
  if constexpr (B::kShift >= 0) dot = _mm512_sub_epi32(dot, x.off);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, x.da), acc);
  if constexpr (B::kHasMin) {
    const __m512 mv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
    acc = _mm512_fmadd_ps(mv, x.ds, acc);
  }
}

template <class B>
[[gnu::always_inline]] inline void lanes_finish(__m512i dot, __m512i g, __m512 dv, __mmask16 live,
                                                const Act& a, int64_t m, int64_t k, __m512& acc) {
  lanes_apply<B>(dot, g, dv, lanes_x<B>(a, m, k, live), acc);
}

// B: kBytes, kShift (the integer offset: dot - (sum(a) << kShift); < 0: none), kHasMin (a second
// f16 at byte 2: w = d * q + m), lane_scales(head_dwords16) -> the 16 blocks' scales, and
// pair(b, two) -> the 64 unsigned weight bytes of blocks b
// and b + kBytes (the second zero unless `two`).
template <class B, int MT, bool kFull>
[[gnu::always_inline]] inline void lanes_step(const uint8_t* b, int64_t k, int r, const Act& a,
                                              int64_t m0, __m512* acc) {
  const __mmask16 live = kFull ? __mmask16(0xFFFF) : __mmask16((1u << r) - 1);
  __m512i wv[8];
  FS_GGML_UNROLL for (int j = 0; j < 8; ++j)
    wv[j] = kFull || 2 * j < r ? B::pair(b + 2 * j * B::kBytes, kFull || 2 * j + 1 < r)
                               : _mm512_setzero_si512();
  const __m512i g = lane_heads<B>(b, kFull ? 16 * B::kBytes : r * B::kBytes);
  const __m512 dv = B::lane_scales(g);
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
    const int8_t* aq = a.qrow(m0 + i) + 32 * k;
    __m512i v[8];
    FS_GGML_UNROLL for (int j = 0; j < 8; ++j) {
      if (kFull || 2 * j + 1 < r)
        v[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], _mm512_loadu_si512(aq + 64 * j));
      else if (2 * j < r)  // one block left: its 32 bytes only (never past the row)
        v[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j],
                                   _mm512_maskz_loadu_epi8(0xFFFFFFFFull, aq + 64 * j));
      else
        v[j] = _mm512_setzero_si512();
    }
    lanes_finish<B>(block_sums16(v), g, dv, live, a, m0 + i, k, acc[i]);
  }
}

// The weight pairs wv[j] (block 2j in dwords 0-7, 2j + 1 in 8-15) transposed in place: wv[c]
// dword b = dword c of block b (3 stages of two-source permutes, transpose_idx).
[[gnu::always_inline]] inline void transpose_pairs(__m512i* wv, const int32_t* idx) {
  FS_GGML_UNROLL for (int s = 0; s < 3; ++s)
    FS_GGML_UNROLL for (int v = 0; v < 8; ++v) {
      if (v & (1 << s)) continue;
      const int w = v | (1 << s);
      const __m512i lo = _mm512_permutex2var_epi32(
          wv[v], _mm512_loadu_si512(idx + (8 * s + v) * 16), wv[w]);
      wv[w] = _mm512_permutex2var_epi32(wv[v], _mm512_loadu_si512(idx + (8 * s + w) * 16), wv[w]);
      wv[v] = lo;
    }
}

// One 512-column step of a weight row decoded for the M > 1 tiles (x quantized lanes_t): the
// weight bytes transposed (wv[c] dword b = dword c of block b: transpose_pairs), the 16 block
// heads (IQ4_XS: its 16 sub-block scales ls) and the blocks' fp32 scales. 640 bytes.
struct LanesStep {
  __m512i wv[8];
  __m512i g;
  __m512 dv;
};

template <class B>
[[gnu::always_inline]] inline void lanes_decode_t(const uint8_t* b, const int32_t* idx,
                                                  LanesStep& s) {
  FS_GGML_UNROLL for (int j = 0; j < 8; ++j) s.wv[j] = B::pair(b + 2 * j * B::kBytes, true);
  transpose_pairs(s.wv, idx);
  s.g = lane_heads<B>(b, 16 * B::kBytes);
  s.dv = B::lane_scales(s.g);
}

// A decoded step's 16 integer block dots with one row of x (its 512 columns at aq, lanes_t):
// 8 VPDPBUSD straight into block lanes, in two chains.
[[gnu::always_inline]] inline __m512i lanes_dot_t(const LanesStep& s, const int8_t* aq) {
  __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), s.wv[0], _mm512_loadu_si512(aq));
  __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), s.wv[1], _mm512_loadu_si512(aq + 64));
  FS_GGML_UNROLL for (int c = 2; c < 8; c += 2) {
    d0 = _mm512_dpbusd_epi32(d0, s.wv[c], _mm512_loadu_si512(aq + 64 * c));
    d1 = _mm512_dpbusd_epi32(d1, s.wv[c + 1], _mm512_loadu_si512(aq + 64 * (c + 1)));
  }
  return _mm512_add_epi32(d0, d1);
}

template <class B, int MT>
[[gnu::always_inline]] inline void lanes_rows_t(const LanesStep& s, int64_t k, const Act& a,
                                                int64_t m0, __m512* acc) {
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i)
    lanes_finish<B>(lanes_dot_t(s, a.qrow(m0 + i) + 32 * k), s.g, s.dv, 0xFFFF, a, m0 + i, k,
                    acc[i]);
}

// A whole step (16 blocks) against MT rows of x quantized lanes_t (Act): the weights decoded
// and transposed once for the tile, then per row 8 VPDPBUSD straight into block lanes (no
// per-row block_sums16: its 15 shuffles per row were the M > 1 tiles' cost). The integer dot
// of each block is the same number, so the row's bits are those of lanes_step (the row alone).
template <class B, int MT>
[[gnu::always_inline]] inline void lanes_step_t(const uint8_t* b, int64_t k, const Act& a,
                                                int64_t m0, __m512* acc, const int32_t* idx) {
  LanesStep s;
  lanes_decode_t<B>(b, idx, s);
  lanes_rows_t<B, MT>(s, k, a, m0, acc);
}

// A weight row's whole 512-column steps decoded into out[0 .. nb / 16) (lanes_panel_range).
template <class B>
void lanes_decode_row(const uint8_t* w, int64_t nb, LanesStep* out) {
  const int32_t* idx = transpose_idx();
  for (int64_t k = 0; k + 16 <= nb; k += 16) lanes_decode_t<B>(w + k * B::kBytes, idx, out[k / 16]);
}

// One weight row (nb blocks) against rows m0 .. m0 + MT - 1 of x; with pf > 0 each step also
// requests the bytes pf ahead of the ones it reads (ggml_blocks_run.h's rows_streamed). With
// x lanes_t, the whole steps are decoded and transposed here (lanes_step_t).
template <class B, int MT>
void lanes_row(const uint8_t* w, int64_t nb, const Act& a, int64_t m0, float* res,
               int64_t pf = 0) {
  __m512 acc[MT];
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  if (lanes_tiles<B>::value && a.lanes_t) {
    const int32_t* idx = transpose_idx();
    for (; k + 16 <= nb; k += 16) lanes_step_t<B, MT>(w + k * B::kBytes, k, a, m0, acc, idx);
  }
  for (; k + 16 <= nb; k += 16) {
    if (pf > 0) prefetch_span(w + k * B::kBytes + pf, 16 * B::kBytes);
    lanes_step<B, MT, true>(w + k * B::kBytes, k, 16, a, m0, acc);
  }
  if (k < nb)
    lanes_step<B, MT, false>(w + k * B::kBytes, k, static_cast<int>(nb - k), a, m0, acc);
  FS_GGML_UNROLL for (int i = 0; i < MT; ++i) res[i] = _mm512_reduce_add_ps(acc[i]);
}

// Whether B's rows are lanes_row's (B::pair: the 32-column block types above): their one-row
// GEMV runs several weight rows per tile (lanes_rows_m1).
template <class B, class = void>
struct lanes_m1 : std::false_type {};
template <class B>
struct lanes_m1<B, std::void_t<decltype(&B::pair)>> : std::true_type {};

// NW weight rows w[0 .. NW) against row m of x (quantized in the natural layout, as the one-row
// GEMV and the MoE experts quantize it), their steps interleaved: each row's ops are
// lanes_row<B, 1>'s (the same bits), x's step loaded once for the NW, and each step requests
// the bytes pf ahead of its reads.
// NOTE: one row at a time, a step's reduction (block_sums16) is a chain the core waits on; four
// rows give it four independent chains and four streams advancing together (as the K-quants'
// kq_tile). One thread's rows then stream at 22-26 GB/s of weight bytes at 2 threads on the Xeon
// instead of 15-22 (bench_ggml_blocks --vs-read: 2048x8192 Q5_1 1.4-1.6x, 2048x2048 1.2-1.4x).
constexpr int64_t kLanesAhead = 2048;  // bytes requested ahead of each row's reads

template <class B, int NW>
void lanes_rows_m1(const uint8_t* const* w, int64_t nb, const Act& a, int64_t m, float* res,
                   int64_t pf) {
  if (a.lanes_t) {  // x laid out for lanes_step_t (dense M > 1 calls): lanes_row reads it
    for (int j = 0; j < NW; ++j) lanes_row<B, 1>(w[j], nb, a, m, res + j, pf);
    return;
  }
  __m512 acc[NW];
  FS_GGML_UNROLL for (int j = 0; j < NW; ++j) acc[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= nb; k += 16)
    FS_GGML_UNROLL for (int j = 0; j < NW; ++j) {
      prefetch_span(w[j] + k * B::kBytes + pf, 16 * B::kBytes);
      lanes_step<B, 1, true>(w[j] + k * B::kBytes, k, 16, a, m, &acc[j]);
    }
  if (k < nb)
    FS_GGML_UNROLL for (int j = 0; j < NW; ++j)
      lanes_step<B, 1, false>(w[j] + k * B::kBytes, k, static_cast<int>(nb - k), a, m, &acc[j]);
  FS_GGML_UNROLL for (int j = 0; j < NW; ++j) res[j] = _mm512_reduce_add_ps(acc[j]);
}

// The 32 nibbles of 16 code bytes at each of p0, p1 in column order (low nibbles 0-15, high
// 16-31), as one zmm: block p0 in bytes 0-31, p1 in 32-63 (p1 zero unless `two`).
// NOTE: 128-bit lanes [p0, p0, p1, p1] by two broadcast loads (load ports), then the high
// nibbles of lanes 1 and 3 by one masked shift: 3 ALU ops, the insert / shift / lane shuffle /
// and of [q0, q1, q0 >> 4, q1 >> 4] before cost 5 and a second shuffle port op
[[gnu::always_inline]] inline __m512i nibbles_pair(const uint8_t* p0, const uint8_t* p1,
                                                   bool two) {
  const __m512i q0 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0)));
  const __m512i q = two ? _mm512_mask_broadcast_i32x4(
                              q0, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)))
                        : _mm512_maskz_mov_epi32(0x00FF, q0);
  return _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFF00FF00u, q, 4), _mm512_set1_epi8(0x0F));
}

#endif  // FS_GGML_VNNI
}  // namespace fitserve::ggml
