// The integer M > 1 kernels' ceiling on an AVX512-VNNI core: how many zmm VPDPBUSD (64 u8 x s8
// multiply-adds each) a thread issues per second, in registers (no memory), against which the
// ggml panels' G MAC/s (bench_m_rows.py) read as a fraction of the peak:
//   (a) VPDPBUSD alone, 12 independent accumulators;
//   (b) the panels' chunk (ggml_blocks_kqpanel.h, kq_panel_rows2): 8 VPDPBUSD per accumulator,
//       then its chunk scale's VPMULLD and a VPADDD, 8 accumulators;
//   (c) Q6_K's chunk: the same with 4 VPDPBUSD per scale.
// Prints G MAC/s (the VPDPBUSD's multiply-adds only) per thread count, the best of 3 runs.
//
//   g++ -O3 -mavx512f -mavx512bw -mavx512vnni -pthread benchmarks/vnni_peak.cpp \
//       -o /tmp/vnni_peak && /tmp/vnni_peak 2
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

constexpr long kIters = 20'000'000;

// kDots VPDPBUSD per accumulator, then (kDots < 0: never) a VPMULLD by the scale and a VPADDD.
template <int kAcc, int kDots, bool kScale>
double run_thread() {
  __m512i d[kAcc], s[kAcc];
  for (int i = 0; i < kAcc; ++i) d[i] = s[i] = _mm512_set1_epi32(i);
  __m512i u = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5), sc = _mm512_set1_epi32(7);
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 16
    for (int c = 0; c < kDots; ++c) {
#pragma GCC unroll 16
      for (int i = 0; i < kAcc; ++i) d[i] = _mm512_dpbusd_epi32(d[i], u, x);
    }
    if constexpr (kScale) {
#pragma GCC unroll 16
      for (int i = 0; i < kAcc; ++i) {
        s[i] = _mm512_add_epi32(s[i], _mm512_mullo_epi32(d[i], sc));
        d[i] = _mm512_setzero_si512();
      }
    }
    asm("" : "+v"(u), "+v"(x), "+v"(sc));
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int sink = 0;
  for (int i = 0; i < kAcc; ++i) sink += _mm512_reduce_add_epi32(_mm512_add_epi32(d[i], s[i]));
  if (sink == 42) std::puts("");
  return static_cast<double>(kIters) * kDots * kAcc * 64 / sec;
}

template <int kAcc, int kDots, bool kScale>
double best_rate(int threads) {
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    std::vector<double> rate(threads);
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&rate, t] { rate[t] = run_thread<kAcc, kDots, kScale>(); });
    for (auto& t : ts) t.join();
    double sum = 0;
    for (double v : rate) sum += v;
    best = std::max(best, sum);
  }
  return best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : 2;
  for (int th = 1; th <= max_threads; th *= 2) {
    const double a = best_rate<12, 1, false>(th);
    const double b = best_rate<8, 8, true>(th);
    const double c = best_rate<8, 4, true>(th);
    std::printf("threads %d: VPDPBUSD alone %.1f G MAC/s; 8 per scale (Q4_K / IQ4_XS chunks) "
                "%.1f (%.2f); 4 per scale (Q6_K) %.1f (%.2f)\n",
                th, a, b, b / a, c, c / a);
  }
}
