// What bounds the fp8 GEMV's VBMI lookup path (fp8_gemv_lookup.h) on this core: 64 e4m3 codes
// -> 64 bf16 (two VPERMT2B, a VPTERNLOGD for the sign, two byte unpacks) and two VDPBF16PS,
//   (a) in registers, four independent 64-code units per iteration (no memory);
//   (b) the same with the two unpacks replaced by word shifts + VPTERNLOGD (the words built
//       arithmetically; needs x in even / odd order, not adopted: see the docs);
//   (c) rows_dot_lookup4 itself over L1-resident rows (4 rows x 576 codes, x shared).
// Prints ns per 64 codes (one thread, steady clock).
//
//   T=.venv/lib/python3.11/site-packages/torch/include
//   g++ -O3 -march=native -I fitserve/kernels/cpu -I $T -I $T/torch/csrc/api/include \
//       benchmarks/fp8_decode_ports.cpp -o /tmp/fp8_decode_ports && /tmp/fp8_decode_ports
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fp8_gemv_lookup.h"
#include "fp8_gemv_simd.h"

#if !defined(FP8_GEMV_LOOKUP)
int main() {
  std::printf("built without AVX512-BF16: the lookup path does not exist on this CPU\n");
  return 0;
}
#else

namespace {

double now_ns() {
  return std::chrono::duration<double, std::nano>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// kShift: the unpacks replaced by shifts + ternlog (variant b)
template <bool kShift>
__attribute__((target("avx512vbmi"))) double in_registers() {
  __m512i c[4], acc[8];
  for (int i = 0; i < 4; ++i) c[i] = _mm512_set1_epi32(i * 77 + 1);
  for (auto& a : acc) a = _mm512_setzero_si512();
  const __m512i t0 = _mm512_set1_epi32(0x01020304), t1 = _mm512_set1_epi32(0x05060708);
  const __m512i x = _mm512_set1_epi32(0x3f803f80), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i mlo = _mm512_set1_epi16(0x00FF), mhi = _mm512_set1_epi16(static_cast<short>(0xFF00));
  const long n = 20000000;
  const double a0 = now_ns();
  for (long it = 0; it < n; ++it) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512i lo = _mm512_permutex2var_epi8(t0, c[i], t1);
      const __m512i hi =
          _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t1, c[i], t0), c[i], sign, 0xF8);
      __m512i wa, wb;
      if constexpr (kShift) {
        wa = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi16(hi, 8), mlo, 0xEA);  // (A&C)|B
        wb = _mm512_ternarylogic_epi32(_mm512_srli_epi16(lo, 8), hi, mhi, 0xF8);  // A|(B&C)
      } else {
        wa = _mm512_unpacklo_epi8(lo, hi);
        wb = _mm512_unpackhi_epi8(lo, hi);
      }
      acc[2 * i] = (__m512i)_mm512_dpbf16_ps((__m512)acc[2 * i], (__m512bh)wa, (__m512bh)x);
      acc[2 * i + 1] =
          (__m512i)_mm512_dpbf16_ps((__m512)acc[2 * i + 1], (__m512bh)wb, (__m512bh)x);
    }
    for (auto& v : c) asm volatile("" : "+v"(v));
  }
  const double ns = now_ns() - a0;
  __m512i s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm512_add_epi32(s, acc[i]);
  volatile int sink = _mm512_reduce_add_epi32(s);
  (void)sink;
  return ns / (n * 4.0);
}

double l1_rows() {
  using namespace fp8_gemv;
  constexpr int64_t K = 576, R = 64;
  std::vector<uint8_t> w(R * K);
  for (auto& c : w) c = static_cast<uint8_t>(rand() & 0xFF);
  for (auto& c : w)
    if ((c & 0x7F) == 0x7F) c = 0x10;  // no NaN codes
  std::vector<uint16_t> x(K, 0x3F80);
  const LookupTables t = make_lookup_tables(table(false), kFactor[0]);
  float sums[4], tot = 0.f;
  const long n = 100000;
  const double a0 = now_ns();
  for (long it = 0; it < n; ++it)
    for (int64_t r = 0; r < R; r += 4) {
      const uint8_t* p[4] = {&w[r * K], &w[(r + 1) * K], &w[(r + 2) * K], &w[(r + 3) * K]};
      rows_dot_lookup4(p, x.data(), 0, K, t, sums);
      tot += sums[0];
    }
  const double ns = now_ns() - a0;
  volatile float sink = tot;
  (void)sink;
  return ns / (n * R * K / 64.0);
}

}  // namespace

int main() {
  if (!fp8_gemv::lookup_supported()) {
    std::printf("no AVX-512 VBMI on this CPU: the lookup path does not run here\n");
    return 0;
  }
  for (int round = 0; round < 2; ++round)
    std::printf("ns per 64 codes: (a) lookup + unpack, registers %.3f | (b) lookup + shifts, "
                "registers %.3f | (c) rows_dot_lookup4, L1 rows %.3f\n",
                in_registers<false>(), in_registers<true>(), l1_rows());
}

#endif  // FP8_GEMV_LOOKUP
