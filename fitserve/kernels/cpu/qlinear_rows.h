// The integer path for a few rows of x (M < kPanelMinRows: decode of one to a few sequences) on
// group-32 weights, in the ONE float order every integer kernel shares, so that row m of the
// result is bit-identical whatever M, the chunking and the kernel (this, or the panels of
// qlinear_panel.h for more rows):
//
//   I_g  = exact int32 dot of the 32-column block g (weight codes x int8 activations)
//   t_g  = fl(I_g * fl(d_g * da_g))                                   int8
//   t_g  = fl(fl(I_g * fl(d_g * da_g)) + fl(c_g * S_g))               int4 (c_g: min or -8 d_g)
//   y    = ((0 + t_0) + t_1) + ... + t_{G-1}                          one add per group, in order
//
// (separate multiplies and adds, no FMA (S::mulr keeps the compiler from fusing them): fl(I_g * s_g) is the same value whether it is formed
// with lanes = groups, here, or lanes = output rows, in the panels.)
//
// Here a weight row is read row-major (the batch-1 GEMV's byte order, qlinear_gemv.h): a span of
// kLanes groups is CPS chunks; each chunk's int32 lanes hold 4-byte partial dots, summed to one
// I_g per group with in-register shuffles (S::hsum128x4, S::pair128: exact integer adds), then
// t_g for the span's groups in one vector (lanes = groups). The t rows of kLanes weight rows are
// transposed (lanes = output rows) and added group by group: the panels' order.
//
//   T [row l][g]  --transpose_dwords-->  Tt [g][row l]  --acc += Tt[g], g = 0..G-1-->  y[n0 + l]
//
// NOTE: the price of exactness: the old GEMV kept kLanes float partial sums per row and one
// horizontal sum at the end (a different order from the panels'); this adds the int shuffles
// and the transpose per span. Measured in docs/benchmarks.md ('Batch invariance').
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "qlinear_gemv.h"

namespace fitserve::qlinear {

#ifdef FITSERVE_QLINEAR_GEMV

// t_g of weight row `row` against one x row (activations x, block scales dg) into t[0, G).
template <bool kInt4, bool kAsym>
inline void row_terms(const QWeight& w, const QAct& x, const float* dg, int64_t row, float* t) {
  constexpr int kGroupBytes = kInt4 ? 16 : 32;
  constexpr int GPC = S::kBytes / kGroupBytes, CPS = S::kLanes / GPC;
  static_assert(CPS == 4 || CPS == 8, "a span is 4 (int4) or 8 (int8) chunks");
  const int64_t G = w.ngroups;
  const uint8_t* q = w.q + row * w.row_bytes;
  const at::Half* sc = w.scales + row * G;
  const S::P nat = S::load_perm(kInt4 ? S::kNatU4 : S::kNatW8);
  for (int64_t g0 = 0; g0 < G; g0 += S::kLanes) {
    const int cnt = static_cast<int>(std::min<int64_t>(S::kLanes, G - g0));
    const int span_bytes = cnt * kGroupBytes;
    const int64_t c0 = g0 / GPC;
    S::I ti[CPS];
    unrolled<CPS>([&](auto j) {
      const int off = j * S::kBytes;
      if (off >= span_bytes) {
        ti[j] = S::izero();
        return;
      }
      const int nb = std::min(S::kBytes, span_bytes - off);
      const int64_t c = c0 + j;
      const S::B wb = S::load_bytes(q + c * S::kBytes, nb);
      if constexpr (kInt4) {
        const int8_t* a = x.a + c * 2 * S::kBytes;
        ti[j] = S::dot_u4x2(S::nib_lo(wb), S::load_bytes(a, S::kBytes), S::nib_hi(wb),
                            S::load_bytes(a + S::kBytes, S::kBytes));
      } else {
        const S::B a = S::load_bytes(x.a + c * S::kBytes, nb);
        ti[j] = S::gemv_dot_w8(wb, a, S::kGemvW8Unsigned
                                          ? S::load_bytes(x.lane_bias + c * S::kLanes, S::kBytes)
                                          : S::izero());
      }
    });
    S::I r;
    if constexpr (CPS == 4) r = S::hsum128x4(ti[0], ti[1], ti[2], ti[3]);
    else r = S::pair128(S::hsum128x4(ti[0], ti[1], ti[2], ti[3]),
                        S::hsum128x4(ti[4], ti[5], ti[6], ti[7]));
    const S::F s = S::mulr(S::load_half(sc + g0, cnt), S::loadf(dg + g0, cnt));
    S::F tv = S::mulr(S::permute(S::cvt(r), nat), s);
    if constexpr (kInt4) {
      const S::F cg = kAsym ? S::load_half(w.mins + row * G + g0, cnt)
                            : S::mul(S::load_half(sc + g0, cnt), S::set1(-8.f));
      tv = S::add(tv, S::mulr(cg, S::loadf(x.s + g0, cnt)));
    }
    S::storef(t + g0, tv);
  }
}

// One x row's activations for the canonical rows (laid out by rows_int in qlinear_run.h).
struct RowAct {
  QAct a;         // bytes in the weight's order, S_g (int4), lane bias (VNNI int8)
  const float* dg;  // [G] block scales
};

// y[m][n] for n in [n_begin, n_end) and all M rows, kLanes weight rows at a time.
template <bool kInt4, bool kAsym>
void canonical_rows(const QWeight& w, const RowAct* xs, int64_t M, int64_t n_begin,
                    int64_t n_end, float* out) {
  constexpr int L = S::kLanes;
  const int64_t G = w.ngroups, gpad = (G + L - 1) / L * L;
  static thread_local std::vector<float> t_buf, tt_buf;
  if (static_cast<int64_t>(t_buf.size()) < L * gpad) t_buf.assign(L * gpad, 0.f);
  if (static_cast<int64_t>(tt_buf.size()) < L * gpad) tt_buf.resize(L * gpad);
  float* T = t_buf.data();
  float* Tt = tt_buf.data();
  for (int64_t n0 = n_begin; n0 < n_end; n0 += L) {
    const int nr = static_cast<int>(std::min<int64_t>(L, n_end - n0));
    const uint8_t* rows[L];
    for (int l = 0; l < L; ++l)
      rows[l] = reinterpret_cast<const uint8_t*>(T + std::min(l, nr - 1) * gpad);
    for (int64_t m = 0; m < M; ++m) {
      for (int l = 0; l < nr; ++l) {
        if (m == 0 && l % kGemvRows == 0) prefetch_tile<kGemvRows>(w, n0 + l);
        row_terms<kInt4, kAsym>(w, xs[m].a, xs[m].dg, n0 + l, T + l * gpad);
      }
      for (int64_t g = 0; g < gpad; g += L)
        S::transpose_dwords(rows, 4 * g, reinterpret_cast<uint32_t*>(Tt + g * L));
      S::F acc = S::fzero();
      for (int64_t g = 0; g < G; ++g) acc = S::add(acc, S::loadf(Tt + g * L));
      S::storef(out + m * w.N + n0, acc, nr);
    }
  }
}

#endif

}  // namespace fitserve::qlinear
