// The weight HELD in the panel kernels' layout: made once at load, it replaces the row-major
// codes (one copy, the same bytes; N a multiple of kLanes), so no call transposes panels and
// the batch-1 GEMV streams each thread's panels as one sequential run:
//
//   codes  [P, nd * kLanes * 4] bytes   panel p, dword d of lane l at (d * kLanes + l) * 4
//                                       (PanelView.wq; VNNI int8: every byte ^ 0x80)
//   scales [P, G, kLanes] f16           scale of group g of row p * kLanes + l
//   mins   [P, G, kLanes] f16           its int4 offset (asymmetric int4 only)
//
// with P = N / kLanes panels and nd dwords per row. M = 1 with 32-column groups runs held_gemv
// below; every other call runs the panel tiles of qlinear_panel.h (qlinear_run.h panels_int),
// each panel's scales widened to fp32 once per call and chunk of x rows. Both add each output's
// terms in the canonical order (qlinear_rows.h), so row m of the result has the same bits as the
// row-major weight gives it, whatever M.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "qlinear_panel.h"
#include "stream_prefetch.h"

namespace fitserve::qlinear {

struct HeldWeight {
  const uint8_t* codes;
  const at::Half* scales;
  const at::Half* mins;  // nullptr: symmetric int4, int8
  int64_t P, nd, ngroups, group;

  int64_t panel_bytes() const { return nd * 4 * S::kLanes; }
  // The shape fields of the row-major weight it holds (q / scales unused: never read by rows).
  QWeight shape() const { return {nullptr, nullptr, mins, P * S::kLanes, nd * 4, ngroups, group}; }
};

// Panel pi as the tiles read it: its codes in place, its scales (and offsets) widened into dv / cv.
inline PanelView held_panel(const HeldWeight& h, bool int4, int64_t pi, std::vector<float>& dv,
                            std::vector<float>& cv) {
  constexpr int L = S::kLanes;
  const int64_t n = h.ngroups * L;
  if (static_cast<int64_t>(dv.size()) < n) dv.resize(n);
  if (int4 && static_cast<int64_t>(cv.size()) < n) cv.resize(n);
  const at::Half* sc = h.scales + pi * n;
  const at::Half* mn = h.mins ? h.mins + pi * n : nullptr;
  for (int64_t i = 0; i < n; i += L) {
    const S::F d = S::load_half(sc + i, L);
    S::storef(dv.data() + i, d);
    if (int4) S::storef(cv.data() + i, mn ? S::load_half(mn + i, L) : S::mul(d, S::set1(-8.f)));
  }
  return {reinterpret_cast<const uint32_t*>(h.codes + pi * h.panel_bytes()), dv.data(),
          int4 ? cv.data() : nullptr};
}

// Lays the row-major weight w out as held panels (w.N % kLanes == 0).
inline void hold_panels(const QWeight& w, bool int4, uint8_t* codes, at::Half* scales,
                        at::Half* mins) {
  constexpr int L = S::kLanes;
  const int64_t P = w.N / L, pb = w.row_bytes * L;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> dv(w.ngroups * L), cv(int4 ? w.ngroups * L : 0);
    for (int64_t p = p0; p < p1; ++p) {
      pack_panel(w, int4, p * L, nullptr, reinterpret_cast<uint32_t*>(codes + p * pb), dv.data(),
                 int4 ? cv.data() : nullptr);
      for (int l = 0; l < L; ++l)
        for (int64_t g = 0; g < w.ngroups; ++g) {
          const int64_t src = (p * L + l) * w.ngroups + g, dst = (p * w.ngroups + g) * L + l;
          scales[dst] = w.scales[src];
          if (mins) mins[dst] = w.mins[src];
        }
    }
  });
}

// NOTE: every line of the codes is prefetched this far ahead (bytes), into L2
// (stream_prefetch.h, where the hint is measured). The hardware prefetcher alone left int4 at
// 0.6-0.7 of a plain read (Zen 5, one thread, weights from DRAM); 1-4 KB ahead 0.6-1.0, 8 KB
// 0.8-1.1 for int4 and int8 (docs/benchmarks.md, wt-panel).
constexpr int64_t kHeldPrefetch = 8192;

// NP panels' kLanes outputs each (panels pp[0 .. NP)) for one row of x, 32-column groups, the
// panels in lockstep group by group: each group's integer dot (split over two accumulators:
// integer sums are exact in any order), then the canonical float step of int4_panel_tile /
// int8_panel_tile (kOneBlock / per_group == 1). Each panel's ops are the same whatever NP.
template <bool kInt4, int NP>
inline void held_panel_rows(const HeldWeight& h, const int64_t* pp, const NatAct& x, S::F* acc) {
  constexpr int L = S::kLanes;
  constexpr int kDw = kInt4 ? 4 : 8;  // dwords of a row per 32-column group
  const uint8_t* c[NP];
  const at::Half* sc[NP];
  const at::Half* mn[NP];
  for (int j = 0; j < NP; ++j) {
    c[j] = h.codes + pp[j] * h.panel_bytes();
    sc[j] = h.scales + pp[j] * h.ngroups * L;
    mn[j] = h.mins ? h.mins + pp[j] * h.ngroups * L : nullptr;
    acc[j] = S::fzero();
  }
  for (int64_t g = 0; g < h.ngroups; ++g) {
    const int8_t* a = x.aq + g * kActBlock;
    _Pragma("GCC unroll 2") for (int j = 0; j < NP; ++j) {
      const uint8_t* cg = c[j] + g * kDw * L * 4;
      for (int o = 0; o < kDw * L * 4; o += 64) prefetch_stream(cg + kHeldPrefetch + o);
      const S::F dv = S::load_half(sc[j] + g * L, L);
      if constexpr (kInt4) {
        S::I i0 = S::izero(), i1 = S::izero();
        _Pragma("GCC unroll 4") for (int d = 0; d < 4; ++d) {
          const S::B wv = S::loadb(cg + d * L * 4);
          i0 = S::dot_u4(i0, S::nib_lo(wv), S::bcast4(a + 4 * d));
          i1 = S::dot_u4(i1, S::nib_hi(wv), S::bcast4(a + 16 + 4 * d));
        }
        const S::F cv = mn[j] ? S::load_half(mn[j] + g * L, L) : S::mul(dv, S::set1(-8.f));
        const S::F t = S::mulr(S::cvt(S::iadd(i0, i1)), S::mulr(dv, S::set1(x.da[g])));
        const S::F off = S::mulr(cv, S::set1(x.sg[g]));
        acc[j] = S::add(acc[j], S::add(t, off));
      } else {
        S::I i0 = S::kW8Biased ? S::iset1(-128 * x.isum[g]) : S::izero(), i1 = S::izero();
        _Pragma("GCC unroll 8") for (int d = 0; d < 8; d += 2) {
          i0 = S::dot_w8p(i0, S::loadb(cg + d * L * 4), S::bcast4(a + 4 * d));
          i1 = S::dot_w8p(i1, S::loadb(cg + (d + 1) * L * 4), S::bcast4(a + 4 * d + 4));
        }
        acc[j] = S::add(acc[j], S::mulr(S::cvt(S::iadd(i0, i1)), S::mulr(dv, S::set1(x.da[g]))));
      }
    }
  }
}

// y [1, N] = x [1, kp] @ W^T for a held weight with 32-column groups (x quantized in xa).
// NOTE: a thread's panels run as two halves in lockstep (panel i of each: two sequential streams
// and two independent chains per group). One panel at a time streamed the 1.7B shapes' int4 rows
// at 17.4-19.5 GB/s at 2 threads on the Xeon, two 21.5-22.1 (four alternated rounds,
// bench_qgemv_stream --vs-held); adjacent panel pairs (one stream) gained nothing.
template <class O>
void held_gemv(const HeldWeight& h, bool int4, const NatAct& xa, O* out) {
  constexpr int L = S::kLanes;
  const int64_t N = h.P * L;
  at::parallel_for(0, h.P, 1, [&](int64_t p0, int64_t p1) {
    auto run = [&](auto np, const int64_t* pp) {
      constexpr int NP = decltype(np)::value;
      S::F acc[NP];
      if (int4) held_panel_rows<true, NP>(h, pp, xa, acc);
      else held_panel_rows<false, NP>(h, pp, xa, acc);
      for (int j = 0; j < NP; ++j) store_lanes(acc[j], out + pp[j] * L, N - pp[j] * L);
    };
    const int64_t half = (p1 - p0 + 1) / 2;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t pp[2] = {p0 + i, p0 + half + i};
      if (pp[1] < p1) run(std::integral_constant<int, 2>{}, pp);
      else run(std::integral_constant<int, 1>{}, pp);
    }
  });
}

}  // namespace fitserve::qlinear
