// How fast this machine reads a MoE decode step's active expert bytes with plain AVX-512 loads:
// the ceiling for the expert op (bench_moe_op.py) under issue 39's active-bytes limit. It reads
// per call one layer's 8 of 64 experts, each a gate_up slice (294,912 bytes: 512 rows of 1,024
// Q4_K columns) and a down slice (215,040 bytes: 1,024 rows of 256 Q6_K columns), 4.08 MB in 16
// slices. The layers cycle (48 x 32.6 MB) so each call's slices come from DRAM, as in a step.
//   (a) the 16 slices split between the threads (each thread a contiguous share of each slice,
//       as the expert op splits rows);
//   (b) the same bytes as one contiguous 4.08 MB buffer per call (layers cycled alike);
//   (c) one long stream (the 1.5 GB of all layers, read through): the copy-like rate.
// Prints GB/s (bytes read / wall time), medians of 5 passes, per thread count.
//
//   g++ -O3 -mavx512f -fopenmp benchmarks/slice_read.cpp -o /tmp/slice_read && /tmp/slice_read 2
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int64_t kExperts = 64, kTopK = 8, kLayers = 48;
constexpr int64_t kGateUp = 294912, kDown = 215040, kExpert = kGateUp + kDown;
constexpr int64_t kLayerBytes = kExperts * kExpert;

// Sum of [p, p + n) as 64-byte loads (n a multiple of 64): the bytes really read.
inline __m512i read_span(const uint8_t* p, int64_t n, __m512i acc) {
  for (int64_t o = 0; o < n; o += 64)
    acc = _mm512_add_epi64(acc, _mm512_load_si512(p + o));
  return acc;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : 2;
  auto* all = static_cast<uint8_t*>(std::aligned_alloc(64, kLayers * kLayerBytes));
  std::memset(all, 1, kLayers * kLayerBytes);
  std::vector<uint8_t*> packed(kLayers);
  for (auto& p : packed) {
    p = static_cast<uint8_t*>(std::aligned_alloc(64, kTopK * kExpert));
    std::memset(p, 1, kTopK * kExpert);
  }
  std::mt19937 rng(7);
  const int calls = 480;
  std::vector<std::vector<int>> routes(calls);
  for (auto& r : routes) {
    std::vector<int> e(kExperts);
    for (int i = 0; i < kExperts; ++i) e[i] = i;
    std::shuffle(e.begin(), e.end(), rng);
    r.assign(e.begin(), e.begin() + kTopK);
  }
  volatile int64_t sink = 0;
  for (int th = 1; th <= max_threads; th *= 2) {
    omp_set_num_threads(th);
    double best[3][5];
    for (int pass = 0; pass < 5; ++pass) {
      // (a) scattered slices, each split between the threads
      auto t0 = std::chrono::steady_clock::now();
      for (int c = 0; c < calls; ++c) {
        const uint8_t* layer = all + (c % kLayers) * kLayerBytes;
        __m512i acc = _mm512_setzero_si512();
#pragma omp parallel reduction(+ : sink)
        {
          const int t = omp_get_thread_num(), nt = omp_get_num_threads();
          __m512i a = acc;
          for (int e : routes[c]) {
            const uint8_t* base = layer + e * kExpert;
            for (int64_t part = 0; part < 2; ++part) {
              const uint8_t* p = base + (part ? kGateUp : 0);
              const int64_t n = (part ? kDown : kGateUp) / 64;
              const int64_t b0 = n * t / nt, b1 = n * (t + 1) / nt;
              a = read_span(p + 64 * b0, 64 * (b1 - b0), a);
            }
          }
          sink += _mm512_reduce_add_epi64(a);
        }
      }
      best[0][pass] = calls * kTopK * kExpert / seconds_since(t0) / 1e9;
      // (b) the same bytes contiguous
      t0 = std::chrono::steady_clock::now();
      for (int c = 0; c < calls; ++c) {
        const uint8_t* p = packed[c % kLayers];
#pragma omp parallel reduction(+ : sink)
        {
          const int t = omp_get_thread_num(), nt = omp_get_num_threads();
          const int64_t n = kTopK * kExpert / 64;
          const int64_t b0 = n * t / nt, b1 = n * (t + 1) / nt;
          sink += _mm512_reduce_add_epi64(read_span(p + 64 * b0, 64 * (b1 - b0), _mm512_setzero_si512()));
        }
      }
      best[1][pass] = calls * kTopK * kExpert / seconds_since(t0) / 1e9;
      // (c) one long stream
      t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : sink)
      {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t n = kLayers * kLayerBytes / 64;
        const int64_t b0 = n * t / nt, b1 = n * (t + 1) / nt;
        sink += _mm512_reduce_add_epi64(read_span(all + 64 * b0, 64 * (b1 - b0), _mm512_setzero_si512()));
      }
      best[2][pass] = kLayers * kLayerBytes / seconds_since(t0) / 1e9;
    }
    double med[3];
    for (int k = 0; k < 3; ++k) {
      std::sort(best[k], best[k] + 5);
      med[k] = best[k][2];
    }
    std::printf("threads %d: 8 of 64 experts' slices %.1f GB/s; the same bytes contiguous %.1f; "
                "one long stream %.1f\n", th, med[0], med[1], med[2]);
  }
  return static_cast<int>(sink & 0);
}
