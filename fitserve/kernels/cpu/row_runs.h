// The batch-1 streaming order of a thread's weight rows [n0, n1): kRowRuns equal runs of them
// taken in turn (run 0's first row, run 1's first, ..., run 0's second, ...), each row requested
// `ahead` rows before its turn in its run. Each row is still computed alone, so the order does
// not change any output's bits.
//
// NOTE: one core keeps more misses in flight over several sequential streams than over one.
// On the Xeon (2 threads, rows from DRAM), the default model's bf16 gate_up (3.5 MB x 30
// layers) streamed at 17-20 GB/s as one run, 25-28 as two, 27-33 as four, and its 57 MB lm_head
// at 16-17 / 22 / 24-25; eight runs were no better. (The MoE expert op's visit_order found the
// same four.) Used by dense_gemv.cpp (bf16) and fp8_gemv.cpp.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fitserve {

constexpr int64_t kRowRuns = 4;

// prefetch(n): request row n; row(n): compute row n; row4(const int64_t* ns): compute the four
// rows ns[0..3] (one of each run), each with row(n)'s bits.
template <class Prefetch, class Row, class Row4>
inline void rows_in_runs(int64_t n0, int64_t n1, int64_t ahead, Prefetch&& prefetch, Row&& row,
                         Row4&& row4) {
  const int64_t n = n1 - n0, q = (n + kRowRuns - 1) / kRowRuns;
  for (int64_t i = 0; i < std::min(q, ahead); ++i)
    for (int64_t r = 0; r < kRowRuns; ++r)
      if (r * q + i < n) prefetch(n0 + r * q + i);
  for (int64_t i = 0; i < q; ++i) {
    if (i + ahead < q)
      for (int64_t r = 0; r < kRowRuns; ++r)
        if (r * q + i + ahead < n) prefetch(n0 + r * q + i + ahead);
    if ((kRowRuns - 1) * q + i < n) {
      static_assert(kRowRuns == 4, "row4 takes one row of each run");
      const int64_t ns[4] = {n0 + i, n0 + q + i, n0 + 2 * q + i, n0 + 3 * q + i};
      row4(ns);
      continue;
    }
    for (int64_t r = 0; r < kRowRuns; ++r)
      if (r * q + i < n) row(n0 + r * q + i);
  }
}

template <class Prefetch, class Row>
inline void rows_in_runs(int64_t n0, int64_t n1, int64_t ahead, Prefetch&& prefetch, Row&& row) {
  rows_in_runs(n0, n1, ahead, prefetch, row, [&](const int64_t* ns) {
    for (int r = 0; r < 4; ++r) row(ns[r]);
  });
}

}  // namespace fitserve
