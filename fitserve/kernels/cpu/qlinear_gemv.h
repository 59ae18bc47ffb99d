// One row of x (M = 1, a decode step) against a group-32 packed weight: the GEMV every layer
// of a batch-1 decode runs, and the one place the CPU streams all the weights per token.
//
// Same activations and byte order as the integer tiles (qlinear_act.h, qlinear_tiles.h), but
// written for G = 32 only, where weight groups and activation blocks coincide and a chunk of
// kBytes weight bytes covers a FIXED set of GPC groups:
//   int4: GPC = kBytes / 16, lanes 4i..4i+3 belong to group i of the chunk
//   int8: GPC = kBytes / 32, lanes 8i..8i+7 belong to group i of the chunk
// A row is walked kLanes groups at a time (a "span": kLanes / GPC chunks). Once per span and
// row, the kLanes fp16 weight scales are converted and multiplied by the activation blocks'
// scales (one vector op for all of them); each chunk then takes its lanes' products with an
// in-lane shuffle (S::span4 / chunk4, span8 / chunk8: one cross-lane permute per span, the
// row's last, partial span included). The low / high nibble dots of an int4 lane are summed as
// int16 before widening (S::dot_u4x2).
//
// NOTE: why not the general tile at M = 1: with NT = 4 rows of lo / hi / scales live across a
// chunk it ran out of AVX2 registers (accumulators spilled to the stack every chunk) and
// branched on each chunk's scale count; per 64 int4 weights and row it issued ~20 vector ops
// where this issues ~11, and a decode step is nothing but this loop over 96 MB. A cross-lane
// vpermps per chunk instead of the in-lane shuffle cost 7% (int4) / 13% (int8) at 1 thread on
// Zen 3. On Zen 4 (avx512_vnni tier) this path replaced the tiles at M = 1 on 2026-12-04:
// SmolLM2's batch-1 linears back to back (benchmarks/profile_engine.py) went from 5.37 to 3.67
// ms for the 120 int4 projections and from 2.47 to 0.73 ms for the int8 lm_head.
#pragma once

#include <algorithm>
#include <type_traits>
#include <utility>

#include "qlinear_tiles.h"

namespace fitserve::qlinear {

// Tiers whose Simd has dot_u4x2 / span4 / gemv_dot_w8 (avx2, avx512, avx512_vnni; scalar
// keeps the tiles).
#if defined(FITSERVE_TIER_AVX2) || defined(FITSERVE_TIER_AVX512) || \
    defined(FITSERVE_TIER_AVX512_VNNI)
#define FITSERVE_QLINEAR_GEMV 1

constexpr int kGemvRows = 4;  // weight rows per prefetch step

// f(integral_constant<int, 0>) ... f(integral_constant<int, N - 1>): an index the Simd
// shuffles can take as an immediate
template <int N, class Fn, int... J>
[[gnu::always_inline]] inline void unrolled_impl(Fn&& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}
template <int N, class Fn>
[[gnu::always_inline]] inline void unrolled(Fn&& f) {
  unrolled_impl<N>(f, std::make_integer_sequence<int, N>{});
}

// y[n] for rows [n_begin, n_end): kInt4 (asymmetric with mins when kAsym) or int8.
// dg: the activation scale of each 32-column block (= group).
template <bool kInt4, bool kAsym>
void g32_gemv(const QWeight& w, const QAct& x, const float* dg, int64_t n_begin, int64_t n_end,
              float* out) {
  constexpr int kGroupBytes = kInt4 ? 16 : 32;
  // GPC: groups per chunk; CPS: chunks per span (kLanes groups)
  constexpr int GPC = S::kBytes / kGroupBytes, CPS = S::kLanes / GPC, NT = kGemvRows;
  const int64_t G = w.ngroups;
  // one chunk of row q at chunk index c (nb bytes of it), lane scales ls
  auto chunk = [&](const uint8_t* q, int64_t c, int nb, S::F ls, S::F& acc)
      __attribute__((always_inline)) {
    const S::B wb = S::load_bytes(q + c * S::kBytes, nb);
    S::I t;
    if constexpr (kInt4) {
      const int8_t* a = x.a + c * 2 * S::kBytes;
      t = S::dot_u4x2(S::nib_lo(wb), S::load_bytes(a, S::kBytes), S::nib_hi(wb),
                      S::load_bytes(a + S::kBytes, S::kBytes));
    } else {  // activations past the row are masked like the weights (x.a is kp bytes)
      const S::B a = S::load_bytes(x.a + c * S::kBytes, nb);
      t = S::gemv_dot_w8(wb, a, S::kGemvW8Unsigned
                                    ? S::load_bytes(x.lane_bias + c * S::kLanes, S::kBytes)
                                    : S::izero());
    }
    acc = S::fmadd(S::cvt(t), ls, acc);
  };
  for (int64_t n0 = n_begin; n0 < n_end; n0 += NT) {
    prefetch_tile<NT>(w, n0);
    for (int r = 0; r < NT && n0 + r < n_end; ++r) {
      const int64_t row = n0 + r;
      const uint8_t* q = w.q + row * w.row_bytes;
      const at::Half* sc = w.scales + row * G;
      S::F acc = S::fzero();
      int64_t g0 = 0;
      for (; g0 + S::kLanes <= G; g0 += S::kLanes) {  // whole spans
        const S::F sv = S::mul(S::load_half(sc + g0, S::kLanes), S::loadf(dg + g0));
        const int64_t c0 = g0 / GPC;
        if constexpr (kInt4) {
          const auto sp = S::span4(sv);
          unrolled<CPS>([&](auto j) { chunk(q, c0 + j, S::kBytes, S::template chunk4<j>(sp), acc); });
        } else {
          const auto sp = S::span8(sv);
          unrolled<CPS>([&](auto j) { chunk(q, c0 + j, S::kBytes, S::template chunk8<j>(sp), acc); });
        }
      }
      if (g0 < G) {  // the row's last groups: fewer chunks, maybe a partial one
        const int cnt = static_cast<int>(G - g0);
        const S::F sv = S::mul(S::load_half(sc + g0, cnt), S::loadf(dg + g0, cnt));
        const int64_t c0 = g0 / GPC;
        // a partial span: the same in-lane shuffles, chunks past the row skipped; only an int4
        // row of an odd group count ends in a half chunk (16 bytes)
        const int whole = cnt / GPC, part = (cnt % GPC) * kGroupBytes;
        auto tail = [&](auto j, S::F ls) __attribute__((always_inline)) {
          if (j < whole) chunk(q, c0 + j, S::kBytes, ls, acc);
          else if (j == whole && part) chunk(q, c0 + j, part, ls, acc);
        };
        if constexpr (kInt4) {
          const auto sp = S::span4(sv);
          unrolled<CPS>([&](auto j) { tail(j, S::template chunk4<j>(sp)); });
        } else {
          const auto sp = S::span8(sv);
          unrolled<CPS>([&](auto j) { tail(j, S::template chunk8<j>(sp)); });
        }
      }
      if constexpr (kInt4) {  // offsets: y += sum_g c_g * S_g, c_g = min (Q4_1) or -8 * scale
        for (int64_t g = 0; g < G; g += S::kLanes) {
          const int cnt = static_cast<int>(std::min<int64_t>(S::kLanes, G - g));
          const S::F cg = kAsym ? S::load_half(w.mins + row * G + g, cnt)
                                : S::mul(S::load_half(sc + g, cnt), S::set1(-8.f));
          acc = S::fmadd(cg, S::loadf(x.s + g, cnt), acc);
        }
      }
      out[row] = S::hsum(acc);
    }
  }
}

#endif

}  // namespace fitserve::qlinear
