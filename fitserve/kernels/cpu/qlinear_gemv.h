// What the row-major group-32 integer kernel (qlinear_rows.h) builds on: the tiers that have
// its primitives (FITSERVE_QLINEAR_GEMV: S::dot_u4x2, gemv_dot_w8, hsum128x4, pair128), the
// weight rows per prefetch step, and a compile-time unrolled loop.
//
// A group-32 row: a chunk of kBytes weight bytes covers a FIXED set of GPC groups,
//   int4: GPC = kBytes / 16, lanes 4i..4i+3 belong to group i of the chunk
//   int8: GPC = kBytes / 32, lanes 8i..8i+7 belong to group i of the chunk
// and a "span" of kLanes groups is kLanes / GPC chunks.
//
// NOTE: history: until 2026-12-05 a GEMV here kept kLanes float partial sums per row and one
// horizontal sum (Zen 4: 3.67 ms for SmolLM2's 120 int4 projections, 0.73 ms for the int8
// lm_head); it was replaced by the canonical order shared with the panels (batch invariance),
// at the cost docs/benchmarks.md records ('Batch invariance and activation precision').
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

#endif

}  // namespace fitserve::qlinear
