// Fused paged decode attention on the CPU: one query token per sequence, K/V read in place
// through the block table (no gather copy), online softmax in fp32, GQA heads processed together.
//
// Cache layout (head-major, per layer):   k_cache, v_cache [Hkv, num_blocks, block_size, D]
// Block table: block_tables[b, j] is the cache block holding positions j*bs .. j*bs+bs-1 of b.
//
//   token t of sequence b  ->  k_cache[h, block_tables[b, t / bs], t % bs, :]
//
// Work items are (sequence b, KV head h, partition p). A partition is a fixed range of absolute
// key positions [p*P, (p+1)*P) clipped to the keys the query sees, [lo, L) with
// lo = max(0, L - window) for a sliding window (a query at position L-1 sees keys j with
// (L-1) - j < window). Each item computes, for the G = Hq / Hkv query heads of KV head h:
//
//   m_g = max_j s_gj,  l_g = sum_j exp(s_gj - m_g),  acc_g = sum_j exp(s_gj - m_g) v_j
//
// over its keys, tile by tile (kTile keys: scores, running max/sum rescale, P@V), reading each
// K and V row once for the whole group. A sequence with one partition writes acc / l directly;
// one with several keeps (acc, m, l) per partition and a second pass merges them exactly:
//
//   M = max_p m_p,  out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p
//
// NOTE: partitions are fixed spans of absolute positions (vLLM's paged_attention_v2 does the
// same with 512), not a split count chosen from the batch: the summation order for one sequence
// then depends only on its own length, never on the batch around it or the thread count, so the
// kernel is bitwise batch-invariant, and long contexts at batch 1 still fill every core.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

// the ISA tier macros (FS_AVX512, FS_AVX2, FS_BF16DOT) and the fp32 SIMD tile pieces
#include "paged_attention_simd.h"
// the next tile's lines requested a share at a time (LineQueue) or at once (prefetch_stream)
#include "line_queue.h"
#include "stream_prefetch.h"

// The AMX-BF16 tile (paged_attention_amx.h) where the build has it.
#if FS_BF16DOT && defined(FITSERVE_AMX_BF16) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define FS_AMX_ATTN 1
#else
#define FS_AMX_ATTN 0
#endif
#include "amx_state.h"

namespace {


// Everything one work item needs to find its rows.
struct Geometry {
  int64_t num_kv, group, head_dim, dpad, block_size, max_blocks, partition, window;
  int64_t q_stride_b, q_stride_h, out_stride_b;
  int64_t k_stride_h, k_stride_blk, k_stride_tok;
  int64_t v_stride_h, v_stride_blk, v_stride_tok;
  float scale;
};

// The geometry both ops (decode, and the prefill op of paged_prefill.h) compute the same way:
// q [rows, Hq, D], caches [Hkv, blocks, block_size, D] with any strides.
inline Geometry make_geometry(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, int64_t num_heads, int64_t num_kv,
                              int64_t head_dim, int64_t block_size, int64_t max_blocks,
                              int64_t partition, int64_t window, double scale) {
  Geometry g{};
  g.num_kv = num_kv;
  g.group = num_heads / num_kv;
  g.head_dim = head_dim;
  g.dpad = (head_dim + kLanes - 1) / kLanes * kLanes;
  g.block_size = block_size;
  g.max_blocks = max_blocks;
  g.partition = partition;
  g.window = window;
  g.q_stride_b = q.stride(0);
  g.q_stride_h = q.stride(1);
  g.out_stride_b = num_heads * head_dim;
  g.k_stride_h = k_cache.stride(0);
  g.k_stride_blk = k_cache.stride(1);
  g.k_stride_tok = k_cache.stride(2);
  g.v_stride_h = v_cache.stride(0);
  g.v_stride_blk = v_cache.stride(1);
  g.v_stride_tok = v_cache.stride(2);
  g.scale = static_cast<float>(scale);
  return g;
}

// Per-thread scratch: the group's scaled queries, fp32 K/V tile rows, scores, accumulators.
// Sized for the largest (group, dpad) seen so far; every item overwrites what it reads.
struct Scratch {
  std::vector<float> q, k, v, s, acc, m, l;
  std::vector<const float*> krow, vrow;
  std::vector<uint16_t> qb;            // bf16 path: raw q rows, zero-padded to 32 lanes
  std::vector<const uint16_t*> kraw, vraw;  // bf16 path: K / V rows in the cache, unconverted
  // bf16 path: the cache lines of the next tile's K / V rows (a KV block's K rows, then its V
  // rows), requested a few at a time while this tile's scores run
  fitserve::LineQueue pf;
  void reserve(int64_t g, int64_t dpad) {
    if (static_cast<int64_t>(q.size()) >= g * dpad && static_cast<int64_t>(m.size()) >= g &&
        static_cast<int64_t>(k.size()) >= kTile * dpad)
      return;
    const int64_t gm = std::max<int64_t>(g, static_cast<int64_t>(m.size()));
    const int64_t dm = std::max<int64_t>(dpad, static_cast<int64_t>(k.size()) / kTile);
    qb.assign(gm * (dm + 2 * kLanes), 0);
    kraw.assign(kTile, nullptr);
    vraw.assign(kTile, nullptr);
    q.assign(gm * dm, 0.f);
    k.assign(kTile * dm, 0.f);
    v.assign(kTile * dm, 0.f);
    s.assign(gm * kTile, 0.f);
    acc.assign(gm * dm, 0.f);
    m.assign(gm, 0.f);
    l.assign(gm, 0.f);
    krow.assign(kTile, nullptr);
    vrow.assign(kTile, nullptr);
  }
};

// NOTE: thread_local, so the persistent OpenMP workers allocate once, not once per call/layer.
inline Scratch& thread_scratch(int64_t g, int64_t dpad) {
  thread_local Scratch w;
  w.reserve(g, dpad);
  return w;
}

// One online-softmax step of every query head of the group over the n rows in Scratch.
using TileFn = void (*)(const Geometry&, Scratch&, int64_t);

// ---------------------------------------------------------------- element conversion

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = to_f(src[i]);
}

#if FS_AVX512
template <>
inline void row_to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t d) {
  int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes)
    _mm512_storeu_ps(dst + c, bf16x16_to_f32(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(src + c))));
  if (c < d)
    _mm512_storeu_ps(dst + c, bf16x16_to_f32(_mm256_maskz_loadu_epi16(tail_mask(d - c), src + c)));
}

template <>
inline void row_to_float<c10::Half>(const c10::Half* src, float* dst, int64_t d) {
  int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes)
    _mm512_storeu_ps(dst + c, _mm512_cvtph_ps(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(src + c))));
  if (c < d)
    _mm512_storeu_ps(dst + c, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(d - c), src + c)));
}

#if FS_BF16DOT
// s[0..n) = scale * (q . rows[0..n)) from raw bf16 q and K rows; NC2 = ceil(D / 32); per 16
// keys, pf_per_block of the next tile's queued lines are requested.
template <int NC2>
inline void scores_bf16dot(const uint16_t* q, const uint16_t* const* rows, int64_t n,
                           __mmask32 tail, float scale, float* s, Scratch& w,
                           int64_t pf_per_block) {
  __m512bh qv[NC2];
  for (int c = 0; c < NC2; ++c)  // zero-padded past head_dim
    qv[c] = (__m512bh)_mm512_loadu_si512(q + c * 2 * kLanes);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const int64_t cnt = std::min<int64_t>(kLanes, n - i0);
    w.pf.issue(pf_per_block);
    __m512 a[kLanes];
#pragma GCC unroll 16
    for (int64_t j = 0; j < kLanes; ++j) {
      const uint16_t* r = rows[i0 + (j < cnt ? j : 0)];
      __m512 acc = _mm512_dpbf16_ps(
          _mm512_setzero_ps(), qv[NC2 - 1],
          (__m512bh)_mm512_maskz_loadu_epi16(tail, r + (NC2 - 1) * 2 * kLanes));
#pragma GCC unroll 8
      for (int c = 0; c < NC2 - 1; ++c)
        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(r + c * 2 * kLanes));
      a[j] = acc;
    }
    _mm512_mask_storeu_ps(s + i0, tail_mask(cnt), _mm512_mul_ps(reduce16(a), sc));
  }
}
#endif

#if FS_BF16DOT
// acc_h[0..D) += sum_i p_h[i] v_i for HB query heads h0 .. h0+HB-1 of the group, from raw bf16
// V rows: each row is widened in registers once for all HB heads (no fp32 copy of the tile, no
// reload per head). The HB * NCH accumulators stay in registers; where they are 8 or fewer, a
// second set takes the odd rows (one set would be a latency-bound chain of dependent FMAs).
template <int NCH, int HB>
inline void pv_heads_bf16(float* acc, int64_t dpad, const float* s, const uint16_t* const* rows,
                          int64_t n, __mmask16 tail) {
  constexpr int kSets = HB * NCH <= 8 ? 2 : 1;
  __m512 av[kSets][HB][NCH];
#pragma GCC unroll 16
  for (int j = 0; j < HB; ++j)
#pragma GCC unroll 16
    for (int c = 0; c < NCH; ++c) {
      av[0][j][c] = _mm512_loadu_ps(acc + j * dpad + c * kLanes);
      if constexpr (kSets == 2) av[1][j][c] = _mm512_setzero_ps();
    }
  auto row = [&](auto& a, int64_t i) __attribute__((always_inline)) {
    __m512 pb[HB];
#pragma GCC unroll 16
    for (int j = 0; j < HB; ++j) pb[j] = _mm512_set1_ps(s[j * kTile + i]);
#pragma GCC unroll 16
    for (int c = 0; c < NCH; ++c) {
      const __m512 v = bf16x16_to_f32(_mm256_maskz_loadu_epi16(
          c == NCH - 1 ? tail : static_cast<__mmask16>(0xFFFF), rows[i] + c * kLanes));
#pragma GCC unroll 16
      for (int j = 0; j < HB; ++j) a[j][c] = _mm512_fmadd_ps(pb[j], v, a[j][c]);
    }
  };
  int64_t i = 0;
  if constexpr (kSets == 2)
    for (; i + 1 < n; i += 2) {
      row(av[0], i);
      row(av[1], i + 1);
    }
  for (; i < n; ++i) row(av[0], i);
#pragma GCC unroll 16
  for (int j = 0; j < HB; ++j)
#pragma GCC unroll 16
    for (int c = 0; c < NCH; ++c) {
      __m512 sum = av[0][j][c];
      if constexpr (kSets == 2) sum = _mm512_add_ps(sum, av[1][j][c]);
      _mm512_storeu_ps(acc + j * dpad + c * kLanes, sum);
    }
}

// pv_heads_bf16<NCH, hb> for a run-time hb in 1..H.
template <int NCH, int H>
inline void pv_heads_bf16_n(int64_t hb, float* acc, int64_t dpad, const float* s,
                            const uint16_t* const* rows, int64_t n, __mmask16 tail) {
  if (hb == H) pv_heads_bf16<NCH, H>(acc, dpad, s, rows, n, tail);
  else if constexpr (H > 1) pv_heads_bf16_n<NCH, H - 1>(hb, acc, dpad, s, rows, n, tail);
}

// Every head of the group, in blocks of up to 16 / NCH heads (16 accumulator registers).
template <int NCH>
inline void pv_group_bf16(const Geometry& g, Scratch& w, int64_t n, __mmask16 tail) {
  constexpr int kMaxHB = NCH >= 16 ? 1 : 16 / NCH;
  for (int64_t h0 = 0; h0 < g.group; h0 += kMaxHB) {
    pv_heads_bf16_n<NCH, kMaxHB>(std::min<int64_t>(kMaxHB, g.group - h0),
                                 w.acc.data() + h0 * g.dpad, g.dpad, w.s.data() + h0 * kTile,
                                 w.vraw.data(), n, tail);
  }
}
#endif

// kBf16Dot: q . k from the raw bf16 rows (Scratch::qb / kraw) and P @ V from the raw V rows
// (vraw), all heads of the group per V row; else both from the fp32 rows.
template <int NCH, bool kBf16Dot>
void tile_avx512(const Geometry& g, Scratch& w, int64_t n) {
  const __mmask16 tail = tail_mask(g.head_dim - (NCH - 1) * kLanes);
#if FS_BF16DOT
  if constexpr (kBf16Dot) {
    constexpr int kNc2 = (NCH + 1) / 2;
    const int64_t rest = g.head_dim - (kNc2 - 1) * 2 * kLanes;  // 1..32
    const __mmask32 tail32 = rest >= 32 ? 0xFFFFFFFFu : ((1u << rest) - 1u);
    // NOTE: the next tile's lines spread over this tile's score blocks: requested all at once
    // (prefetch_rows), most waited behind the core's few outstanding misses, and the rows
    // streamed at ~5 GB/s a thread against ~12 with the tile in cache (Xeon, SmolLM2 heads)
    const int64_t blocks = g.group * ((n + kLanes - 1) / kLanes);
    const int64_t per_block = w.pf.share(blocks);
    for (int64_t h = 0; h < g.group; ++h) {
      float* s = w.s.data() + h * kTile;
      scores_bf16dot<kNc2>(w.qb.data() + h * (g.dpad + 2 * kLanes), w.kraw.data(), n, tail32,
                           g.scale, s, w, per_block);
      softmax_step_avx512(s, n, &w.m[h], &w.l[h], w.acc.data() + h * g.dpad, g.dpad);
    }
    w.pf.issue(w.pf.left());
    pv_group_bf16<NCH>(g, w, n, tail);
    return;
  }
#endif
  for (int64_t h = 0; h < g.group; ++h) {
    float* s = w.s.data() + h * kTile;
    float* acc = w.acc.data() + h * g.dpad;
    scores_avx512<NCH>(w.q.data() + h * g.dpad, w.krow.data(), n, tail, s);
    softmax_step_avx512(s, n, &w.m[h], &w.l[h], acc, g.dpad);
    pv_avx512<NCH>(acc, s, w.vrow.data(), n, tail);
  }
}

template <bool kBf16Dot>
inline TileFn pick_tile_for(int64_t head_dim) {
  switch ((head_dim + kLanes - 1) / kLanes) {
    case 1: return &tile_avx512<1, kBf16Dot>;
    case 2: return &tile_avx512<2, kBf16Dot>;
    case 3: return &tile_avx512<3, kBf16Dot>;
    case 4: return &tile_avx512<4, kBf16Dot>;
    case 5: return &tile_avx512<5, kBf16Dot>;
    case 6: return &tile_avx512<6, kBf16Dot>;
    case 7: return &tile_avx512<7, kBf16Dot>;
    case 8: return &tile_avx512<8, kBf16Dot>;
    case 12: return &tile_avx512<12, kBf16Dot>;
    case 16: return &tile_avx512<16, kBf16Dot>;
    default: return nullptr;
  }
}

// The vectorised tile for this head_dim, or nullptr (another head_dim over 128: scalar tile).
inline TileFn pick_tile_avx512(int64_t head_dim, bool bf16dot) {
  return bf16dot ? pick_tile_for<true>(head_dim) : pick_tile_for<false>(head_dim);
}
#endif  // FS_AVX512

#if FS_AVX2
template <>
inline void row_to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t d) {
  int64_t c = 0;
  for (; c + kLanes8 <= d; c += kLanes8)
    _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c))), 16)));
  for (; c < d; ++c) dst[c] = static_cast<float>(src[c]);
}

template <>
inline void row_to_float<c10::Half>(const c10::Half* src, float* dst, int64_t d) {
  int64_t c = 0;
  for (; c + kLanes8 <= d; c += kLanes8)
    _mm256_storeu_ps(dst + c,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c))));
  for (; c < d; ++c) dst[c] = static_cast<float>(src[c]);
}

template <int NCH>
void tile_avx2(const Geometry& g, Scratch& w, int64_t n) {
  const __m256i tail = tail_mask8(g.head_dim - (NCH - 1) * kLanes8);
  for (int64_t h = 0; h < g.group; ++h) {
    float* s = w.s.data() + h * kTile;
    float* acc = w.acc.data() + h * g.dpad;
    scores_avx2<NCH>(w.q.data() + h * g.dpad, w.krow.data(), n, tail, s);
    softmax_step_avx2(s, n, &w.m[h], &w.l[h], acc, g.dpad);
    pv_avx2<NCH>(acc, s, w.vrow.data(), n, tail);
  }
}

// The vectorised tile for this head_dim, or nullptr (another head_dim over 128: scalar tile).
inline TileFn pick_tile_avx2(int64_t head_dim) {
  switch ((head_dim + kLanes8 - 1) / kLanes8) {
    case 1: return &tile_avx2<1>;
    case 2: return &tile_avx2<2>;
    case 3: return &tile_avx2<3>;
    case 4: return &tile_avx2<4>;
    case 5: return &tile_avx2<5>;
    case 6: return &tile_avx2<6>;
    case 7: return &tile_avx2<7>;
    case 8: return &tile_avx2<8>;
    case 10: return &tile_avx2<10>;
    case 12: return &tile_avx2<12>;
    case 16: return &tile_avx2<16>;
    default: return nullptr;
  }
}
#endif  // FS_AVX2

// The same tile step in plain C++ (any CPU; also what the tests compare the AVX-512 one with).
void tile_scalar(const Geometry& g, Scratch& w, int64_t n) {
  const int64_t d = g.head_dim;
  for (int64_t h = 0; h < g.group; ++h) {
    const float* q = w.q.data() + h * g.dpad;
    float* s = w.s.data() + h * kTile;
    float* acc = w.acc.data() + h * g.dpad;
    float mx = kNegInf;
    for (int64_t i = 0; i < n; ++i) {
      const float* r = w.krow[i];
      float dot = 0.f;
      for (int64_t c = 0; c < d; ++c) dot += q[c] * r[c];
      s[i] = dot;
      mx = std::max(mx, dot);
    }
    const float m_new = std::max(w.m[h], mx);
    if (m_new > w.m[h]) {
      const float alpha = std::exp(w.m[h] - m_new);
      for (int64_t c = 0; c < d; ++c) acc[c] *= alpha;
      w.l[h] *= alpha;
      w.m[h] = m_new;
    }
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - m_new);
      sum += s[i];
    }
    w.l[h] += sum;
    for (int64_t i = 0; i < n; ++i) {
      const float* r = w.vrow[i];
      const float p = s[i];
      for (int64_t c = 0; c < d; ++c) acc[c] += p * r[c];
    }
  }
}

// Software prefetch of the K/V rows of keys [t_from, t_to): blocks sit at random places of the
// pool, so the hardware prefetcher loses the stream at every block boundary.
template <typename T>
inline void prefetch_rows(const Geometry& g, const T* kh, const T* vh, const int32_t* table,
                          int64_t t_from, int64_t t_to) {
  if (t_from >= t_to) return;
  const int64_t row_bytes = g.head_dim * static_cast<int64_t>(sizeof(T));
  int64_t blk = t_from / g.block_size, off = t_from % g.block_size;  // one division per call
  for (int64_t t = t_from; t < t_to; ++t) {
    const int64_t page = table[blk];
    const char* kr = reinterpret_cast<const char*>(kh + page * g.k_stride_blk + off * g.k_stride_tok);
    const char* vr = reinterpret_cast<const char*>(vh + page * g.v_stride_blk + off * g.v_stride_tok);
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
      fitserve::prefetch_stream(kr + byte);
      fitserve::prefetch_stream(vr + byte);
    }
    if (++off == g.block_size) {
      off = 0;
      ++blk;
    }
  }
}

// The cache lines of the K/V rows of keys [t_from, t_to) queued in w.pf (issued by the bf16
// tile while it computes: LineQueue::issue), instead of requested at once as prefetch_rows does.
// NOTE: one run of lines per KV block for K and one for V where a block's rows are contiguous
// (the engine's caches), not a pointer per line: building and reading back 4 pointers a key
// (SmolLM2's 64-dim heads) was a sixth of the bf16 decode tile's time
template <typename T>
inline void queue_rows(const Geometry& g, const T* kh, const T* vh, const int32_t* table,
                       int64_t t_from, int64_t t_to, Scratch& w) {
  w.pf.clear();
  if (t_from >= t_to) return;
  const int64_t row_bytes = g.head_dim * static_cast<int64_t>(sizeof(T));
  const bool k_dense = g.k_stride_tok == g.head_dim, v_dense = g.v_stride_tok == g.head_dim;
  int64_t blk = t_from / g.block_size, off = t_from % g.block_size;  // one division per call
  for (int64_t t = t_from; t < t_to;) {
    const int64_t cnt = std::min(g.block_size - off, t_to - t);
    const int64_t page = table[blk];
    const T* kr = kh + page * g.k_stride_blk + off * g.k_stride_tok;
    const T* vr = vh + page * g.v_stride_blk + off * g.v_stride_tok;
    for (int64_t i = 0; i < (k_dense ? 1 : cnt); ++i)
      w.pf.add(kr + i * g.k_stride_tok, k_dense ? cnt * row_bytes : row_bytes);
    for (int64_t i = 0; i < (v_dense ? 1 : cnt); ++i)
      w.pf.add(vr + i * g.v_stride_tok, v_dense ? cnt * row_bytes : row_bytes);
    t += cnt;
    off = 0;
    ++blk;
  }
}

// The keys of the work item a thread runs next, whose first tile the current item's last tile
// prefetches (t_from == t_to: none).
template <typename T>
struct NextRows {
  const T* kh = nullptr;
  const T* vh = nullptr;
  const int32_t* table = nullptr;
  int64_t t_from = 0, t_to = 0;
};

// One work item: keys [t_begin, t_end) of sequence b for KV head kvh. Leaves (acc, m, l) in w.
// kDot (bf16 q and cache, VDPBF16PS tile): q, K and V stay raw bf16 (V widened in registers).
// first_prefetched: the thread's previous item already prefetched this item's first tile.
template <typename T, typename QT, bool kDot>
void attend(const Geometry& g, const QT* q, const T* kc, const T* vc, const int32_t* table,
            int64_t b, int64_t kvh, int64_t t_begin, int64_t t_end, Scratch& w, TileFn tile,
            bool first_prefetched, const NextRows<T>& next) {
  const int64_t d = g.head_dim;
  for (int64_t h = 0; h < g.group; ++h) {
    const QT* qr = q + b * g.q_stride_b + (kvh * g.group + h) * g.q_stride_h;
    if constexpr (kDot) {
      uint16_t* qb = w.qb.data() + h * (g.dpad + 2 * kLanes);
      std::memcpy(qb, qr, d * sizeof(uint16_t));
      std::fill(qb + d, qb + g.dpad + 2 * kLanes, uint16_t{0});
    } else {
      float* qf = w.q.data() + h * g.dpad;
      for (int64_t c = 0; c < d; ++c) qf[c] = to_f(qr[c]) * g.scale;
      std::fill(qf + d, qf + g.dpad, 0.f);
    }
    std::fill(w.acc.data() + h * g.dpad, w.acc.data() + (h + 1) * g.dpad, 0.f);
    w.m[h] = kNegInf;
    w.l[h] = 0.f;
  }
  const T* kh = kc + kvh * g.k_stride_h;
  const T* vh = vc + kvh * g.v_stride_h;
  if (!first_prefetched)
    prefetch_rows(g, kh, vh, table, t_begin, std::min(t_begin + kTile, t_end));
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    const int64_t n = std::min(kTile, t_end - t0);
    if constexpr (kDot) {  // queued: the tile requests them while it computes
      if (t0 + n < t_end)
        queue_rows(g, kh, vh, table, t0 + n, std::min(t0 + n + kTile, t_end), w);
      else
        queue_rows(g, next.kh, next.vh, next.table, next.t_from, next.t_to, w);
    } else if (t0 + n < t_end) {  // the next tile, else the next item's first (items are short:
      prefetch_rows(g, kh, vh, table, t0 + n, std::min(t0 + n + kTile, t_end));
    } else {  // at W2's ~200 keys a third of the tiles were an item's first, never prefetched)
      prefetch_rows(g, next.kh, next.vh, next.table, next.t_from, next.t_to);
    }
    // the tile's rows, a KV block at a time (one table read and base address per block)
    int64_t blk = t0 / g.block_size, off = t0 % g.block_size;
    for (int64_t i = 0; i < n; ++blk, off = 0) {
      const int64_t cnt = std::min(g.block_size - off, n - i);
      const int64_t page = table[blk];
      const T* kr = kh + page * g.k_stride_blk + off * g.k_stride_tok;
      const T* vr = vh + page * g.v_stride_blk + off * g.v_stride_tok;
      for (int64_t j = 0; j < cnt; ++j, ++i, kr += g.k_stride_tok, vr += g.v_stride_tok) {
        if constexpr (std::is_same_v<T, float>) {  // fp32 rows are read in place
          w.krow[i] = kr;
          w.vrow[i] = vr;
        } else if constexpr (kDot) {  // K and V read in place as bf16
          w.kraw[i] = reinterpret_cast<const uint16_t*>(kr);
          w.vraw[i] = reinterpret_cast<const uint16_t*>(vr);
        } else {  // 16-bit rows widen into the tile buffer (L1-resident) once per group
          row_to_float(kr, w.k.data() + i * g.dpad, d);
          row_to_float(vr, w.v.data() + i * g.dpad, d);
          w.krow[i] = w.k.data() + i * g.dpad;
          w.vrow[i] = w.v.data() + i * g.dpad;
        }
      }
    }
    tile(g, w, n);
  }
}

// Partition p of a sequence of length L: absolute keys [first, last) it covers.
inline void partition_range(const Geometry& g, int64_t L, int64_t p, int64_t* first,
                            int64_t* last) {
  const int64_t lo = g.window > 0 ? std::max<int64_t>(0, L - g.window) : 0;
  *first = std::max(lo, p * g.partition);
  *last = std::min(L, (p + 1) * g.partition);
}

#if FS_AMX_ATTN
// paged_attention_amx.h (included with the prefill, after the headers it builds on): the AMX
// decode tile for this head_dim or nullptr, and the tile configuration every thread loads.
TileFn amx_decode_tile(int64_t head_dim);
void amx_attn_configure();

// Which ops run on the AMX tile (FITSERVE_AMX_ATTENTION, or paged_attention_set_amx_mode):
//   0 off; 1 ("1") decode and prefill; 2 ("prefill") the prefill only; 3 ("auto", the default)
//   decode and prefill for a KV head of at least kAmxMinGroup query heads.
// NOTE: per 64-key tile the AMX step pays a fixed cost (K transposed, V paired, the tile round
// trips) and then serves up to 16 row-heads almost for free, while the VDPBF16PS tile's cost
// grows with the heads: a decode row with SmolLM2's 3 query heads per KV head is ~1.7x slower on
// AMX, one with 16 faster; a prefill item (32 rows x G) is ~1.9x faster at G = 3. Decode and
// prefill must use the same tile for a model (or prefill rows would stop matching decode rows),
// so "auto" decides by the group size both ops see; mode 2 gives up that match for the prefill's
// speed (a greedy speculative or preempted run may then diverge from the plain one).
constexpr int64_t kAmxMinGroup = 8;
inline std::atomic<int>& amx_attention_mode() {
  static std::atomic<int> mode{[] {
    const char* e = std::getenv("FITSERVE_AMX_ATTENTION");
    if (!fitserve::amx_usable() || (e != nullptr && std::strcmp(e, "0") == 0)) return 0;
    if (e != nullptr && std::strcmp(e, "1") == 0) return 1;
    if (e != nullptr && std::strcmp(e, "prefill") == 0) return 2;
    return 3;
  }()};
  return mode;
}
inline bool amx_decode_for(int64_t group) {
  const int mode = amx_attention_mode().load(std::memory_order_relaxed);
  return mode == 1 || (mode == 3 && group >= kAmxMinGroup);
}
inline bool amx_prefill_for(int64_t group) {
  const int mode = amx_attention_mode().load(std::memory_order_relaxed);
  return mode == 1 || mode == 2 || (mode == 3 && group >= kAmxMinGroup);
}
#endif

// T: the cache dtype; QT: q's and the output's (T itself, or float over a 16-bit cache).
template <typename T, typename QT>
void run(const Geometry& g, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
         const at::Tensor& tables, const std::vector<int64_t>& lens, at::Tensor& out,
         bool vectorized) {
  const int64_t num_seqs = static_cast<int64_t>(lens.size());
  // Items (b, h, p) in sequence order; a sequence's items are contiguous.
  std::vector<int64_t> first_part(num_seqs), num_parts(num_seqs), item_start(num_seqs + 1, 0);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t L = lens[b];
    const int64_t lo = g.window > 0 ? std::max<int64_t>(0, L - g.window) : 0;
    first_part[b] = lo / g.partition;
    num_parts[b] = L > lo ? (L - 1) / g.partition - first_part[b] + 1 : 0;
    item_start[b + 1] = item_start[b] + num_parts[b] * g.num_kv;
  }
  const int64_t num_items = item_start[num_seqs];
  bool any_split = false;
  for (int64_t b = 0; b < num_seqs; ++b) any_split |= num_parts[b] > 1;
  // partials: per item [G, dpad] accumulators then G maxima then G sums
  const int64_t part_stride = g.group * (g.dpad + 2);
  // NOTE: uninitialised on purpose (a value-initialised vector would zero it every layer)
  std::unique_ptr<float[]> partial(any_split ? new float[num_items * part_stride] : nullptr);
  std::vector<int64_t> item_seq(num_items);
  for (int64_t b = 0; b < num_seqs; ++b)
    std::fill(item_seq.begin() + item_start[b], item_seq.begin() + item_start[b + 1], b);

  TileFn tile = &tile_scalar;
  bool dot = false;
#if FS_AVX512
  if (vectorized) {
    dot = FS_BF16DOT && std::is_same_v<T, c10::BFloat16> && std::is_same_v<QT, c10::BFloat16>;
    if (TileFn f = pick_tile_avx512(g.head_dim, dot)) tile = f;
    else dot = false;
  }
#elif FS_AVX2
  if (vectorized)
    if (TileFn f = pick_tile_avx2(g.head_dim)) tile = f;
#else
  (void)vectorized;
#endif
  [[maybe_unused]] bool amx = false;
#if FS_AMX_ATTN
  if (dot && amx_decode_for(g.group))
    if (TileFn f = amx_decode_tile(g.head_dim)) {
      tile = f;
      amx = true;
    }
#endif
  const QT* qp = q.data_ptr<QT>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  QT* op = out.data_ptr<QT>();
  const int64_t d = g.head_dim;

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    Scratch& w = thread_scratch(g.group, g.dpad);
#if FS_AMX_ATTN
    if (amx) amx_attn_configure();
#endif
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = item_seq[it];
      const int64_t local = it - item_start[b];
      const int64_t kvh = local / num_parts[b];
      const int64_t p = first_part[b] + local % num_parts[b];
      int64_t t0 = 0, t1 = 0;
      partition_range(g, lens[b], p, &t0, &t1);
      NextRows<T> next;
      if (it + 1 < end) {
        const int64_t nb = item_seq[it + 1], nl = it + 1 - item_start[nb];
        const int64_t nkvh = nl / num_parts[nb];
        partition_range(g, lens[nb], first_part[nb] + nl % num_parts[nb], &next.t_from,
                        &next.t_to);
        next.t_to = std::min(next.t_to, next.t_from + kTile);
        next.kh = kp + nkvh * g.k_stride_h;
        next.vh = vp + nkvh * g.v_stride_h;
        next.table = tp + nb * g.max_blocks;
      }
      const bool first_prefetched = it > begin;
      if (dot)
        attend<T, QT, true>(g, qp, kp, vp, tp + b * g.max_blocks, b, kvh, t0, t1, w, tile,
                            first_prefetched, next);
      else
        attend<T, QT, false>(g, qp, kp, vp, tp + b * g.max_blocks, b, kvh, t0, t1, w, tile,
                             first_prefetched, next);
      if (num_parts[b] == 1) {
        for (int64_t h = 0; h < g.group; ++h) {
          QT* o = op + b * g.out_stride_b + (kvh * g.group + h) * d;
          const float inv = 1.f / w.l[h];
          const float* acc = w.acc.data() + h * g.dpad;
          for (int64_t c = 0; c < d; ++c) o[c] = static_cast<QT>(acc[c] * inv);
        }
      } else {
        float* dst = partial.get() + it * part_stride;
        std::copy_n(w.acc.begin(), g.group * g.dpad, dst);
        std::copy_n(w.m.begin(), g.group, dst + g.group * g.dpad);
        std::copy_n(w.l.begin(), g.group, dst + g.group * g.dpad + g.group);
      }
    }
#if FS_AMX_ATTN
    if (amx) _tile_release();  // frees the tile state (context switches no longer save it)
#endif
  });

  // Empty sequences (no visible key) give zeros, as a fully masked softmax row would not.
  for (int64_t b = 0; b < num_seqs; ++b)
    if (num_parts[b] == 0) out[b].zero_();
  if (!any_split) return;
  // Exact merge of the partitions of each (sequence, KV head), in partition order.
  // NOTE: a few floats per partition: below ~1M of them the merge runs on the calling thread
  // (a grain of the whole range), since waking the pool costs more than it does, and far more
  // when the other core is busy (every parallel region then waits a scheduler time slice).
  int64_t merge_floats = 0;
  for (int64_t b = 0; b < num_seqs; ++b)
    if (num_parts[b] > 1) merge_floats += num_parts[b] * g.num_kv * part_stride;
  const int64_t num_bh = num_seqs * g.num_kv;
  const int64_t grain = merge_floats < (1 << 20) ? num_bh : 1;
  at::parallel_for(0, num_bh, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(g.dpad);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / g.num_kv, kvh = bh % g.num_kv;
      const int64_t np = num_parts[b];
      if (np <= 1) continue;
      const float* base = partial.get() + (item_start[b] + kvh * np) * part_stride;
      for (int64_t h = 0; h < g.group; ++h) {
        float mx = kNegInf;
        for (int64_t p = 0; p < np; ++p)
          mx = std::max(mx, base[p * part_stride + g.group * g.dpad + h]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float den = 0.f;
        for (int64_t p = 0; p < np; ++p) {
          const float* part = base + p * part_stride;
          const float wgt = std::exp(part[g.group * g.dpad + h] - mx);
          den += wgt * part[g.group * g.dpad + g.group + h];
          const float* a = part + h * g.dpad;
          for (int64_t c = 0; c < d; ++c) acc[c] += wgt * a[c];
        }
        QT* o = op + b * g.out_stride_b + (kvh * g.group + h) * d;
        const float inv = 1.f / den;
        for (int64_t c = 0; c < d; ++c) o[c] = static_cast<QT>(acc[c] * inv);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  int64_t partition_size, bool vectorized) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must both be [num_kv_heads, num_blocks, block_size, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || q.scalar_type() == at::kFloat,
              "q must have the cache's dtype, or be float32 (then so is the output)");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the head_dim axis must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 &&
                  block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "block_tables [num_seqs, max_blocks] and seq_lens [num_seqs] must match q");
  TORCH_CHECK(partition_size > 0, "partition_size must be positive");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "cache head_dim differs from q's");
  TORCH_CHECK(num_kv > 0 && num_heads % num_kv == 0, "num_heads must be a multiple of num_kv_heads");

  const at::Tensor tables = block_tables.to(at::kInt).contiguous();  // no-op for int32 input
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt || seq_lens.scalar_type() == at::kLong,
              "seq_lens must be int32 or int64");
  const at::Tensor lens_t = seq_lens.contiguous();
  std::vector<int64_t> lens(num_seqs);
  for (int64_t b = 0; b < num_seqs; ++b)
    lens[b] = seq_lens.scalar_type() == at::kInt ? lens_t.data_ptr<int32_t>()[b]
                                                 : lens_t.data_ptr<int64_t>()[b];
  const int64_t max_blocks = tables.size(1);
  const int32_t* tp = tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < num_seqs; ++b) {  // never read outside the cache
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_blocks * block_size,
                "seq_lens[", b, "] = ", lens[b], " exceeds its block table");
    const int64_t lo = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    for (int64_t j = lo / block_size; j * block_size < lens[b]; ++j) {
      const int32_t page = tp[b * max_blocks + j];
      TORCH_CHECK(page >= 0 && page < num_blocks, "block_tables[", b, ", ", j, "] = ", page,
                  " is not a block of the cache");
    }
  }
  at::Tensor out = at::empty({num_seqs, num_heads, head_dim}, q.options());
  const Geometry g = make_geometry(q, k_cache, v_cache, num_heads, num_kv, head_dim, block_size,
                                   max_blocks, partition_size, window, scale);
  if (num_seqs == 0) return out;
  const bool q_f32 = q.scalar_type() == at::kFloat;
  switch (k_cache.scalar_type()) {
    case at::kFloat: run<float, float>(g, q, k_cache, v_cache, tables, lens, out, vectorized); break;
    case at::kBFloat16:
      if (q_f32) run<c10::BFloat16, float>(g, q, k_cache, v_cache, tables, lens, out, vectorized);
      else run<c10::BFloat16, c10::BFloat16>(g, q, k_cache, v_cache, tables, lens, out, vectorized);
      break;
    case at::kHalf:
      if (q_f32) run<c10::Half, float>(g, q, k_cache, v_cache, tables, lens, out, vectorized);
      else run<c10::Half, c10::Half>(g, q, k_cache, v_cache, tables, lens, out, vectorized);
      break;
    default: TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16 caches only");
  }
  return out;
}

// The flash-style prefill (query tiles x KV blocks), each row bitwise the decode kernel's.
#include "paged_prefill.h"

// What this build vectorises with (for logs and tests).
std::string paged_attention_isa() {
#if FS_BF16DOT
  return "avx512+bf16dot";
#elif FS_AVX512
  return "avx512";
#elif FS_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

// Which ops run the bf16 attention on AMX-BF16 tiles: 0 none, 1 decode and prefill, 2 the
// prefill only, 3 both from kAmxMinGroup query heads per KV head (compiled for this CPU, granted
// by the OS); paged_attention_set_amx_mode sets it for later calls, returns the mode it got.
int64_t paged_attention_amx_mode() {
#if FS_AMX_ATTN
  return amx_attention_mode().load();
#else
  return 0;
#endif
}

int64_t paged_attention_set_amx_mode(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 3, "AMX attention mode must be 0, 1, 2 or 3, got ", mode);
#if FS_AMX_ATTN
  amx_attention_mode().store(mode > 0 && fitserve::amx_set(true) ? static_cast<int>(mode) : 0);
  return amx_attention_mode().load();
#else
  return 0;
#endif
}

}  // namespace

// NOTE: a FRAGMENT, so other sources may add ops to the same "fitserve" namespace.
TORCH_LIBRARY_FRAGMENT(fitserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, int partition_size=256, bool vectorized=True) "
      "-> Tensor");
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "int cached, float scale, int window, int partition_size=256, bool vectorized=True) "
      "-> Tensor");
  m.def("paged_attention_isa() -> str", &paged_attention_isa);
  m.def("paged_attention_amx_mode() -> int", &paged_attention_amx_mode);
  m.def("paged_attention_set_amx_mode(int mode) -> int", &paged_attention_set_amx_mode);
}

TORCH_LIBRARY_IMPL(fitserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
