// The three ways qlinear.cpp runs a call, each parallel over output rows N (at::parallel_for,
// so torch.set_num_threads applies):
//
//   rows_int             M < kPanelMinRows, group 32: the canonical rows (qlinear_rows.h)
//   rows_f32             M < kMmMinRows (fp32; every M with batch_invariant): row-major register
//                        tiles (qlinear_tiles.h) of NT weight rows x MT rows of x
//   panels_int           M >= kPanelMinRows, or every M for other groups / the scalar tier:
//                        "lane = output row" panels (qlinear_panel.h), the same float order,
//                        read from the weight's prepacked panels where it has them
//                        (qlinear_prepack.h, made once at load), else packed per call
//   f32_via_mm           M >= kMmMinRows: W dequantized exactly, panel by panel, + at::mm
//
// Scratch memory (quantized x, fp32 out before bf16 rounding, panels) lives in thread_local
// vectors that are reused across calls: a decode step calls these ops hundreds of times, and a
// fresh allocation per call (an mmap + page faults for the larger ones) costs more than the work.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>

#include <vector>

#include "qlinear_act.h"
#include "qlinear_amx.h"
#include "qlinear_gemv.h"
#include "qlinear_held.h"
#include "qlinear_panel.h"
#include "qlinear_prepack.h"
#include "qlinear_rows.h"
#include "qlinear_tiles.h"

namespace fitserve::qlinear {

// NOTE: the crossovers. Integer path: the canonical rows (qlinear_rows.h) redo their int work
// per row of x, so from 2 rows the panels are faster (Zen 5, 1 thread, SmolLM2 shapes: M=2
// 21 vs 29 us qkv, 63 vs 86 gate_up); both add the same terms in the same order, so the switch
// changes no bit. fp32 path: at::mm on exactly dequantized panels beats the register tiles
// from ~16 rows on the Xeon with AMX it was measured on (not on Zen 5), at the price of an
// order that depends on M (batch_invariant keeps the tiles).
constexpr int64_t kPanelMinRows = 2;
constexpr int64_t kMmMinRows = 16;
constexpr int64_t kPanelMaxRows = 256;  // rows of x per pass over the int panels (in L2)
constexpr int64_t kMmPanelBytes = 1 << 21;  // fp32 weight panel of the at::mm path

template <class T>
T* scratch(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// ---- row-major tiles --------------------------------------------------------------------

// Weight rows per parallel block: a multiple of 4 (every NT), <= 32, >= 4 blocks per thread.
inline int64_t block_rows(int64_t N) {
  const int64_t want = N / (4 * std::max<int64_t>(1, at::get_num_threads()));
  return std::clamp<int64_t>((want / 4) * 4, 4, 32);
}

// Rows [n_begin, n_end) of y for all M rows of x: M in tiles of 4, then 2, then 1.
template <class K>
void run_rows(const K& k, int64_t M, int64_t n_begin, int64_t n_end) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    for (int64_t n = n_begin; n < n_end; n += 2) k.template tile<2, 4>(n, m);
  if (m + 2 <= M) {
    for (int64_t n = n_begin; n < n_end; n += 4) k.template tile<4, 2>(n, m);
    m += 2;
  }
  if (m < M)
    for (int64_t n = n_begin; n < n_end; n += 4) k.template tile<4, 1>(n, m);
}

template <class K>
void run_row_blocks(const K& k, int64_t N, int64_t M) {
  const int64_t nb = block_rows(N);
  at::parallel_for(0, (N + nb - 1) / nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) run_rows(k, M, b * nb, std::min(N, (b + 1) * nb));
  });
}

template <bool kAsym>
struct Int4F32 {
  const QWeight& w; const float* x; int64_t ldx; float* out;
  template <int NT, int MT>
  void tile(int64_t n0, int64_t m0) const {
    int4_f32_tile<NT, MT, kAsym>(w, x, ldx, n0, m0, out, w.N);
  }
};

struct Int8F32 {
  const QWeight& w; const float* x; int64_t ldx; float* out;
  template <int NT, int MT>
  void tile(int64_t n0, int64_t m0) const { int8_f32_tile<NT, MT>(w, x, ldx, n0, m0, out, w.N); }
};

// Whether the canonical rows (qlinear_rows.h) run this weight; otherwise the panels run every M
// (the same kernel for every M is what keeps a row's result independent of M).
inline bool canonical_rows_apply(const QWeight& w) {
#ifdef FITSERVE_QLINEAR_GEMV
  return w.group == kActBlock;
#else
  (void)w;
  return false;
#endif
}

// act_quant=True, small M, group 32: x quantized (as the panels do) and laid out in the weight's
// byte order, then the canonical rows.
template <class T>
void rows_int(const T* x, int64_t M, int64_t kp, const QWeight& w, bool int4, float* out) {
#ifdef FITSERVE_QLINEAR_GEMV
  static thread_local std::vector<int8_t> a_buf, aq_buf;
  static thread_local std::vector<float> s_buf, da_buf;
  static thread_local std::vector<int32_t> isum_buf, bias_buf;
  static thread_local std::vector<RowAct> acts;
  const ActLayout L(w.row_bytes, int4 ? w.group / 2 : w.group, int4 ? 2 : 1);
  const int64_t G = w.ngroups, nbias = L.nchunks * S::kLanes;
  const int64_t a_stride = int4 ? L.a_stride : kp;
  int8_t* A = scratch(a_buf, M * a_stride);
  float* Sg = scratch(s_buf, M * G);
  float* da = scratch(da_buf, M * G);
  int32_t* isum = scratch(isum_buf, G);
  int32_t* bias = scratch(bias_buf, M * nbias);
  int8_t* aq = scratch(aq_buf, kp);
  acts.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* am = A + m * a_stride;
    quantize_row(x + m * kp, kp, int4 ? aq : am, da + m * G, isum);
    int32_t* bm = nullptr;
    if (int4) {
      layout_int4_g32_gemv(aq, da + m * G, isum, kp, L, am, Sg + m * G);
    } else if (S::kGemvW8Unsigned) {
      bm = bias + m * nbias;
      gemv_w8_lane_bias(am, kp, L, bm);
    }
    acts[m] = RowAct{QAct{am, nullptr, int4 ? Sg + m * G : nullptr, a_stride, 0, bm}, da + m * G};
  }
  const RowAct* xs = acts.data();
  // kLanes weight rows per step; a parallel block is 1-2 steps, >= 4 blocks per thread
  const int64_t steps = w.N / (4 * S::kLanes * std::max<int64_t>(1, at::get_num_threads()));
  const int64_t nb = S::kLanes * std::clamp<int64_t>(steps, 1, 2);
  const bool asym = w.mins != nullptr;
  at::parallel_for(0, (w.N + nb - 1) / nb, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * nb, n1 = std::min(w.N, b1 * nb);
    if (!int4) canonical_rows<false, false>(w, xs, M, n0, n1, out);
    else if (asym) canonical_rows<true, true>(w, xs, M, n0, n1, out);
    else canonical_rows<true, false>(w, xs, M, n0, n1, out);
  });
#else
  (void)x, (void)M, (void)kp, (void)w, (void)int4, (void)out;
  TORCH_CHECK(false, "qlinear: the canonical rows need the avx2 tier or above");
#endif
}

// act_quant=False, small M: fp32 x (row stride kp), weights dequantized in registers.
inline void rows_f32(const float* x, int64_t M, int64_t kp, const QWeight& w, bool int4,
                     float* out) {
  if (!int4) run_row_blocks(Int8F32{w, x, kp, out}, w.N, M);
  else if (w.mins) run_row_blocks(Int4F32<true>{w, x, kp, out}, w.N, M);
  else run_row_blocks(Int4F32<false>{w, x, kp, out}, w.N, M);
}

// ---- panels (integer path, many rows) ---------------------------------------------------

// One panel against rows [m_begin, m_end) of x: tiles of kPanelMT rows, then 4, 2, 1.
template <class K>
void panel_rows(const K& k, const PanelView& p, int64_t n0, int64_t m_begin, int64_t m_end) {
  constexpr int MT = S::kPanelMT;
  int64_t m = m_begin;
  for (; m + MT <= m_end; m += MT) k.template tile<MT>(p, n0, m);
  if constexpr (MT > 4) {
    if (m + 4 <= m_end) {
      k.template tile<4>(p, n0, m);
      m += 4;
    }
  }
  if (m + 2 <= m_end) {
    k.template tile<2>(p, n0, m);
    m += 2;
  }
  if (m < m_end) k.template tile<1>(p, n0, m);
}

template <int kSeg, bool kOneBlock, class O>
struct Int4Panel {
  const QWeight& w; const NatAct& x; O* out;
  template <int MT>
  void tile(const PanelView& p, int64_t n0, int64_t m0) const {
    int4_panel_tile<MT, kSeg, kOneBlock, O>(w, p, x, n0, m0, out, w.N);
  }
};

template <class O>
struct Int8Panel {
  const QWeight& w; const NatAct& x; O* out;
  template <int MT>
  void tile(const PanelView& p, int64_t n0, int64_t m0) const {
    int8_panel_tile<MT, O>(w, p, x, n0, m0, out, w.N);
  }
};

// prepacked: the weight's panels made at load beside its rows (qlinear_prepack.h), or held: the
// weight itself held as panels (qlinear_held.h; w is then only its shape), or neither: pack per
// call. out: fp32 or bf16 [M, N] (each output rounded once, in the tile's store).
template <class T, class O>
void panels_int(const T* x, int64_t M, int64_t kp, const QWeight& w, bool int4,
                const uint8_t* prepacked, const HeldWeight* held, O* out) {
  static thread_local std::vector<int8_t> aq_buf;
  static thread_local std::vector<float> da_buf, sg_buf;
  static thread_local std::vector<int32_t> isum_buf;
  const int64_t nblk = kp / kActBlock;
#if defined(FITSERVE_AMX_INT8)
  const bool amx = held && w.group == kActBlock && M >= kAmxMinRows && amx_usable();
#else
  constexpr bool amx = false;
#endif
  // AMX reads x in 16-row tiles: its rows are padded with zero codes and scales
  const int64_t Mp = amx ? (M + 15) / 16 * 16 : M;
  int8_t* aq = scratch(aq_buf, Mp * kp);
  float* da = scratch(da_buf, Mp * nblk);
  int32_t* isum = scratch(isum_buf, Mp * nblk);
  float* sg = int4 ? scratch(sg_buf, Mp * w.ngroups) : nullptr;
  if (Mp > M) {
    std::fill(aq + M * kp, aq + Mp * kp, int8_t{0});
    std::fill(da + M * nblk, da + Mp * nblk, 0.f);
    std::fill(isum + M * nblk, isum + Mp * nblk, 0);
    if (sg) std::fill(sg + M * w.ngroups, sg + Mp * w.ngroups, 0.f);
  }
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / kp), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      quantize_row(x + m * kp, kp, aq + m * kp, da + m * nblk, isum + m * nblk);
      if (int4) group_sums(da + m * nblk, isum + m * nblk, kp, w.group, sg + m * w.ngroups);
    }
  });
  const NatAct xa{aq, da, isum, sg, kp, nblk};
  if (held && M == 1 && w.group == kActBlock) return held_gemv(*held, int4, xa, out);
#if defined(FITSERVE_AMX_INT8)
  if (amx) return held_amx(*held, int4, xa, M, out);
#endif
  const int64_t npanels = (w.N + S::kLanes - 1) / S::kLanes, half = w.group / 2;
  // NOTE: one parallel region: each thread takes its panels through every chunk of rows (the
  // chunk's activations stay in L2 across its panels), instead of a region per chunk
  // G = 32 (the default model's int4, Q8_0's int8) on AVX-512: two panels per register tile
  [[maybe_unused]] const bool two = kTwoPanels && w.group == kActBlock;
  at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
    static thread_local Panel panel[2];  // per worker thread
    auto view = [&](int64_t pi, int j) {
      const int64_t n0 = pi * S::kLanes;
      return held ? held_panel(*held, int4, pi, panel[j].dv, panel[j].cv)
             : prepacked && n0 + S::kLanes <= w.N ? prepacked_panel(prepacked, w, int4, pi)
                                                  : panel[j].pack(w, int4, n0);
    };
    auto rows = [&](const PanelView& v, int64_t n0, int64_t m0, int64_t m1) {
      if (!int4)
        panel_rows(Int8Panel<O>{w, xa, out}, v, n0, m0, m1);
      else if (w.group == kActBlock)
        panel_rows(Int4Panel<16, true, O>{w, xa, out}, v, n0, m0, m1);
      else if (half % 32 == 0)
        panel_rows(Int4Panel<32, false, O>{w, xa, out}, v, n0, m0, m1);
      else
        panel_rows(Int4Panel<16, false, O>{w, xa, out}, v, n0, m0, m1);
    };
    for (int64_t mb = 0; mb < M; mb += kPanelMaxRows) {
      const int64_t me = std::min(M, mb + kPanelMaxRows);
      for (int64_t pi = p0; pi < p1;) {
        const int64_t n0 = pi * S::kLanes;
        if constexpr (kTwoPanels) {
          if (two && pi + 1 < p1 && me - mb >= kTwoPanelMT) {
            const PanelView v[2] = {view(pi, 0), view(pi + 1, 1)};
            int64_t m = mb;
            for (; m + kTwoPanelMT <= me; m += kTwoPanelMT) {
              if (int4)
                int4_panel_tile2<kTwoPanelMT, O>(w, v, xa, n0, m, out, w.N);
              else
                int8_panel_tile2<kTwoPanelMT, O>(w, v, xa, n0, m, out, w.N);
            }
            if (m < me) {
              rows(v[0], n0, m, me);
              rows(v[1], n0 + S::kLanes, m, me);
            }
            pi += 2;
            continue;
          }
        }
        rows(view(pi, 0), n0, mb, me);
        pi += 1;
      }
    }
  });
}

// ---- fp32 path, many rows: exact dequantization + at::mm ---------------------------------

// xf: fp32 [M, kp]; out: fp32 [M, N] (row stride N).
inline void f32_via_mm(const QWeight& w, bool int4, const at::Tensor& xf, const at::Tensor& out) {
  const int64_t kp = xf.size(1);
  const int64_t rows = std::clamp<int64_t>(kMmPanelBytes / (4 * kp) / 16 * 16, 16, w.N);
  static thread_local std::vector<float> buf;
  float* pp = scratch(buf, rows * kp);
  const at::Tensor panel = at::from_blob(pp, {rows, kp}, xf.options());
  for (int64_t n0 = 0; n0 < w.N; n0 += rows) {
    const int64_t nr = std::min(rows, w.N - n0);
    at::parallel_for(0, nr, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dequant_row(w, int4, n0 + r, pp + r * kp);
    });
    at::Tensor dst = out.narrow(1, n0, nr);  // strides (N, 1): BLAS writes it in place
    at::mm_out(dst, xf, panel.narrow(0, 0, nr).t());
  }
}

}  // namespace fitserve::qlinear
