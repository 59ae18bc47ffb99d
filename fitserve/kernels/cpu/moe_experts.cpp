// fitserve::moe_experts_ggml: every active expert of one sparse MoE layer in one call (llama.cpp's
// mul_mat_id, for the gated MLP): y[t] = sum_j w[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]),
// e = ids[t, j], with each expert's weights as stored (GGUF ggml blocks, stacked per projection:
// uint8 [E, rows, row bytes]).
//
//   1. the step's N * k slots (token t, choice j) sorted by expert (a stable counting sort);
//   2. x's N rows quantized once for the gate/up type (ggml_blocks_run.h's quantize), copied
//      into that order (one copy per slot);
//   3. gate_up: every active expert's (gate row n, up row I + n) pairs as one list of chunks,
//      split over the threads by cost and streamed with prefetch across expert boundaries
//      (stream_rows); each pair runs against the expert's slots in tiles of rows of x (each
//      weight row decoded once per tile) and silu(gate) * up is formed on the tile's results
//      -> act [N * k, I] fp32;
//   4. act quantized for the down type; down streamed the same way -> [N * k, H];
//   5. each token's k rows summed with its routing weights (j = 0 .. k-1) -> out [N, H] fp32
//      (out_x_dtype: rounded once to x's dtype).
// Only the active experts' bytes are read: at batch 1 exactly the k experts' rows. Each output
// is one item's work in one order, so the thread count does not change the bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "build_tier.h"
#include "ggml_blocks_iq4.h"
#include "ggml_blocks_kqrun.h"
#include "ggml_blocks_kquant.h"
#include "ggml_blocks_q5.h"
#include "ggml_blocks_run.h"
#include "moe_route.h"

namespace fitserve::moe {
namespace {

using ggml::Act;
using ggml::ActBuf;

// The step's slots grouped by expert: sorted row m holds slot order[m] (= t * k + j); expert
// e's rows are [start[e], start[e + 1]); active = the experts with at least one slot.
struct Groups {
  std::vector<int64_t> start, order, token, active;
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

// The rows of one projection over every active expert as one list of chunks (a few weight rows
// of one expert each), split over the threads by cost into contiguous spans: at batch 1 a thread
// streams its share of all k experts' rows back to back, the chunks `ahead` of it requested from
// memory across expert boundaries (short expert rows: 144..576 B per row).
//
//   active experts  e0          e1          e2   ...
//   chunks          |c|c|c|c|c| |c|c|c|c|c| |c|c|c ...      cost of a chunk ~ 2 + tokens(e)
//   threads         [---- thread 0 ----][---- thread 1 ----]  (equal cost)
//
// fn(e, n0, n1) runs weight rows [n0, n1) of expert e over all of e's tokens; a chunk's bytes are
// prefetched `ahead` chunks before its turn. pair_offset > 0: each row n also reads row
// n + pair_offset (gate and up rows together), prefetched as well.
struct RowList {
  const Groups& g;
  int64_t rows;        // rows of the projection per expert (I for gate/up pairs, H for down)
  int64_t expert_bytes, row_bytes, pair_offset;
  int64_t nb;          // rows per chunk
  int64_t per;         // chunks per expert
};

RowList make_row_list(const Groups& g, int64_t rows, int64_t row_bytes, int64_t pair_offset) {
  const int64_t span = pair_offset > 0 ? 2 : 1;
  // NOTE: ~2 KB of weights per chunk (4 Q4_K gate+up pairs of 1024 columns, 8 Q6_K rows of 256)
  const int64_t nb = std::clamp<int64_t>(2048 / (row_bytes * span), 1, 32);
  return {g, rows, (rows * span) * row_bytes, row_bytes, pair_offset, nb, (rows + nb - 1) / nb};
}

inline void prefetch_chunk(const RowList& L, const uint8_t* W, int64_t c) {
  const int64_t e = L.g.active[c / L.per], n0 = (c % L.per) * L.nb;
  const int64_t n1 = std::min(L.rows, n0 + L.nb);
  const uint8_t* base = W + e * L.expert_bytes;
  for (int64_t n = n0; n < n1; ++n) {
    ggml::prefetch_row(base, L.row_bytes, n);
    if (L.pair_offset > 0) ggml::prefetch_row(base, L.row_bytes, n + L.pair_offset);
  }
}

template <class F>
void stream_rows(const RowList& L, const uint8_t* W, F&& fn) {
  const int64_t A = static_cast<int64_t>(L.g.active.size()), chunks = A * L.per;
  if (chunks == 0) return;
  // chunk costs: the weight bytes once plus one dot per token (tile work)
  std::vector<int64_t> cost_end(A);  // cumulative cost at the end of each expert's chunks
  int64_t total = 0;
  for (int64_t a = 0; a < A; ++a) {
    const int64_t e = L.g.active[a];
    total += L.per * (2 + L.g.start[e + 1] - L.g.start[e]);
    cost_end[a] = total;
  }
  // NOTE: a span start at cost c -> the chunk where cost c falls (whole chunks per thread)
  auto chunk_at = [&](int64_t cost) -> int64_t {
    if (cost >= total) return chunks;
    const int64_t a = std::upper_bound(cost_end.begin(), cost_end.end(), cost) - cost_end.begin();
    const int64_t before = a == 0 ? 0 : cost_end[a - 1];
    const int64_t e = L.g.active[a];
    return a * L.per + (cost - before) / (2 + L.g.start[e + 1] - L.g.start[e]);
  };
  const int64_t threads = std::clamp<int64_t>(at::get_num_threads(), 1, chunks);
  const int64_t chunk_bytes = L.nb * L.row_bytes * (L.pair_offset > 0 ? 2 : 1);
  // NOTE: >= 4 KB requested ahead of the rows being computed (a DRAM latency's worth at a
  // core's share of the bandwidth; fp8_gemv.cpp / rows_streamed measured the same depth)
  const int64_t ahead = std::max<int64_t>(1, (4096 + chunk_bytes - 1) / chunk_bytes);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = chunk_at(total * t / threads), c1 = chunk_at(total * (t + 1) / threads);
      for (int64_t c = c0; c < std::min(c1, c0 + ahead); ++c) prefetch_chunk(L, W, c);
      for (int64_t c = c0; c < c1; ++c) {
        if (c + ahead < c1) prefetch_chunk(L, W, c + ahead);
        const int64_t n0 = (c % L.per) * L.nb;
        fn(L.g.active[c / L.per], n0, std::min(L.rows, n0 + L.nb));
      }
    }
  });
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

// act[m, n] = silu(gate_e row n . x_m) * (up_e row n . x_m) for sorted rows m of each active
// expert e (gate rows [0, I), up rows [I, 2I) of W = [E, 2I, row bytes]): one pass over x per
// row pair, the SwiGLU on the tile's registers.
template <class T>
void experts_gate_up(const Act& a, const Groups& g, const uint8_t* W, int64_t I, float* act) {
  const int64_t nblk = a.K / T::kQK, rb = nblk * T::kBytes;
  const RowList L = make_row_list(g, I, rb, I);
  stream_rows(L, W, [&](int64_t e, int64_t n0, int64_t n1) {
    const uint8_t* We = W + e * L.expert_bytes;
    for_tiles(g.start[e], g.start[e + 1], [&](auto mt, int64_t m) {
      constexpr int MT = decltype(mt)::value;
      float gate[MT], up[MT];
      int64_t n = n0;
      // NOTE: one token (W1): a K-quant tile of two gate rows and their two up rows, x read
      // once per super-block for the four and their lane sums reduced together (kq_tile keeps
      // row<1>'s bits). Not for MT > 1: adjacent rows of a longer tile made Q6_K's stream slower.
      if constexpr (ggml::kIsKQuant<T> && MT == 1) {
        float res[4];
        for (; n + 2 <= n1; n += 2) {
          const uint8_t* w[4] = {We + n * rb, We + (I + n) * rb, We + (n + 1) * rb,
                                 We + (I + n + 1) * rb};
          ggml::kq_tile<T, 4, 1>(w, nblk, a, m, res);
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
  });
}

// out[m, n] = expert e's weight row n . sorted activation row m (W = [E, rows, row bytes])
template <class T>
void experts_matmul(const Act& a, const Groups& g, const uint8_t* W, int64_t rows,
                    float* out) {
  const int64_t nblk = a.K / T::kQK, rb = nblk * T::kBytes;
  const RowList L = make_row_list(g, rows, rb, 0);
  stream_rows(L, W, [&](int64_t e, int64_t n0, int64_t n1) {
    const uint8_t* We = W + e * L.expert_bytes;
    for_tiles(g.start[e], g.start[e + 1], [&](auto mt, int64_t m) {
      constexpr int MT = decltype(mt)::value;
      float res[MT];
      int64_t n = n0;
      if constexpr (ggml::kIsKQuant<T> && MT == 1) {  // one token: 4 weight rows per tile
        float rt[4];
        for (; n + 4 <= n1; n += 4) {
          const uint8_t* w[4] = {We + n * rb, We + (n + 1) * rb, We + (n + 2) * rb,
                                 We + (n + 3) * rb};
          ggml::kq_tile<T, 4, 1>(w, nblk, a, m, rt);
          for (int j = 0; j < 4; ++j) out[m * rows + n + j] = rt[j];
        }
      }
      for (; n < n1; ++n) {
        T::template row<MT>(We + n * rb, nblk, a, m, res);
        for (int i = 0; i < MT; ++i) out[(m + i) * rows + n] = res[i];
      }
    });
  });
}

struct TypeInfo {
  const char* name;
  int64_t block, bytes, act_block;
  bool perm128;
  void (*gate_up)(const Act&, const Groups&, const uint8_t*, int64_t, float*);
  void (*matmul)(const Act&, const Groups&, const uint8_t*, int64_t, float*);
};

template <class T>
constexpr TypeInfo info(const char* name) {
  return {name, T::kQK, T::kBytes, T::kActBlock, T::kPerm128, &experts_gate_up<T>, &experts_matmul<T>};
}

const TypeInfo kTypes[] = {
    info<ggml::Q4K>("Q4_K"),     info<ggml::Q5K>("Q5_K"),  info<ggml::Q6K>("Q6_K"),
    info<ggml::Q5_0>("Q5_0"),    info<ggml::Q5_1>("Q5_1"), info<ggml::IQ4NL>("IQ4_NL"),
    info<ggml::IQ4XS>("IQ4_XS"),
};

const TypeInfo& type_info(const std::string& name) {
  for (const TypeInfo& t : kTypes)
    if (name == t.name) return t;
  TORCH_CHECK(false, "moe_experts_ggml: no kernel for GGML type ", name);
}

void check_stack(const at::Tensor& w, const TypeInfo& t, int64_t E, int64_t rows, int64_t cols,
                 const char* what) {
  TORCH_CHECK(cols > 0 && cols % t.block == 0, "moe_experts_ggml: ", what, " has ", cols,
              " columns, not a multiple of ", t.name, "'s block size ", t.block);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.dim() == 3 && w.size(0) == E && w.size(1) == rows &&
                  w.size(2) == cols / t.block * t.bytes,
              "moe_experts_ggml: ", what, " must be contiguous uint8 [E=", E, ", ", rows, ", ",
              cols / t.block * t.bytes, "] of ", t.name, ", got ", w.sizes(), " ",
              w.scalar_type());
}

// x's N token rows quantized once (into tok), then copied into the step's sorted slot order
// (into buf): a token is quantized once however many of the k experts it picked (same codes).
template <class X>
Act quantize_x(const at::Tensor& x, const Groups& g, const TypeInfo& t, ActBuf& tok,
               ActBuf& buf) {
  const int64_t N = x.size(0), K = x.size(1), M = static_cast<int64_t>(g.token.size());
  const Act a = ggml::quantize(x.data_ptr<X>(), N, K, t.act_block, t.perm128, tok);
  const int64_t nd = a.nd;
  if (static_cast<int64_t>(buf.q.size()) < M * K) buf.q.resize(M * K);
  if (static_cast<int64_t>(buf.d.size()) < M * nd) buf.d.resize(M * nd);
  if (static_cast<int64_t>(buf.ds.size()) < M * K / 32) buf.ds.resize(M * K / 32);
  if (static_cast<int64_t>(buf.s16.size()) < M * K / 16) buf.s16.resize(M * K / 16);
  if (static_cast<int64_t>(buf.s32.size()) < M * K / 32) buf.s32.resize(M * K / 32);
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t s = g.token[m];
      std::copy_n(a.qrow(s), K, buf.q.data() + m * K);
      std::copy_n(a.drow(s), nd, buf.d.data() + m * nd);
      std::copy_n(a.s16row(s), K / 16, buf.s16.data() + m * (K / 16));
      std::copy_n(a.s32row(s), K / 32, buf.s32.data() + m * (K / 32));
      std::copy_n(a.dsrow(s), K / 32, buf.ds.data() + m * (K / 32));
    }
  });
  return {buf.q.data(), buf.d.data(), buf.s16.data(), buf.s32.data(), buf.ds.data(), K, nd};
}

// out[t] = sum over j = 0 .. k-1 of w[t, j] * y[row of slot (t, j)], summed in fp32 from 0 in
// choice order, stored as O (fp32, or rounded once to x's bf16: the same bits as .to())
template <class O>
void combine(const std::vector<float>& y, const std::vector<int64_t>& row_of, const float* wp,
             int64_t N, int64_t k, int64_t H, O* op) {
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / H), [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = wp[t * k + j];
        const float* src = y.data() + row_of[t * k + j] * H;
        for (int64_t c = 0; c < H; ++c) acc[c] += w * src[c];
      }
      std::copy(acc.begin(), acc.end(), op + t * H);
    }
  });
}

at::Tensor moe_experts_ggml(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                            const at::Tensor& gate_up, const std::string& gate_up_type,
                            const at::Tensor& down, const std::string& down_type,
                            bool out_x_dtype) {
  const TypeInfo& tg = type_info(gate_up_type);
  const TypeInfo& td = type_info(down_type);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts_ggml: x must be a contiguous float32 / bfloat16 [N, H], got ",
              x.sizes(), " ", x.scalar_type());
  const int64_t N = x.size(0), H = x.size(1);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == N &&
                  ids.is_contiguous(),
              "moe_experts_ggml: ids must be contiguous int64 [N=", N, ", k], got ", ids.sizes(),
              " ", ids.scalar_type());
  const int64_t k = ids.size(1), E = gate_up.dim() == 3 ? gate_up.size(0) : 0;
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                  weights.sizes() == ids.sizes(),
              "moe_experts_ggml: weights must be contiguous float32 [N, k] like ids, got ",
              weights.sizes(), " ", weights.scalar_type());
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(1) % 2 == 0,
              "moe_experts_ggml: gate_up must be [E, 2I, row bytes], got ", gate_up.sizes());
  const int64_t I = gate_up.size(1) / 2;
  check_stack(gate_up, tg, E, 2 * I, H, "gate_up");
  check_stack(down, td, E, H, I, "down");
  // NOTE: out_x_dtype: the sum rounded straight to x's dtype (decode_layers without a shared
  // expert: no fp32 tensor and .to() call per layer)
  at::Tensor out = at::empty({N, H}, x.options().dtype(out_x_dtype ? x.scalar_type() : at::kFloat));
  if (N == 0) return out;
  if (k == 0) return out.zero_();

  const Groups g = group_slots(ids.data_ptr<int64_t>(), N * k, k, E);
  const int64_t M = N * k;
  // NOTE: scratch reused across calls (a decode step makes one call per layer)
  static thread_local ActBuf buf_tok, buf_x, buf_h;
  static thread_local std::vector<float> act, y;
  act.resize(M * I);
  y.resize(M * H);
  const Act ax = x.scalar_type() == at::kBFloat16 ? quantize_x<c10::BFloat16>(x, g, tg, buf_tok, buf_x)
                                                  : quantize_x<float>(x, g, tg, buf_tok, buf_x);
  tg.gate_up(ax, g, gate_up.data_ptr<uint8_t>(), I, act.data());
  const Act ah = ggml::quantize(act.data(), M, I, td.act_block, td.perm128, buf_h);
  td.matmul(ah, g, down.data_ptr<uint8_t>(), H, y.data());

  // the weighted sum of each token's k rows, in choice order j = 0 .. k-1
  std::vector<int64_t> row_of(M);
  for (int64_t m = 0; m < M; ++m) row_of[g.order[m]] = m;
  const float* wp = weights.data_ptr<float>();
  if (out.scalar_type() == at::kBFloat16)
    combine(y, row_of, wp, N, k, H, out.data_ptr<c10::BFloat16>());
  else
    combine(y, row_of, wp, N, k, H, out.data_ptr<float>());
  if (buf_x.q.size() > (size_t{1} << 24)) buf_x = ActBuf();
  if (buf_tok.q.size() > (size_t{1} << 24)) buf_tok = ActBuf();  // a large prefill's: freed
  if (buf_h.q.size() > (size_t{1} << 24)) buf_h = ActBuf();
  if (y.size() > (size_t{1} << 22)) y = std::vector<float>(), act = std::vector<float>();
  return out;
}

std::vector<std::string> moe_experts_types() {
  std::vector<std::string> v;
  for (const TypeInfo& t : kTypes) v.emplace_back(t.name);
  return v;
}

std::string moe_experts_tier() { return build_tier_name(); }

}  // namespace
}  // namespace fitserve::moe

TORCH_LIBRARY_FRAGMENT(fitserve, m) {
  m.def("moe_experts_ggml(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, "
        "str gate_up_type, Tensor down, str down_type, bool out_x_dtype=False) -> Tensor");
  m.def("moe_route(Tensor logits, int k, bool renormalize) -> (Tensor, Tensor)");
  m.def("moe_experts_types() -> str[]", &fitserve::moe::moe_experts_types);
  m.def("moe_experts_tier() -> str", &fitserve::moe::moe_experts_tier);
}

TORCH_LIBRARY_IMPL(fitserve, CPU, m) {
  m.impl("moe_experts_ggml", &fitserve::moe::moe_experts_ggml);
  m.impl("moe_route", &fitserve::moe::moe_route);
}
