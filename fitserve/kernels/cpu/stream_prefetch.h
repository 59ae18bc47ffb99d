// The software prefetch of bytes a kernel streams once per call: weight rows of the batch-1
// GEMVs (held int4 / int8 panels, K-quant and ggml rows, bf16, fp8, the MoE experts' rows) and
// the decode attention's K / V rows. Requested into L2 (prefetcht1), not L1.
//
// NOTE: measured with every other part the same, 2 threads, weights / KV from DRAM:
// - Intel Xeon (AMX), the held int4 GEMV at the 1.7B shapes: 19.3-19.5 GB/s with T0, 22.1-22.5
//   with T1 (no prefetch ~17).
// - AMD EPYC Zen 4, benchmarks/bench_prefetch_hint.py (T1 / T0 in alternated worker processes,
//   medians of the rounds' ratios): W1 of the default model q4_1 1.06x (7 rounds), fp8 1.24x
//   (7), bf16 1.04x (3), the Qwen3-MoE bench model 1.01x (3); the GEMVs alone 0.93-1.29x on a
//   noisy host (docs/benchmarks.md, ninth session).
// A line pulled into L1 ahead of its use can evict what the step reuses (x, the scales) from a
// 32-48 KB L1 while two threads keep several KB in flight each; L2 holds the distance. (The
// Zen 5's earlier choice of T0 compared prefetch distances, not hints; not re-measured there.)
// FITSERVE_PREFETCH_HINT=l1 (read once when an extension loads) requests them into L1 instead,
// so benchmarks/bench_prefetch_hint.py can measure both on another CPU.
#pragma once

#include <cstdlib>
#include <cstring>

namespace fitserve {

inline const bool kStreamPrefetchL1 = [] {
  const char* v = std::getenv("FITSERVE_PREFETCH_HINT");
  return v != nullptr && std::strcmp(v, "l1") == 0;
}();

[[gnu::always_inline]] inline void prefetch_stream(const void* p) {
  if (kStreamPrefetchL1) __builtin_prefetch(p, 0, 3);  // prefetcht0
  else __builtin_prefetch(p, 0, 2);                    // prefetcht1
}

}  // namespace fitserve
