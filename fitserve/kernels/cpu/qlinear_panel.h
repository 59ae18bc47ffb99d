// Integer path for many rows of x: "lane = output row" panels. Every M gives row m the same
// result: each output is one lane, and its float sequence is the same whatever tile it is in.
// For G = 32 that sequence is the canonical order of qlinear_rows.h (the few-row kernel); for
// other groups the panels run every M (qlinear_run.h).
//
// kLanes weight rows are transposed, dword by dword (PanelView):
//
//   wq[d][l] = bytes 4d .. 4d+3 of weight row n0 + l        (d over the row's dwords)
//
// once at load into the weight's prepacked panels (qlinear_prepack.h), or, for a weight that was
// not prepacked, once per call into a thread-local panel.
//
// so one vector holds the same 4 bytes of kLanes rows. Against x in natural column order, the
// activation operand is 4 int8 values broadcast to every lane, each int32 lane accumulates a
// whole 32-column block of ONE output (no horizontal sums), and one fp32 multiply per block
// scales kLanes outputs: per block and row of x that is 8 (int8) or 8 (int4: low + high
// nibbles of 4 dwords) dot instructions + 3 fp32 ops for kLanes * 32 multiply-adds, against
// 5 ops per 64 weights in the row-major tiles. This path is taken for M >= kPanelMinRows.
//
//   int4: dword d of a row sits in group g = 4d / (G/2); its low nibbles are the 4 consecutive
//         columns lo = g*G + 4d % (G/2), its high nibbles hi = lo + G/2 (qlinear_tiles.h).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <vector>

#include "qlinear_tiles.h"

namespace fitserve::qlinear {

// Activations in natural column order (quantize_row), per row of x.
struct NatAct {
  const int8_t* aq;     // [M, kp]      (VNNI int8 path: stored as is, weights carry the bias)
  const float* da;      // [M, kp / 32]
  const int32_t* isum;  // [M, kp / 32]
  const float* sg;      // [M, ngroups] int4 offsets' S_g, or nullptr
  int64_t kp, nblk;
};

// One panel of kLanes weight rows as the tiles read it (lanes = output rows):
//
//   wq[d * kLanes + l] = dword d of weight row n0 + l   (VNNI int8: every byte ^ 0x80)
//   dv[g * kLanes + l] = fp32 scale of group g of row n0 + l
//   cv[g * kLanes + l] = its fp32 int4 offset (the min, or -8 * scale); int8: none
//
// It either points into a weight's prepacked panels (qlinear_prepack.h, made once at load) or
// into a thread-local Panel packed on this call (weights that were not prepacked, and the last
// N % kLanes rows). NOTE: the scales are widened to fp32 here, not read as f16 in the tiles: the
// conversion per group and tile measured 5-15% of the M >= 512 calls.
struct PanelView {
  const uint32_t* wq;
  const float* dv;
  const float* cv;
};

// Bytes of one weight row in a panel: its codes, and 4 (int8) or 8 (int4) per group.
inline int64_t panel_row_bytes(const QWeight& w, bool int4) {
  return w.row_bytes + w.ngroups * 4 * (int4 ? 2 : 1);
}

// Transposes kLanes rows (rows past N: zero) of w into the PanelView layout at wq / dv / cv.
inline void pack_panel(const QWeight& w, bool int4, int64_t n0, const uint8_t* zeros,
                       uint32_t* wq, float* dv, float* cv) {
  constexpr int L = S::kLanes;
  const int64_t nd = w.row_bytes / 4;
  const uint8_t* rows[L];
  for (int l = 0; l < L; ++l)
    rows[l] = n0 + l < w.N ? w.q + (n0 + l) * w.row_bytes : zeros;
  int64_t d = 0;
  for (; d + L <= nd; d += L) S::transpose_dwords(rows, 4 * d, wq + d * L);
  for (; d < nd; ++d)
    for (int l = 0; l < L; ++l) std::memcpy(&wq[d * L + l], rows[l] + 4 * d, 4);
  // NOTE: VNNI int8 panels hold w + 128 (unsigned) so activations can be the broadcast operand
  if (!int4 && S::kW8Biased)
    for (int64_t i = 0; i < nd * L; ++i) wq[i] ^= 0x80808080u;
  for (int l = 0; l < L; ++l) {
    const bool in = n0 + l < w.N;
    for (int64_t g = 0; g < w.ngroups; ++g) {
      const float d_g = in ? S::h2f(w.scales[(n0 + l) * w.ngroups + g]) : 0.f;
      dv[g * L + l] = d_g;
      if (int4) cv[g * L + l] = !in ? 0.f : w.mins ? S::h2f(w.mins[(n0 + l) * w.ngroups + g])
                                                   : d_g * -8.f;  // exact (a power of 2)
    }
  }
}

// A panel packed on this call (per worker thread).
struct Panel {
  std::vector<uint32_t> wq;
  std::vector<float> dv, cv;
  std::vector<uint8_t> zeros;  // stands in for the rows past N

  PanelView pack(const QWeight& w, bool int4, int64_t n0) {
    constexpr int L = S::kLanes;
    wq.resize(w.row_bytes / 4 * L);
    dv.resize(w.ngroups * L);
    if (int4) cv.resize(w.ngroups * L);
    if (static_cast<int64_t>(zeros.size()) < w.row_bytes) zeros.assign(w.row_bytes, 0);
    pack_panel(w, int4, n0, zeros.data(), wq.data(), dv.data(), int4 ? cv.data() : nullptr);
    return {wq.data(), dv.data(), int4 ? cv.data() : nullptr};
  }
};

// out[m][n0 + l] for the lanes l < N - n0 (out is fp32 [M, ldo]).
inline void store_lanes(S::F v, float* out_row, int64_t n_valid) {
  S::storef(out_row, v, static_cast<int>(std::min<int64_t>(n_valid, S::kLanes)));
}

// The same, rounded to bfloat16 as c10::BFloat16(float) does (nearest even, NaN -> 0x7FC0):
// a bf16 call writes its result here directly, with no fp32 [M, N] buffer and rounding pass.
inline void store_lanes(S::F v, c10::BFloat16* out_row, int64_t n_valid) {
  const int n = static_cast<int>(std::min<int64_t>(n_valid, S::kLanes));
#if defined(FITSERVE_TIER_AVX512_VNNI) || defined(FITSERVE_TIER_AVX512)
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(out_row, S::hmask(n), _mm512_cvtepi32_epi16(r));
#else
  float t[S::kLanes];
  S::storef(t, v);
  for (int l = 0; l < n; ++l) out_row[l] = c10::BFloat16(t[l]);
#endif
}

// int4 panel x MT rows of x. kSeg: bytes per int32 flush (16: G == 32, lo / hi in one block;
// 32: G % 64 == 0; 16 with two blocks otherwise). kOneBlock: lo and hi share the block.
template <int MT, int kSeg, bool kOneBlock, class O>
void int4_panel_tile(const QWeight& w, const PanelView& p, const NatAct& x, int64_t n0, int64_t m0,
                     O* out, int64_t ldo) {
  constexpr int L = S::kLanes;
  const int64_t half = w.group / 2;
  const int8_t* a[MT];
  const float* da[MT];
  S::F acc[MT];
  _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
    a[m] = x.aq + (m0 + m) * x.kp;
    da[m] = x.da + (m0 + m) * x.nblk;
    acc[m] = S::fzero();
  }
  for (int64_t g = 0; g < w.ngroups; ++g) {
    const S::F dv = S::loadf(p.dv + g * L);
    for (int64_t s = 0; s < half; s += kSeg) {  // bytes g*half + s ..: no divisions in the loop
      const int64_t b0 = g * half + s, lo = g * w.group + s, hi = lo + half;
      S::I il[MT], ih[MT];
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) il[m] = ih[m] = S::izero();
      _Pragma("GCC unroll 8") for (int d = 0; d < kSeg / 4; ++d) {
        const S::B wv = S::loadb(p.wq + (b0 / 4 + d) * L);
        const S::B ql = S::nib_lo(wv), qh = S::nib_hi(wv);
        _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
          il[m] = S::dot_u4(il[m], ql, S::bcast4(a[m] + lo + 4 * d));
          if constexpr (kOneBlock) il[m] = S::dot_u4(il[m], qh, S::bcast4(a[m] + hi + 4 * d));
          else ih[m] = S::dot_u4(ih[m], qh, S::bcast4(a[m] + hi + 4 * d));
        }
      }
      if constexpr (kOneBlock) {  // G = 32: the canonical order of qlinear_rows.h
        const S::F cv = S::loadf(p.cv + g * L);
        _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
          const S::F t = S::mulr(S::cvt(il[m]), S::mulr(dv, S::set1(da[m][g])));
          const S::F off = S::mulr(cv, S::set1(x.sg[(m0 + m) * w.ngroups + g]));
          acc[m] = S::add(acc[m], S::add(t, off));
        }
      } else {
        _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
          acc[m] = S::fmadd(S::cvt(il[m]), S::mul(dv, S::set1(da[m][lo / kActBlock])), acc[m]);
          acc[m] = S::fmadd(S::cvt(ih[m]), S::mul(dv, S::set1(da[m][hi / kActBlock])), acc[m]);
        }
      }
    }
  }
  for (int64_t g = 0; g < w.ngroups && !kOneBlock; ++g) {
    const S::F cv = S::loadf(p.cv + g * L);
    _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
      acc[m] = S::fmadd(cv, S::set1(x.sg[(m0 + m) * w.ngroups + g]), acc[m]);
  }
  for (int m = 0; m < MT; ++m) store_lanes(acc[m], out + (m0 + m) * ldo + n0, w.N - n0);
}

// int8 panel x MT rows of x, one 32-column block (8 dwords) per int32 flush.
template <int MT, class O>
void int8_panel_tile(const QWeight& w, const PanelView& p, const NatAct& x, int64_t n0, int64_t m0,
                     O* out, int64_t ldo) {
  constexpr int L = S::kLanes;
  const int8_t* a[MT];
  const float* da[MT];
  const int32_t* is[MT];
  S::F acc[MT];
  _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
    a[m] = x.aq + (m0 + m) * x.kp;
    da[m] = x.da + (m0 + m) * x.nblk;
    is[m] = x.isum + (m0 + m) * x.nblk;
    acc[m] = S::fzero();
  }
  const int64_t per_group = w.group / kActBlock;
  for (int64_t blk = 0; blk < x.nblk; ++blk) {
    S::I ia[MT];
    _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
      ia[m] = S::kW8Biased ? S::iset1(-128 * is[m][blk]) : S::izero();
    _Pragma("GCC unroll 8") for (int d = 0; d < 8; ++d) {
      const S::B wv = S::loadb(p.wq + (blk * 8 + d) * L);
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
        ia[m] = S::dot_w8p(ia[m], wv, S::bcast4(a[m] + blk * kActBlock + 4 * d));
    }
    // NOTE: G = 32 (Q8_0) and per channel need no division per block
    const int64_t g = per_group == 1 ? blk : w.ngroups == 1 ? 0 : blk / per_group;
    const S::F dv = S::loadf(p.dv + g * L);
    if (per_group == 1) {  // G = 32: the canonical order of qlinear_rows.h
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
        acc[m] = S::add(acc[m], S::mulr(S::cvt(ia[m]), S::mulr(dv, S::set1(da[m][blk]))));
    } else {
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
        acc[m] = S::fmadd(S::cvt(ia[m]), S::mul(dv, S::set1(da[m][blk])), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) store_lanes(acc[m], out + (m0 + m) * ldo + n0, w.N - n0);
}

// Two panels (2 * kLanes weight rows from n0) x MT rows of x for group 32 (the default model's
// int4 and Q8_0's int8), one register tile: per dword, MT broadcasts of x pinned in registers
// feed both panels' dots. NOTE: the one-panel tiles fold each broadcast into its dot as a
// memory operand, one load per dot (Zen 4 loads one zmm per cycle); as in the ggml K-quant
// panels (ggml_blocks_kqpanel.h) two panels per tile halve that. Each lane's integer sums are
// the same numbers and its fp32 ops those of the one-panel tiles' G = 32 branches (the
// canonical order of qlinear_rows.h): the same bits.
constexpr bool kTwoPanels = S::kLanes == 16;  // AVX-512's 32 registers hold the tile
constexpr int kTwoPanelMT = 4;

template <class B>
[[gnu::always_inline]] inline B pinned(B v) {
  asm("" : "+v"(v));
  return v;
}

template <int MT, class O>
[[gnu::noinline]] void int4_panel_tile2(const QWeight& w, const PanelView* pv, const NatAct& x,
                                        int64_t n0, int64_t m0, O* out, int64_t ldo) {
  constexpr int L = S::kLanes;
  const int8_t* a[MT];
  const float* da[MT];
  const float* sg[MT];
  S::F acc[2][MT];
  _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
    a[m] = x.aq + (m0 + m) * x.kp;
    da[m] = x.da + (m0 + m) * x.nblk;
    sg[m] = x.sg + (m0 + m) * w.ngroups;
    acc[0][m] = acc[1][m] = S::fzero();
  }
  for (int64_t g = 0; g < w.ngroups; ++g) {
    const int64_t lo = g * w.group, hi = lo + 16;
    S::I il[2][MT];
    _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) il[0][m] = il[1][m] = S::izero();
    _Pragma("GCC unroll 4") for (int d = 0; d < 4; ++d) {
      S::B ql[2], qh[2];
      _Pragma("GCC unroll 2") for (int q = 0; q < 2; ++q) {
        const S::B wv = S::loadb(pv[q].wq + (4 * g + d) * L);
        ql[q] = S::nib_lo(wv);
        qh[q] = S::nib_hi(wv);
      }
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
        const S::B xl = pinned(S::bcast4(a[m] + lo + 4 * d));
        const S::B xh = pinned(S::bcast4(a[m] + hi + 4 * d));
        _Pragma("GCC unroll 2") for (int q = 0; q < 2; ++q)
          il[q][m] = S::dot_u4(S::dot_u4(il[q][m], ql[q], xl), qh[q], xh);
      }
    }
    _Pragma("GCC unroll 2") for (int q = 0; q < 2; ++q) {
      const S::F dv = S::loadf(pv[q].dv + g * L), cv = S::loadf(pv[q].cv + g * L);
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
        const S::F t = S::mulr(S::cvt(il[q][m]), S::mulr(dv, S::set1(da[m][g])));
        const S::F off = S::mulr(cv, S::set1(sg[m][g]));
        acc[q][m] = S::add(acc[q][m], S::add(t, off));
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int q = 0; q < 2; ++q)
      store_lanes(acc[q][m], out + (m0 + m) * ldo + n0 + q * L, w.N - n0 - q * L);
}

template <int MT, class O>
[[gnu::noinline]] void int8_panel_tile2(const QWeight& w, const PanelView* pv, const NatAct& x,
                                        int64_t n0, int64_t m0, O* out, int64_t ldo) {
  constexpr int L = S::kLanes;
  const int8_t* a[MT];
  const float* da[MT];
  const int32_t* is[MT];
  S::F acc[2][MT];
  _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
    a[m] = x.aq + (m0 + m) * x.kp;
    da[m] = x.da + (m0 + m) * x.nblk;
    is[m] = x.isum + (m0 + m) * x.nblk;
    acc[0][m] = acc[1][m] = S::fzero();
  }
  for (int64_t blk = 0; blk < x.nblk; ++blk) {
    S::I ia[2][MT];
    _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
      ia[0][m] = ia[1][m] = S::kW8Biased ? S::iset1(-128 * is[m][blk]) : S::izero();
    _Pragma("GCC unroll 8") for (int d = 0; d < 8; ++d) {
      S::B wv[2];
      _Pragma("GCC unroll 2") for (int q = 0; q < 2; ++q)
        wv[q] = S::loadb(pv[q].wq + (blk * 8 + d) * L);
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
        const S::B xb = pinned(S::bcast4(a[m] + blk * kActBlock + 4 * d));
        _Pragma("GCC unroll 2") for (int q = 0; q < 2; ++q)
          ia[q][m] = S::dot_w8p(ia[q][m], wv[q], xb);
      }
    }
    _Pragma("GCC unroll 2") for (int q = 0; q < 2; ++q) {
      const S::F dv = S::loadf(pv[q].dv + blk * L);
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
        acc[q][m] = S::add(acc[q][m], S::mulr(S::cvt(ia[q][m]), S::mulr(dv, S::set1(da[m][blk]))));
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int q = 0; q < 2; ++q)
      store_lanes(acc[q][m], out + (m0 + m) * ldo + n0 + q * L, w.N - n0 - q * L);
}

inline void dequant_row(const QWeight& w, bool int4, int64_t n, float* dst) {
  const uint8_t* q = w.q + n * w.row_bytes;
  const at::Half* sc = w.scales + n * w.ngroups;
  const at::Half* mn = w.mins ? w.mins + n * w.ngroups : nullptr;
  const int64_t half = w.group / 2;
  for (int64_t g = 0; g < w.ngroups; ++g) {
    const float dg = S::h2f(sc[g]);
    const S::F d = S::set1(dg);
    float* out = dst + g * w.group;
    if (int4) {  // fma(q, d, off) == d * q + off exactly: q * d needs <= 15 mantissa bits
      const S::F off = S::set1(mn ? S::h2f(mn[g]) : -8.f * dg);
      for (int64_t i = 0; i < half; i += S::kFloatBytes) {
        S::F lo, hi;
        S::nib_f(q + g * half + i, lo, hi);
        S::storef(out + i, S::fmadd(lo, d, off));
        S::storef(out + half + i, S::fmadd(hi, d, off));
      }
    } else {
      const int8_t* qb = reinterpret_cast<const int8_t*>(q) + g * w.group;
      for (int64_t i = 0; i < w.group; i += S::kFloatBytes)
        S::storef(out + i, S::mul(S::i8_f(qb + i), d));
    }
  }
}

}  // namespace fitserve::qlinear
