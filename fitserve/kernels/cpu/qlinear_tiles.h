// Register tiles of the quantized linear: NT weight rows x MT activation rows, over all of K.
//
// Integer path (act_quant=True). Activations were quantized once per call (qlinear_act.h) into
// the byte order of the packed weight, so a weight chunk needs only a mask / shift:
//
//   int4 row bytes  | chunk 0 (kBytes) | chunk 1 | ...       byte b holds columns lo(b), hi(b):
//   A (per x row)   | lo 0 | hi 0 | lo 1 | hi 1 | ...        g = b / (G/2), i = b % (G/2),
//   D (per x row)   | da of lo lanes 0 | da of hi lanes 0 |   lo = g*G + i, hi = lo + G/2
//
//   lane l of chunk c (bytes 4l..4l+3) sums 4 products of ONE weight group and ONE 32-column
//   activation block, so  y += d[group] * da[block] * dot_lane  is exact per lane; the int4
//   offset (Q4_1 min m, or -8*d for Q4_0) adds  c_g * S_g  with  S_g = sum_b da_b * sum(a_b).
//
// fp32 path (act_quant=False): kFloatBytes weight bytes per step are dequantized in registers,
// w = fma(q, d, c) (exact: q * d fits fp32's mantissa), and FMA'd with fp32 x.
#pragma once

#include <algorithm>

#include "qlinear_simd.h"

namespace fitserve::qlinear {

using S = Simd;

// Which weight groups each integer-path chunk touches (same for every row; built per call).
struct ChunkMap {
  const int32_t* g0;      // [nchunks] first group of the chunk
  const S::HMask* hm;     // [nchunks] which of the scales from g0 on the chunk needs (<= kLanes)
  const int32_t* idx;     // [nchunks][kLanes] lane -> its group - g0 (0 for lanes past the row)
  int64_t nchunks, nfull;  // chunks [0, nfull) are whole kBytes; the rest is the row's tail
};

struct QWeight {
  const uint8_t* q;         // int4: [N, Kp/2] nibbles; int8: [N, Kp] int8 (read as bytes)
  const at::Half* scales;   // [N, ngroups]
  const at::Half* mins;     // [N, ngroups], or nullptr (int4 symmetric, int8)
  int64_t N, row_bytes, ngroups, group;
};

struct QAct {
  const int8_t* a;   // per x row: a_stride bytes (int4: lo/hi halves per chunk)
  const float* d;    // per x row: d_stride lane scales
  const float* s;    // int4 only: per x row, ngroups of S_g
  int64_t a_stride, d_stride;
  // the batch-1 int8 GEMV where its weights are read unsigned (S::kGemvW8Unsigned): per chunk
  // lane, -128 * the sum of that lane's 4 activation bytes
  const int32_t* lane_bias = nullptr;
};

#define FS_UNROLL _Pragma("GCC unroll 16")

// The weight rows a tile reads; rows past N repeat row N-1 (computed, never stored).
template <int NT>
struct Rows {
  const uint8_t* q[NT];
  const at::Half* sc[NT];
  const at::Half* mn[NT];
  Rows(const QWeight& w, int64_t n0) {
    FS_UNROLL for (int n = 0; n < NT; ++n) {
      const int64_t r = std::min<int64_t>(n0 + n, w.N - 1);
      q[n] = w.q + r * w.row_bytes;
      sc[n] = w.scales + r * w.ngroups;
      mn[n] = w.mins ? w.mins + r * w.ngroups : nullptr;
    }
  }
};

// Software prefetch of the NT weight rows (and their scales) a tile AHEAD tiles on will read.
// NOTE: at M = 1 a decode step streams every weight from DRAM exactly once; each tile reads
// short rows (288 B for a 576-column int4 row) next to three other streams (scales, mins, x),
// and without the hint the cores wait on memory instead of computing on it.
template <int NT, int AHEAD = 2>
inline void prefetch_tile(const QWeight& w, int64_t n0) {
  const int64_t r0 = n0 + AHEAD * NT;
  if (r0 >= w.N) return;
  const int64_t rows = std::min<int64_t>(NT, w.N - r0);
  const uint8_t* q = w.q + r0 * w.row_bytes;  // rows are contiguous: one span
  for (int64_t b = 0; b < rows * w.row_bytes; b += 64) __builtin_prefetch(q + b, 0, 0);
  const char* sc = reinterpret_cast<const char*>(w.scales + r0 * w.ngroups);
  for (int64_t b = 0; b < rows * w.ngroups * 2; b += 64) __builtin_prefetch(sc + b, 0, 0);
  if (w.mins) {
    const char* mn = reinterpret_cast<const char*>(w.mins + r0 * w.ngroups);
    for (int64_t b = 0; b < rows * w.ngroups * 2; b += 64) __builtin_prefetch(mn + b, 0, 0);
  }
}

template <int NT, int MT>
struct Acc {
  S::F v[NT][MT];
  Acc() {
    FS_UNROLL for (int n = 0; n < NT; ++n)
      FS_UNROLL for (int m = 0; m < MT; ++m) v[n][m] = S::fzero();
  }
  // NOTE: all horizontal sums first (fully unrolled, so v stays in registers), then the stores
  [[gnu::always_inline]] inline void store(int64_t N, int64_t n0, int64_t m0, float* out,
                                           int64_t ldo) const {
    float s[NT][MT];
    FS_UNROLL for (int n = 0; n < NT; ++n)
      FS_UNROLL for (int m = 0; m < MT; ++m) s[n][m] = S::hsum(v[n][m]);
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < NT && n0 + n < N; ++n) out[(m0 + m) * ldo + n0 + n] = s[n][m];
  }
};

// int4 x int8 activations. kOneBlock: G == 32, so a lane's low and high nibbles fall in the same
// activation block and their integer dots can be summed before scaling.
template <int NT, int MT, bool kAsym, bool kOneBlock>
void int4_aq_tile(const QWeight& w, const QAct& x, const ChunkMap& cm, int64_t n0, int64_t m0,
                  float* out, int64_t ldo) {
  if constexpr (MT == 1) prefetch_tile<NT>(w, n0);
  const Rows<NT> r(w, n0);
  const int8_t* am[MT];
  const float* dm[MT];
  FS_UNROLL for (int m = 0; m < MT; ++m) {
    am[m] = x.a + (m0 + m) * x.a_stride;
    dm[m] = x.d + (m0 + m) * x.d_stride;
  }
  Acc<NT, MT> acc;
  // one chunk; `nb` < kBytes only for the row's tail (a masked load)
  auto chunk = [&](int64_t c, int nb) __attribute__((always_inline)) {
    const S::P perm = S::load_perm(cm.idx + c * S::kLanes);
    const S::HMask hm = cm.hm[c];
    const int32_t g0 = cm.g0[c];
    S::B lo[NT], hi[NT];
    S::F dv[NT];
    FS_UNROLL for (int n = 0; n < NT; ++n) {
      const S::B wb = S::load_bytes(r.q[n] + c * S::kBytes, nb);
      lo[n] = S::nib_lo(wb);
      hi[n] = S::nib_hi(wb);
      dv[n] = S::permute(S::load_half(r.sc[n] + g0, hm), perm);
    }
    FS_UNROLL for (int m = 0; m < MT; ++m) {
      const int8_t* a = am[m] + c * 2 * S::kBytes;
      const float* d = dm[m] + c * 2 * S::kLanes;
      const S::B alo = S::load_bytes(a, S::kBytes);
      const S::B ahi = S::load_bytes(a + S::kBytes, S::kBytes);
      const S::F dlo = S::loadf(d);
      if constexpr (kOneBlock) {
        FS_UNROLL for (int n = 0; n < NT; ++n) {
          const S::I t = S::dot_u4(S::dot_u4(S::izero(), lo[n], alo), hi[n], ahi);
          acc.v[n][m] = S::fmadd(S::cvt(t), S::mul(dv[n], dlo), acc.v[n][m]);
        }
      } else {
        const S::F dhi = S::loadf(d + S::kLanes);
        FS_UNROLL for (int n = 0; n < NT; ++n) {
          S::F t = S::mul(S::cvt(S::dot_u4(S::izero(), lo[n], alo)), dlo);
          t = S::fmadd(S::cvt(S::dot_u4(S::izero(), hi[n], ahi)), dhi, t);
          acc.v[n][m] = S::fmadd(t, dv[n], acc.v[n][m]);
        }
      }
    }
  };
  for (int64_t c = 0; c < cm.nfull; ++c) chunk(c, S::kBytes);
  if (cm.nfull < cm.nchunks) chunk(cm.nfull, static_cast<int>(w.row_bytes - cm.nfull * S::kBytes));
  // offsets: y += sum_g c_g * S_g, c_g = min (Q4_1) or -8 * scale (Q4_0)
  for (int64_t g = 0; g < w.ngroups; g += S::kLanes) {
    const int cnt = static_cast<int>(std::min<int64_t>(S::kLanes, w.ngroups - g));
    S::F sg[MT];
    FS_UNROLL for (int m = 0; m < MT; ++m) sg[m] = S::loadf(x.s + (m0 + m) * w.ngroups + g, cnt);
    FS_UNROLL for (int n = 0; n < NT; ++n) {
      const S::F cg = kAsym ? S::load_half(r.mn[n] + g, cnt)
                            : S::mul(S::load_half(r.sc[n] + g, cnt), S::set1(-8.f));
      FS_UNROLL for (int m = 0; m < MT; ++m) acc.v[n][m] = S::fmadd(cg, sg[m], acc.v[n][m]);
    }
  }
  acc.store(w.N, n0, m0, out, ldo);
}

// int8 weights x int8 activations (natural column order, one "half" per chunk).
template <int NT, int MT>
void int8_aq_tile(const QWeight& w, const QAct& x, const ChunkMap& cm, int64_t n0, int64_t m0,
                  float* out, int64_t ldo) {
  if constexpr (MT == 1) prefetch_tile<NT>(w, n0);
  const Rows<NT> r(w, n0);
  const int8_t* am[MT];
  const float* dm[MT];
  FS_UNROLL for (int m = 0; m < MT; ++m) {
    am[m] = x.a + (m0 + m) * x.a_stride;
    dm[m] = x.d + (m0 + m) * x.d_stride;
  }
  Acc<NT, MT> acc;
  auto chunk = [&](int64_t c, int nb) __attribute__((always_inline)) {
    const S::P perm = S::load_perm(cm.idx + c * S::kLanes);
    const S::HMask hm = cm.hm[c];
    const int32_t g0 = cm.g0[c];
    S::W8 wq[NT];
    S::F dv[NT];
    FS_UNROLL for (int n = 0; n < NT; ++n) {
      wq[n] = S::prep_w8(S::load_bytes(r.q[n] + c * S::kBytes, nb));
      dv[n] = S::permute(S::load_half(r.sc[n] + g0, hm), perm);
    }
    FS_UNROLL for (int m = 0; m < MT; ++m) {
      const S::B a = S::load_bytes(am[m] + c * S::kBytes, S::kBytes);
      const S::F da = S::loadf(dm[m] + c * S::kLanes);
      FS_UNROLL for (int n = 0; n < NT; ++n)
        acc.v[n][m] = S::fmadd(S::cvt(S::dot_w8(wq[n], a)), S::mul(dv[n], da), acc.v[n][m]);
    }
  };
  for (int64_t c = 0; c < cm.nfull; ++c) chunk(c, S::kBytes);
  if (cm.nfull < cm.nchunks) chunk(cm.nfull, static_cast<int>(w.row_bytes - cm.nfull * S::kBytes));
  acc.store(w.N, n0, m0, out, ldo);
}

// int4 dequantized in registers x fp32 activations x [M, Kp] (row stride ldx).
template <int NT, int MT, bool kAsym>
void int4_f32_tile(const QWeight& w, const float* x, int64_t ldx, int64_t n0, int64_t m0,
                   float* out, int64_t ldo) {
  const Rows<NT> r(w, n0);
  const int64_t half = w.group / 2;
  Acc<NT, MT> acc;
  for (int64_t g = 0; g < w.ngroups; ++g) {
    S::F d[NT], off[NT];
    FS_UNROLL for (int n = 0; n < NT; ++n) {
      const float dn = S::h2f(r.sc[n][g]);
      d[n] = S::set1(dn);
      off[n] = S::set1(kAsym ? S::h2f(r.mn[n][g]) : -8.f * dn);
    }
    for (int64_t i = 0; i < half; i += S::kFloatBytes) {
      const int64_t b = g * half + i, col = g * w.group + i;
      S::F wl[NT], wh[NT];
      FS_UNROLL for (int n = 0; n < NT; ++n) {
        S::F ql, qh;
        S::nib_f(r.q[n] + b, ql, qh);
        wl[n] = S::fmadd(ql, d[n], off[n]);
        wh[n] = S::fmadd(qh, d[n], off[n]);
      }
      FS_UNROLL for (int m = 0; m < MT; ++m) {
        const float* xm = x + (m0 + m) * ldx + col;
        const S::F xl = S::loadf(xm), xh = S::loadf(xm + half);
        FS_UNROLL for (int n = 0; n < NT; ++n)
          acc.v[n][m] = S::fmadd(wh[n], xh, S::fmadd(wl[n], xl, acc.v[n][m]));
      }
    }
  }
  acc.store(w.N, n0, m0, out, ldo);
}

// int8 dequantized in registers x fp32 activations.
template <int NT, int MT>
void int8_f32_tile(const QWeight& w, const float* x, int64_t ldx, int64_t n0, int64_t m0,
                   float* out, int64_t ldo) {
  const Rows<NT> r(w, n0);
  Acc<NT, MT> acc;
  for (int64_t g = 0; g < w.ngroups; ++g) {
    S::F d[NT];
    FS_UNROLL for (int n = 0; n < NT; ++n) d[n] = S::set1(S::h2f(r.sc[n][g]));
    for (int64_t i = 0; i < w.group; i += S::kFloatBytes) {
      const int64_t col = g * w.group + i;
      S::F wv[NT];
      FS_UNROLL for (int n = 0; n < NT; ++n)
        wv[n] = S::mul(S::i8_f(reinterpret_cast<const int8_t*>(r.q[n]) + col), d[n]);
      FS_UNROLL for (int m = 0; m < MT; ++m) {
        const S::F xv = S::loadf(x + (m0 + m) * ldx + col);
        FS_UNROLL for (int n = 0; n < NT; ++n) acc.v[n][m] = S::fmadd(wv[n], xv, acc.v[n][m]);
      }
    }
  }
  acc.store(w.N, n0, m0, out, ldo);
}

#undef FS_UNROLL

}  // namespace fitserve::qlinear
