// The row-tile driver and the activation scratch of the ggml block kernels, shared by
// ggml_blocks.cpp (one weight matrix per call) and moe_experts.cpp (every active expert of a
// layer in one call): rows_tile runs weight rows [n0, n1) of one matrix against MT rows of the
// quantized activations, each weight row decoded once per tile (the per-type row<MT> of
// ggml_blocks_kquant.h, _q5.h, _iq4.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ggml_blocks_act.h"
#include "stream_prefetch.h"

namespace fitserve::ggml {

// NOTE: rows of x per tile: 8 where AVX-512VL gives 32 vector registers (two accumulators per
// row stay in registers), 4 with AVX2's 16
#ifdef FS_GGML_AVX512
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 4;
#endif

// Weight rows per parallel block: a multiple of 4, 4..32, >= 4 blocks per thread.
inline int64_t block_rows(int64_t N) {
  const int64_t want = N / (4 * std::max<int64_t>(1, at::get_num_threads()));
  return std::clamp<int64_t>((want / 4) * 4, 4, 32);
}

template <class T, int MT>
void rows_tile(const uint8_t* W, int64_t row_bytes, int64_t nblk, const Act& a, int64_t m0,
               int64_t n0, int64_t n1, int64_t N, float* out) {
  float res[MT];
  for (int64_t n = n0; n < n1; ++n) {
    // NOTE: the row after next is prefetched: rows are short (1-2 KB) and a decode step streams
    // every weight from DRAM once, next to x's and the output's streams
    if (n + 2 < n1) {
      const uint8_t* nx = W + (n + 2) * row_bytes;
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(nx + o, 0, 0);
    }
    T::template row<MT>(W + n * row_bytes, nblk, a, m0, res);
    for (int i = 0; i < MT; ++i) out[(m0 + i) * N + n] = res[i];
  }
}

// Every byte of weight row n requested from memory ahead of its use (one hint per 64 B line).
inline void prefetch_row(const uint8_t* W, int64_t row_bytes, int64_t n) {
  const uint8_t* r = W + n * row_bytes;
  for (int64_t o = 0; o < row_bytes; o += 64) prefetch_stream(r + o);
}

// Whether T's row<1> takes a prefetch distance (row(w, nb, a, m0, res, pf): each step requests
// the bytes pf ahead of those it reads) -- the VNNI rows of IQ4_XS (the 32-column
// block types run rows_quarters at M = 1 on VNNI: ggml_blocks.cpp).
template <class T, class = void>
struct has_row_prefetch : std::false_type {};
template <class T>
struct has_row_prefetch<T, std::void_t<decltype(T::kRowPrefetch)>>
    : std::bool_constant<T::kRowPrefetch> {};

// One row of x (a decode step) against weight rows [n0, n1), a thread's whole share.
// NOTE: as fp8_gemv.cpp's few-row path: the rows go as two interleaved halves, each row
// requested `ahead` rows (>= 4 KB) before its turn, two streams in flight instead of one (a
// decode step streams every weight from DRAM once). Each output runs row<1>, as rows_range's
// tile of one: the same bits. Rows over kStreamedRowMax bytes take rows_range (a whole-row
// burst of 8 KB streamed worse than the hardware's own prefetch in fp8_gemv's measurements),
// unless T's row prefetches as it goes (has_row_prefetch): then each half is one stream
// requested kPrefetchBytes ahead of its reads, a few lines per step (no burst), any row length.
constexpr int64_t kStreamedRowMax = 4096;
constexpr int64_t kPrefetchBytes = 4096;

template <class T>
constexpr bool streams_m1(int64_t row_bytes) {
  return has_row_prefetch<T>::value || row_bytes <= kStreamedRowMax;
}

template <class T>
void rows_streamed(const uint8_t* W, int64_t row_bytes, int64_t nblk, const Act& a, int64_t n0,
                   int64_t n1, float* out) {
  const int64_t half = (n1 - n0 + 1) / 2, mid = n0 + half;
  float res[1];
  if constexpr (has_row_prefetch<T>::value) {
    prefetch_span(W + n0 * row_bytes, std::min(kPrefetchBytes, half * row_bytes));
    if (mid < n1) prefetch_span(W + mid * row_bytes, std::min(kPrefetchBytes, half * row_bytes));
    for (int64_t i = 0; i < half; ++i) {
      T::template row<1>(W + (n0 + i) * row_bytes, nblk, a, 0, res, kPrefetchBytes);
      out[n0 + i] = res[0];
      if (mid + i < n1) {
        T::template row<1>(W + (mid + i) * row_bytes, nblk, a, 0, res, kPrefetchBytes);
        out[mid + i] = res[0];
      }
    }
    return;
  }
  const int64_t ahead = std::clamp<int64_t>(4096 / std::max<int64_t>(1, row_bytes), 2, 16);
  for (int64_t i = 0; i < ahead && i < half; ++i) {
    prefetch_row(W, row_bytes, n0 + i);
    if (mid + i < n1) prefetch_row(W, row_bytes, mid + i);
  }
  for (int64_t i = 0; i < half; ++i) {
    if (i + ahead < half) prefetch_row(W, row_bytes, n0 + i + ahead);
    if (mid + i + ahead < n1) prefetch_row(W, row_bytes, mid + i + ahead);
    T::template row<1>(W + (n0 + i) * row_bytes, nblk, a, 0, res);
    out[n0 + i] = res[0];
    if (mid + i < n1) {
      T::template row<1>(W + (mid + i) * row_bytes, nblk, a, 0, res);
      out[mid + i] = res[0];
    }
  }
}

// The GEMV (one row of x) over weight rows [n0, n1), a thread's share, as four quarters: row i
// of each quarter in one 4-row tile (tile4(w[4], res[4]): x read once per step for the four),
// each quarter a sequential DRAM stream prefetched ahead by its rows. The last quarter is
// short: the other three's last rows go one by one through T::row<1>, whose bits tile4 keeps.
// NOTE: four quarters rather than rows i, i+1 of two halves (4 rows, 2 streams): those streams
// jump between two rows at every step, and the K-quants' 2048x2048 rows from DRAM fell from
// 0.82-0.89 of a plain read to 0.65-0.79; as quarters 1.02 (one thread, CPU clock,
// bench_ggml_blocks --vs-read, loaded host).
template <class T, class Tile4>
void rows_quarters(const uint8_t* W, int64_t row_bytes, int64_t nblk, const Act& a, int64_t n0,
                   int64_t n1, float* out, Tile4&& tile4) {
  const int64_t q = (n1 - n0 + 3) / 4;
  float res[4];
  int64_t i = 0;
  for (; n0 + 3 * q + i < n1; ++i) {
    const uint8_t* w4[4];
    for (int j = 0; j < 4; ++j) w4[j] = W + (n0 + j * q + i) * row_bytes;
    tile4(w4, res);
    for (int j = 0; j < 4; ++j) out[n0 + j * q + i] = res[j];
  }
  for (; i < q; ++i)
    for (int64_t n = n0 + i; n < std::min(n1, n0 + 3 * q); n += q) {
      T::template row<1>(W + n * row_bytes, nblk, a, 0, res);
      out[n] = res[0];
    }
}

// Weight rows [n0, n1) against activation rows [m0, m1): tiles of kTileRows rows of x, then
// 4, 2, 1; out[m * N + n].
template <class T>
void rows_range(const uint8_t* W, int64_t row_bytes, int64_t nblk, const Act& a, int64_t m0,
                int64_t m1, int64_t n0, int64_t n1, int64_t N, float* out) {
  int64_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows)
    rows_tile<T, kTileRows>(W, row_bytes, nblk, a, m, n0, n1, N, out);
  if constexpr (kTileRows > 4) {
    if (m + 4 <= m1) {
      rows_tile<T, 4>(W, row_bytes, nblk, a, m, n0, n1, N, out);
      m += 4;
    }
  }
  if (m + 2 <= m1) {
    rows_tile<T, 2>(W, row_bytes, nblk, a, m, n0, n1, N, out);
    m += 2;
  }
  if (m < m1) rows_tile<T, 1>(W, row_bytes, nblk, a, m, n0, n1, N, out);
}

// Scratch of the quantized activations, reused across calls (a decode step makes hundreds).
struct ActBuf {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int16_t> s16, s32;
};

// Rows of codes past M that act_buffer keeps allocated: a 16-row AMX tile of x's codes loaded at
// the last rows stays inside the buffer (ggml_blocks_kqamx.h; their values are never used).
constexpr int64_t kActRowPad = 15;

// buf sized for M rows of K columns quantized with `block`, and the Act over it (its rows are
// filled by quantize below, or by the MoE kernels' own row loops).
inline Act act_buffer(ActBuf& buf, int64_t M, int64_t K, int64_t block, bool lanes_t = false) {
  const int64_t nd = K / block;
  if (static_cast<int64_t>(buf.q.size()) < (M + kActRowPad) * K) buf.q.resize((M + kActRowPad) * K);
  if (static_cast<int64_t>(buf.d.size()) < M * nd) buf.d.resize(M * nd);
  if (static_cast<int64_t>(buf.ds.size()) < M * K / 32) buf.ds.resize(M * K / 32);
  if (static_cast<int64_t>(buf.s16.size()) < M * K / 16) buf.s16.resize(M * K / 16);
  if (static_cast<int64_t>(buf.s32.size()) < M * K / 32) buf.s32.resize(M * K / 32);
  return {buf.q.data(), buf.d.data(), buf.s16.data(), buf.s32.data(), buf.ds.data(), K, nd,
          lanes_t};
}

// x's rows quantized into buf: row m of the result is x's row m, or x's row rows[m] when a
// row index is given (the MoE kernel's tokens in expert order).
template <class X>
inline Act quantize(const X* x, int64_t M, int64_t K, int64_t block, bool perm128, ActBuf& buf,
                    const int64_t* rows = nullptr, bool lanes_t = false) {
  const int64_t nd = K / block;
  const Act act = act_buffer(buf, M, K, block, lanes_t);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + (rows ? rows[m] : m) * K, K, block, perm128, buf.q.data() + m * K,
                   buf.d.data() + m * nd, buf.s16.data() + m * K / 16,
                   buf.s32.data() + m * K / 32, buf.ds.data() + m * K / 32, lanes_t);
  });
  return act;
}

}  // namespace fitserve::ggml
