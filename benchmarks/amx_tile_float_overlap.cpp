// Does the AMX tile unit run beside the AVX-512 float step of the held int4 kernel
// (fitserve/kernels/cpu/qlinear_amx.h)? A stand-alone loop of its shape, one thread:
//
//   g++ -O2 -ffp-contract=off -mavx512f -mavx512bw -mamx-tile -mamx-int8 \
//       benchmarks/amx_tile_float_overlap.cpp -o /tmp/amx_overlap && /tmp/amx_overlap
//
// Per 32-column group: four 16 x 16 x 32 tile dots (two row tiles x two panels: A and B tiles
// shared), their int32 sums stored (double-buffered, so the float step reads the group before),
// and the canonical float step of each output (qlinear_rows.h: cvt, fl(d * da), the product,
// the offset fl(c * S), two adds). Prints ns per 16 x 16 x 32 tile-group for: all of it, the
// tiles and stores alone, the float step alone, the tiles without stores, and tiles (no stores)
// beside the float step. If the two units overlapped, "all" would be near the larger part; on
// the Xeon of docs/benchmarks.md (seventh / eighth sessions) it is their sum.
// -DFMA_STEP: the float step with two FMAs instead of its separate products and adds (not the
// canonical order; what such an order would save). Exits 0 without output where the OS refuses
// the tile state (no AMX).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kGroups = 18;  // K = 576 (SmolLM2-135M's hidden size)
constexpr int64_t kStride = 576;
alignas(64) int8_t A[2][16 * kStride];
alignas(64) uint8_t B[2][kGroups * 512];
alignas(64) int32_t C[2][4][256];
alignas(64) float acc[4][256];
float da[32 * kGroups], sg[32 * kGroups], dv[2 * kGroups * 16], cv[2 * kGroups * 16];

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;
  TileConfig cfg;
  for (int t : {0, 1, 2, 3}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t : {4, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 32;
  for (int t : {6, 7}) cfg.rows[t] = 8, cfg.colsb[t] = 64;
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  std::memset(A, 1, sizeof A);
  std::memset(B, 1, sizeof B);
  for (auto& v : da) v = 0.01f;
  for (auto& v : sg) v = 0.02f;
  for (auto& v : dv) v = 0.5f;
  for (auto& v : cv) v = 0.3f;
  const long iters = 200000;
  const char* names[] = {"tiles + stores + float", "tiles + stores", "float step only",
                         "tiles only (no stores)", "tiles (no stores) + float"};
  for (int mode = 0; mode < 5; ++mode) {
    const bool tiles = mode != 2, stores = mode <= 1, fl = mode == 0 || mode == 2 || mode == 4;
    const auto t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < iters; ++it) {
      for (int g = 0; g < kGroups; ++g) {
        if (tiles) {
          _tile_loadd(4, A[0] + g * 32, kStride);
          _tile_loadd(6, B[0] + g * 512, 64);
          _tile_zero(0);
          _tile_dpbsud(0, 4, 6);
          _tile_loadd(7, B[1] + g * 512, 64);
          _tile_zero(1);
          _tile_dpbsud(1, 4, 7);
          _tile_loadd(5, A[1] + g * 32, kStride);
          _tile_zero(2);
          _tile_dpbsud(2, 5, 6);
          _tile_zero(3);
          _tile_dpbsud(3, 5, 7);
          if (stores) {
            _tile_stored(0, C[g & 1][0], 64);
            _tile_stored(1, C[g & 1][1], 64);
            _tile_stored(2, C[g & 1][2], 64);
            _tile_stored(3, C[g & 1][3], 64);
          }
        }
        if (!fl) continue;
        const int prev = (g + 1) & 1;  // the sums stored for the group before
        for (int j = 0; j < 4; ++j) {
          const __m512 d = _mm512_loadu_ps(dv + (j & 1) * kGroups * 16 + g * 16);
          const __m512 c = _mm512_loadu_ps(cv + (j & 1) * kGroups * 16 + g * 16);
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) {
            const int m = (j >> 1) * 16 + r;
            const __m512 ci = _mm512_cvtepi32_ps(_mm512_load_si512(C[prev][j] + r * 16));
            const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(da[m * kGroups + g]));
            const __m512 a = _mm512_load_ps(acc[j] + r * 16);
#ifdef FMA_STEP
            const __m512 t = _mm512_fmadd_ps(ci, s, a);
            _mm512_store_ps(acc[j] + r * 16,
                            _mm512_fmadd_ps(c, _mm512_set1_ps(sg[m * kGroups + g]), t));
#else
            const __m512 t = _mm512_mul_ps(ci, s);
            const __m512 off = _mm512_mul_ps(c, _mm512_set1_ps(sg[m * kGroups + g]));
            _mm512_store_ps(acc[j] + r * 16, _mm512_add_ps(a, _mm512_add_ps(t, off)));
#endif
          }
        }
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double groups = iters * kGroups * 4.0;
    std::printf("%-28s %6.2f ns per 16 x 16 x 32 tile-group (%5.0f GMAC/s)\n", names[mode],
                s / groups * 1e9, groups * 8192 / s / 1e9);
  }
  _tile_release();
  std::printf("(checksum %g)\n", static_cast<double>(acc[0][0]));
  return 0;
}
