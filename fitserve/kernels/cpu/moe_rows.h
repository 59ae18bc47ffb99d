// moe_experts.cpp's row work: the step's slots grouped by expert, and the rows of one expert
// projection (gate/up pairs with the SwiGLU, or down) run over that expert's tokens, chunk by
// chunk, with the chunks of a thread's share prefetched ahead across expert (and projection)
// boundaries. Each output is one tile's work in one fixed order (rows_range's tiling), so
// neither the thread count nor the way chunks are shared out changes the bits.
// Included by moe_experts.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "ggml_blocks_kqrun.h"
#include "ggml_blocks_kquant.h"
#include "ggml_blocks_lanes.h"
#include "ggml_blocks_run.h"

namespace fitserve::moe {
namespace {

using ggml::Act;
using ggml::ActBuf;
using ggml::act_buffer;

// The step's slots grouped by expert: sorted row m holds slot order[m] (= t * k + j); expert
// e's rows are [start[e], start[e + 1]); active = the experts with at least one slot.
struct Groups {
  std::vector<int64_t> start, order, token, active;
  int64_t tokens(int64_t e) const { return start[e + 1] - start[e]; }
};

Groups group_slots(const int64_t* ids, int64_t slots, int64_t k, int64_t E) {
  Groups g;
  g.start.assign(E + 1, 0);
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < E, "moe_experts_ggml: expert id ", ids[s],
                " out of range [0, ", E, ")");
    ++g.start[ids[s] + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    if (g.start[e + 1] > 0) g.active.push_back(e);
    g.start[e + 1] += g.start[e];
  }
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  g.order.resize(slots);
  g.token.resize(slots);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t m = fill[ids[s]]++;
    g.order[m] = s;
    g.token[m] = s / k;
  }
  return g;
}

// fn(e, n0, n1): weight rows [n0, n1) of expert e over all of e's sorted rows of x.
using RowFn = void (*)(const Act& a, const Groups& g, const uint8_t* W, int64_t rows, int64_t e,
                       int64_t n0, int64_t n1, float* out);

// The rows of one projection over every active expert as one list of chunks (a few weight rows
// of one expert each): chunk c is expert active[c / per]'s rows [(c % per) * nb, + nb).
//
//   active experts  e0          e1          e2   ...
//   chunks          |c|c|c|c|c| |c|c|c|c|c| |c|c|c ...      cost of a chunk ~ 2 + tokens(e)
//
// pair_offset > 0: each row n also reads row n + pair_offset (gate and up rows together).
struct RowList {
  const Groups& g;
  const uint8_t* W;
  int64_t rows;        // rows of the projection per expert (I for gate/up pairs, H for down)
  int64_t expert_bytes, row_bytes, pair_offset;
  int64_t nb;          // rows per chunk
  int64_t per;         // chunks per expert
  RowFn fn;
  const Act* a;
  float* out;

  void run(int64_t c) const {
    const int64_t n0 = (c % per) * nb;
    fn(*a, g, W, rows, g.active[c / per], n0, std::min(rows, n0 + nb), out);
  }
  void prefetch(int64_t c) const {
    const int64_t e = g.active[c / per], n0 = (c % per) * nb, n1 = std::min(rows, n0 + nb);
    const uint8_t* base = W + e * expert_bytes;
    for (int64_t n = n0; n < n1; ++n) {
      ggml::prefetch_row(base, row_bytes, n);
      if (pair_offset > 0) ggml::prefetch_row(base, row_bytes, n + pair_offset);
    }
  }
  int64_t chunk_bytes() const { return nb * row_bytes * (pair_offset > 0 ? 2 : 1); }
};

RowList make_row_list(const Groups& g, const uint8_t* W, int64_t rows, int64_t row_bytes,
                      int64_t pair_offset, RowFn fn, const Act* a, float* out) {
  const int64_t span = pair_offset > 0 ? 2 : 1;
  // NOTE: >= ~2 KB of weights per chunk in whole one-token tiles (gate_up_rows' two row pairs,
  // down_rows' four rows). Chunks of 2048 / pair bytes alone held ONE Q4_K gate+up pair at 1024
  // columns (1152 bytes), so the bench model's W1 never reached the four-row tile: one layer's
  // 8 experts in cache 295 -> 222 us on one Zen 4 core (bench_moe_op.py --hot).
  const int64_t tile = span == 2 ? 2 : 4;
  const int64_t fit = std::max<int64_t>(1, 2048 / (row_bytes * span));
  const int64_t nb = std::min<int64_t>(32, (fit + tile - 1) / tile * tile);
  return {g, W, rows, (rows * span) * row_bytes, row_bytes, pair_offset, nb,
          (rows + nb - 1) / nb, fn, a, out};
}

// NOTE: >= 4 KB requested ahead of the rows being computed (a DRAM latency's worth at a core's
// share of the bandwidth; fp8_gemv.cpp / rows_streamed measured the same depth)
inline int64_t chunks_ahead(int64_t chunk_bytes) {
  return std::max<int64_t>(1, (4096 + chunk_bytes - 1) / chunk_bytes);
}

// The order a thread visits chunks [c0, c1) in: kStreams equal runs of them taken in turn (run
// 0's first chunk, run 1's first, ..., run 0's second, ...). NOTE: one core's reads stream at
// ~10.7 GB/s through one run of weight rows on the Xeon; four runs in flight (at W1 with 8 of
// 64 experts on 2 threads, one per expert of a thread's share) took the Qwen3-MoE bench model's
// expert op from ~5.1 to ~4.6 ms a step. Each output is still one chunk's work, so the order
// does not change the bits.
constexpr int64_t kStreams = 4;

inline void visit_order(int64_t c0, int64_t c1, std::vector<int64_t>& order) {
  const int64_t n = c1 - c0, q = (n + kStreams - 1) / kStreams;
  order.clear();
  for (int64_t i = 0; i < q; ++i)
    for (int64_t s = 0; s < kStreams; ++s)
      if (s * q + i < n) order.push_back(c0 + s * q + i);
}

// Chunks [c0, c1) of L run in visit_order, each prefetched `ahead` visits before its turn; the
// prefetches that would run past the last go to `next`'s chunks [n0, n1) in their own visit
// order (the projection this thread runs after, so its first rows are on the way while this
// one finishes).
inline void run_chunks(const RowList& L, int64_t c0, int64_t c1, const RowList* next = nullptr,
                       int64_t n0 = 0, int64_t n1 = 0) {
  static thread_local std::vector<int64_t> order, later;
  visit_order(c0, c1, order);
  visit_order(next != nullptr ? n0 : 0, next != nullptr ? n1 : 0, later);
  const int64_t n = c1 - c0, ahead = chunks_ahead(L.chunk_bytes());
  auto request = [&](int64_t k) {
    if (k < n) L.prefetch(order[k]);
    else if (k - n < static_cast<int64_t>(later.size())) next->prefetch(later[k - n]);
  };
  for (int64_t k = 0; k < std::min(n, ahead); ++k) L.prefetch(order[k]);
  for (int64_t k = 0; k < n; ++k) {
    request(k + ahead);
    L.run(order[k]);
  }
}

// fn(std::integral_constant<int, MT>, m) over the row tiles of [m0, m1): kTileRows, then 4, 2,
// 1 rows (ggml_blocks_run.h rows_range's tiling, so a row's bits do not depend on the split)
template <class F>
inline void for_tiles(int64_t m0, int64_t m1, F&& fn) {
  int64_t m = m0;
  for (; m + ggml::kTileRows <= m1; m += ggml::kTileRows)
    fn(std::integral_constant<int, ggml::kTileRows>{}, m);
  if constexpr (ggml::kTileRows > 4) {
    if (m + 4 <= m1) {
      fn(std::integral_constant<int, 4>{}, m);
      m += 4;
    }
  }
  if (m + 2 <= m1) {
    fn(std::integral_constant<int, 2>{}, m);
    m += 2;
  }
  if (m < m1) fn(std::integral_constant<int, 1>{}, m);
}

// Whether T runs four weight rows against one row of x in one tile (row4): the K-quants'
// kq_tile and, on VNNI, the 32-column block types' lanes_rows_m1; each output has row<1>'s bits.
template <class T>
constexpr bool kRow4 = ggml::kIsKQuant<T>
#ifdef FS_GGML_VNNI
                       || ggml::lanes_m1<T>::value
#endif
    ;

template <class T>
[[gnu::always_inline]] inline void row4(const uint8_t* const* w, int64_t nblk, const ggml::Act& a,
                                        int64_t m, float* res) {
#ifdef FS_GGML_VNNI
  if constexpr (ggml::lanes_m1<T>::value) {
    ggml::lanes_rows_m1<T, 4>(w, nblk, a, m, res, ggml::kLanesAhead);
    return;
  }
#endif
  if constexpr (ggml::kIsKQuant<T>) ggml::kq_tile<T, 4, 1>(w, nblk, a, m, res);
}

// act[m, n] = silu(gate_e row n . x_m) * (up_e row n . x_m) for rows n in [n0, n1) and expert
// e's sorted rows m (gate rows [0, I), up rows [I, 2I) of W = [E, 2I, row bytes]): one pass over
// x per row pair, the SwiGLU on the tile's registers.
template <class T>
void gate_up_rows(const Act& a, const Groups& g, const uint8_t* W, int64_t I, int64_t e,
                  int64_t n0, int64_t n1, float* act) {
  const int64_t nblk = a.K / T::kQK, rb = nblk * T::kBytes;
  const uint8_t* We = W + e * 2 * I * rb;
  for_tiles(g.start[e], g.start[e + 1], [&](auto mt, int64_t m) {
    constexpr int MT = decltype(mt)::value;
    float gate[MT], up[MT];
    int64_t n = n0;
    // NOTE: one token (W1): a K-quant tile of two gate rows and their two up rows, x read
    // once per super-block for the four and their lane sums reduced together (kq_tile keeps
    // row<1>'s bits). Not for MT > 1: adjacent rows of a longer tile made Q6_K's stream slower.
    if constexpr (kRow4<T> && MT == 1) {
      float res[4];
      for (; n + 2 <= n1; n += 2) {
        const uint8_t* w[4] = {We + n * rb, We + (I + n) * rb, We + (n + 1) * rb,
                               We + (I + n + 1) * rb};
        row4<T>(w, nblk, a, m, res);
        for (int j = 0; j < 2; ++j)
          act[m * I + n + j] = res[2 * j] / (1.f + std::exp(-res[2 * j])) * res[2 * j + 1];
      }
    }
    for (; n < n1; ++n) {
      T::template row<MT>(We + n * rb, nblk, a, m, gate);
      T::template row<MT>(We + (I + n) * rb, nblk, a, m, up);
      for (int i = 0; i < MT; ++i)
        act[(m + i) * I + n] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
}

// out[m, n] = expert e's weight row n . sorted activation row m for rows n in [n0, n1)
// (W = [E, rows, row bytes])
template <class T>
void down_rows(const Act& a, const Groups& g, const uint8_t* W, int64_t rows, int64_t e,
               int64_t n0, int64_t n1, float* out) {
  const int64_t nblk = a.K / T::kQK, rb = nblk * T::kBytes;
  const uint8_t* We = W + e * rows * rb;
  for_tiles(g.start[e], g.start[e + 1], [&](auto mt, int64_t m) {
    constexpr int MT = decltype(mt)::value;
    float res[MT];
    int64_t n = n0;
    if constexpr (kRow4<T> && MT == 1) {  // one token: 4 weight rows per tile
      float rt[4];
      for (; n + 4 <= n1; n += 4) {
        const uint8_t* w[4] = {We + n * rb, We + (n + 1) * rb, We + (n + 2) * rb,
                               We + (n + 3) * rb};
        row4<T>(w, nblk, a, m, rt);
        for (int j = 0; j < 4; ++j) out[m * rows + n + j] = rt[j];
      }
    }
    for (; n < n1; ++n) {
      T::template row<MT>(We + n * rb, nblk, a, m, res);
      for (int i = 0; i < MT; ++i) out[(m + i) * rows + n] = res[i];
    }
  });
}

}  // namespace
}  // namespace fitserve::moe
