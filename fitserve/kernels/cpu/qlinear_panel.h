// Integer path for many rows of x: "lane = output row" panels. Every M gives row m the same
// result: each output is one lane, and its float sequence is the same whatever tile it is in.
// For G = 32 that sequence is the canonical order of qlinear_rows.h (the few-row kernel); for
// other groups the panels run every M (qlinear_run.h).
//
// kLanes weight rows are transposed once per call into a thread-local panel, dword by dword:
//
//   panel.wq[d][l] = bytes 4d .. 4d+3 of weight row n0 + l        (d over the row's dwords)
//
// so one vector holds the same 4 bytes of kLanes rows. Against x in natural column order, the
// activation operand is 4 int8 values broadcast to every lane, each int32 lane accumulates a
// whole 32-column block of ONE output (no horizontal sums), and one fp32 multiply per block
// scales kLanes outputs: per block and row of x that is 8 (int8) or 8 (int4: low + high
// nibbles of 4 dwords) dot instructions + 3 fp32 ops for kLanes * 32 multiply-adds, against
// 5 ops per 64 weights in the row-major tiles. Packing costs one pass over the panel per call,
// so this path is taken for M >= kPanelMinRows.
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

// One panel of kLanes weight rows, transposed; rows past N are zero (never stored).
struct Panel {
  std::vector<uint32_t> wq;  // [row_bytes / 4][kLanes]
  std::vector<float> dv;     // [ngroups (padded to kLanes)][kLanes] scales
  std::vector<float> cv;     // [same][kLanes] int4 offsets (min, or -8 * scale)

  std::vector<uint8_t> zeros;  // stands in for the rows past N
  std::vector<float> rows_f;   // scales (and offsets) row by row, before the transpose

  void pack(const QWeight& w, bool int4, int64_t n0) {
    constexpr int L = S::kLanes;
    const int64_t nd = w.row_bytes / 4;
    wq.resize(nd * L);
    if (static_cast<int64_t>(zeros.size()) < w.row_bytes) zeros.assign(w.row_bytes, 0);
    const uint8_t* rows[L];
    for (int l = 0; l < L; ++l)
      rows[l] = n0 + l < w.N ? w.q + (n0 + l) * w.row_bytes : zeros.data();
    int64_t d = 0;
    for (; d + L <= nd; d += L) S::transpose_dwords(rows, 4 * d, wq.data() + d * L);
    for (; d < nd; ++d)
      for (int l = 0; l < L; ++l) std::memcpy(&wq[d * L + l], rows[l] + 4 * d, 4);
    // NOTE: VNNI int8 panels hold w + 128 (unsigned) so activations can be the broadcast operand
    if (!int4 && S::kW8Biased)
      for (auto& v : wq) v ^= 0x80808080u;
    // scales: each row's fp16 values to fp32 in a [L][gpad] buffer, then the same transpose
    const int64_t gpad = (w.ngroups + L - 1) / L * L;
    dv.resize(gpad * L);
    if (int4) cv.resize(gpad * L);
    rows_f.assign(gpad * L * (int4 ? 2 : 1), 0.f);
    for (int l = 0; l < L && n0 + l < w.N; ++l) {
      const at::Half* sc = w.scales + (n0 + l) * w.ngroups;
      const at::Half* mn = w.mins ? w.mins + (n0 + l) * w.ngroups : nullptr;
      float* rd = rows_f.data() + l * gpad;
      float* rc = rd + L * gpad;
      for (int64_t g = 0; g < w.ngroups; g += L) {
        const int n = static_cast<int>(std::min<int64_t>(L, w.ngroups - g));
        const S::F d = S::load_half(sc + g, n);
        S::storef(rd + g, d, n);
        if (int4) S::storef(rc + g, mn ? S::load_half(mn + g, n) : S::mul(d, S::set1(-8.f)), n);
      }
    }
    for (int half = 0; half < (int4 ? 2 : 1); ++half) {
      const uint8_t* rp[L];
      for (int l = 0; l < L; ++l)
        rp[l] = reinterpret_cast<const uint8_t*>(rows_f.data() + (half * L + l) * gpad);
      auto* dst = reinterpret_cast<uint32_t*>(half ? cv.data() : dv.data());
      for (int64_t g = 0; g < gpad; g += L) S::transpose_dwords(rp, 4 * g, dst + g * L);
    }
  }
};

// out[m][n0 + l] for the lanes l < N - n0 (out is fp32 [M, ldo]).
inline void store_lanes(S::F v, float* out_row, int64_t n_valid) {
  S::storef(out_row, v, static_cast<int>(std::min<int64_t>(n_valid, S::kLanes)));
}

// int4 panel x MT rows of x. kSeg: bytes per int32 flush (16: G == 32, lo / hi in one block;
// 32: G % 64 == 0; 16 with two blocks otherwise). kOneBlock: lo and hi share the block.
template <int MT, int kSeg, bool kOneBlock>
void int4_panel_tile(const QWeight& w, const Panel& p, const NatAct& x, int64_t n0, int64_t m0,
                     float* out, int64_t ldo) {
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
    const S::F dv = S::loadf(p.dv.data() + g * L);
    for (int64_t s = 0; s < half; s += kSeg) {  // bytes g*half + s ..: no divisions in the loop
      const int64_t b0 = g * half + s, lo = g * w.group + s, hi = lo + half;
      S::I il[MT], ih[MT];
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) il[m] = ih[m] = S::izero();
      _Pragma("GCC unroll 8") for (int d = 0; d < kSeg / 4; ++d) {
        const S::B wv = S::loadb(p.wq.data() + (b0 / 4 + d) * L);
        const S::B ql = S::nib_lo(wv), qh = S::nib_hi(wv);
        _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
          il[m] = S::dot_u4(il[m], ql, S::bcast4(a[m] + lo + 4 * d));
          if constexpr (kOneBlock) il[m] = S::dot_u4(il[m], qh, S::bcast4(a[m] + hi + 4 * d));
          else ih[m] = S::dot_u4(ih[m], qh, S::bcast4(a[m] + hi + 4 * d));
        }
      }
      if constexpr (kOneBlock) {  // G = 32: the canonical order of qlinear_rows.h
        const S::F cv = S::loadf(p.cv.data() + g * L);
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
    const S::F cv = S::loadf(p.cv.data() + g * L);
    _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
      acc[m] = S::fmadd(cv, S::set1(x.sg[(m0 + m) * w.ngroups + g]), acc[m]);
  }
  for (int m = 0; m < MT; ++m) store_lanes(acc[m], out + (m0 + m) * ldo + n0, w.N - n0);
}

// int8 panel x MT rows of x, one 32-column block (8 dwords) per int32 flush.
template <int MT>
void int8_panel_tile(const QWeight& w, const Panel& p, const NatAct& x, int64_t n0, int64_t m0,
                     float* out, int64_t ldo) {
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
      const S::B wv = S::loadb(p.wq.data() + (blk * 8 + d) * L);
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
        ia[m] = S::dot_w8p(ia[m], wv, S::bcast4(a[m] + blk * kActBlock + 4 * d));
    }
    // NOTE: G = 32 (Q8_0) and per channel need no division per block
    const int64_t g = per_group == 1 ? blk : w.ngroups == 1 ? 0 : blk / per_group;
    const S::F dv = S::loadf(p.dv.data() + g * L);
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
