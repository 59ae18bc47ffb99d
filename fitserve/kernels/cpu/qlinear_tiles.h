// Register tiles of the weight-only quantized linear: NT weight rows x MT rows of x, all of K.
//
// The shared vocabulary of the row-major kernels (QWeight, QAct, prefetch, Acc). The integer
// path's byte order, which the canonical rows (qlinear_rows.h) read:
//
//   int4 row bytes  | chunk 0 (kBytes) | chunk 1 | ...       byte b holds columns lo(b), hi(b):
//   A (per x row)   | lo 0 | hi 0 | lo 1 | hi 1 | ...        g = b / (G/2), i = b % (G/2),
//                                                            lo = g*G + i, hi = lo + G/2
//
// fp32 path (act_quant=False): kFloatBytes weight bytes per step are dequantized in registers,
// w = fma(q, d, c) (exact: q * d fits fp32's mantissa), and FMA'd with fp32 x.
#pragma once

#include <algorithm>

#include "qlinear_simd.h"

namespace fitserve::qlinear {

using S = Simd;

struct QWeight {
  const uint8_t* q;         // int4: [N, Kp/2] nibbles; int8: [N, Kp] int8 (read as bytes)
  const at::Half* scales;   // [N, ngroups]
  const at::Half* mins;     // [N, ngroups], or nullptr (int4 symmetric, int8)
  int64_t N, row_bytes, ngroups, group;
};

struct QAct {
  const int8_t* a;   // per x row: a_stride bytes (int4: lo/hi halves per chunk)
  const float* d;    // unused by the canonical rows (nullptr)
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
