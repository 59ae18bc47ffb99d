// Flash-style prefill attention over the paged cache: the T query rows of one sequence's chunk
// (row i at position cached + i sees keys [lo_i, cached + i + 1), lo_i = 0 or the window's)
// in tiles of kPrefillRows rows, each work item (query tile, KV head h, key partition p)
// reading the partition's K/V rows once for all its rows and all G query heads of h.
//
// NOTE: batch invariance: every row gets the bits the decode kernel (paged_decode_attention)
// gives that token. A row's keys split into the same fixed partitions of absolute positions,
// each partition into the same kTile-key tiles from its first key, and every tile runs the
// decode kernel's own tile function (scores, online-softmax step, P @ V) on that row's state;
// rows with several partitions merge them in the decode kernel's order. What changes is only
// the loop order: key tile outer, rows inner (the tile stays in L1 while every row of the tile
// uses it), instead of one pass over the keys per row. Rows whose first key in the partition
// is not the partition's first (a sliding window starting inside it) run their own tiles one
// row at a time, over keys the item has just brought into cache. With bf16 q and cache on a
// VDPBF16PS build the rows' tiles run together (paged_prefill_dot.h: several rows x heads per
// K/V register, the same chains and the same reduction tree per row).
//
// Included by paged_attention.cpp inside its anonymous namespace, after paged_decode_attention:
// it uses Geometry, Scratch, thread_scratch, attend, prefetch_rows, partition_range and the
// tile functions defined there.
#pragma once

constexpr int64_t kPrefillRows = 32;  // query rows per work item

// One query row's online-softmax state: the Scratch fields a tile call reads and updates for
// that row, swapped into the thread's Scratch around the call (a vector swap moves pointers).
struct PrefillRow {
  std::vector<float> q, acc, m, l;
  std::vector<uint16_t> qb;
  void swap_with(Scratch& w) {
    q.swap(w.q);
    acc.swap(w.acc);
    m.swap(w.m);
    l.swap(w.l);
    qb.swap(w.qb);
  }
};

// The per-thread row states, sized like the thread's Scratch.
inline std::vector<PrefillRow>& thread_prefill_rows(const Scratch& w) {
  thread_local std::vector<PrefillRow> rows(kPrefillRows);
  for (PrefillRow& r : rows)
    if (r.q.size() != w.q.size() || r.acc.size() != w.acc.size() || r.m.size() != w.m.size() ||
        r.qb.size() != w.qb.size()) {
      r.q.assign(w.q.size(), 0.f);
      r.acc.assign(w.acc.size(), 0.f);
      r.m.assign(w.m.size(), 0.f);
      r.l.assign(w.l.size(), 0.f);
      r.qb.assign(w.qb.size(), 0);
    }
  return rows;
}

// The start of attend(): row b's G scaled (or raw bf16) queries, zero accumulators, m = -inf.
template <typename QT, bool kDot>
void init_row(const Geometry& g, const QT* q, int64_t b, int64_t kvh, Scratch& w) {
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
}

// Points Scratch at the K/V rows of keys [t0, t0 + n) (widened into its tile buffer for a
// 16-bit cache without the bf16 dot path), as attend() does for one tile.
template <typename T, bool kDot>
void load_tile(const Geometry& g, const T* kh, const T* vh, const int32_t* table, int64_t t0,
               int64_t n, Scratch& w) {
  int64_t blk = t0 / g.block_size, off = t0 % g.block_size;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t page = table[blk];
    const T* kr = kh + page * g.k_stride_blk + off * g.k_stride_tok;
    const T* vr = vh + page * g.v_stride_blk + off * g.v_stride_tok;
    if constexpr (std::is_same_v<T, float>) {
      w.krow[i] = kr;
      w.vrow[i] = vr;
    } else if constexpr (kDot) {
      w.kraw[i] = reinterpret_cast<const uint16_t*>(kr);
      w.vraw[i] = reinterpret_cast<const uint16_t*>(vr);
    } else {
      row_to_float(kr, w.k.data() + i * g.dpad, g.head_dim);
      row_to_float(vr, w.v.data() + i * g.dpad, g.head_dim);
      w.krow[i] = w.k.data() + i * g.dpad;
      w.vrow[i] = w.v.data() + i * g.dpad;
    }
    if (++off == g.block_size) {
      off = 0;
      ++blk;
    }
  }
}

// Writes one row's (acc [G][dpad], m [G], l [G]) for KV head kvh: acc / l into the output
// row b, or the partition's partial.
template <typename QT>
void store_state(const Geometry& g, const float* acc, const float* m, const float* l, QT* out,
                 int64_t b, int64_t kvh, float* partial) {
  if (partial == nullptr) {
    for (int64_t h = 0; h < g.group; ++h) {
      QT* o = out + b * g.out_stride_b + (kvh * g.group + h) * g.head_dim;
      const float inv = 1.f / l[h];
      const float* a = acc + h * g.dpad;
      for (int64_t c = 0; c < g.head_dim; ++c) o[c] = static_cast<QT>(a[c] * inv);
    }
    return;
  }
  std::copy_n(acc, g.group * g.dpad, partial);
  std::copy_n(m, g.group, partial + g.group * g.dpad);
  std::copy_n(l, g.group, partial + g.group * g.dpad + g.group);
}

// Writes Scratch's (acc, m, l) for row b, KV head kvh: acc / l into the output, or the partial.
template <typename QT>
void store_row(const Geometry& g, const Scratch& w, QT* out, int64_t b, int64_t kvh,
               float* partial) {
  store_state(g, w.acc.data(), w.m.data(), w.l.data(), out, b, kvh, partial);
}

// The rows of a chunk: each row's first partition and partition count.
struct PrefillRows {
  int64_t cached = 0, num_rows = 0;
  std::vector<int64_t> first_part, num_parts;  // per row
  int64_t part_stride = 0;                     // floats of one partition's partial
};

// Where the partials of one (query tile, KV head) live while its thread runs all of the
// tile's partitions: a thread-local buffer, row-major by (row - r0, partition - first_part),
// merged by the same thread right after (L2-resident, never a chunk-wide buffer in DRAM).
struct ItemSlots {
  const PrefillRows* all = nullptr;
  int64_t cached = 0, r0 = 0, max_np = 0;
  float* base = nullptr;
  float* slot(int64_t row, int64_t /*kvh*/, int64_t p) const {
    if (all->num_parts[row] <= 1) return nullptr;
    return base + ((row - r0) * max_np + p - all->first_part[row]) * all->part_stride;
  }
};

// One work item: query rows [r0, r1) x KV head kvh x partition p.
template <typename T, typename QT, bool kDot>
void prefill_item(const Geometry& g, const ItemSlots& rows, const QT* q, const T* kc,
                  const T* vc, const int32_t* table, QT* out, int64_t r0, int64_t r1,
                  int64_t kvh, int64_t p, Scratch& w, TileFn tile) {
  const T* kh = kc + kvh * g.k_stride_h;
  const T* vh = vc + kvh * g.v_stride_h;
  std::vector<PrefillRow>& state = thread_prefill_rows(w);
  const int64_t start = p * g.partition;
  int64_t shared_end = start, num_shared = 0;
  int64_t ends[kPrefillRows];
  for (int64_t r = r0; r < r1; ++r) {  // rows whose keys in p start at its first key
    int64_t t0 = 0, t1 = 0;
    partition_range(g, rows.cached + r + 1, p, &t0, &t1);
    ends[r - r0] = t0 == start && t1 > t0 ? t1 : start;
    if (ends[r - r0] == start) continue;
    shared_end = std::max(shared_end, t1);
    ++num_shared;
    state[r - r0].swap_with(w);
    init_row<QT, kDot>(g, q, r, kvh, w);
    state[r - r0].swap_with(w);
  }
  if (num_shared > 0) prefetch_rows(g, kh, vh, table, start, std::min(start + kTile, shared_end));
  for (int64_t t0 = start; t0 < shared_end; t0 += kTile) {
    const int64_t n_max = std::min(kTile, shared_end - t0);
    prefetch_rows(g, kh, vh, table, t0 + n_max, std::min(t0 + n_max + kTile, shared_end));
    load_tile<T, kDot>(g, kh, vh, table, t0, n_max, w);
    for (int64_t r = r0; r < r1; ++r) {
      if (ends[r - r0] <= t0) continue;
      state[r - r0].swap_with(w);
      tile(g, w, std::min(kTile, ends[r - r0] - t0));
      state[r - r0].swap_with(w);
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    int64_t t0 = 0, t1 = 0;
    partition_range(g, rows.cached + r + 1, p, &t0, &t1);
    if (t1 <= t0) continue;
    if (ends[r - r0] > start) {
      state[r - r0].swap_with(w);
      store_row(g, w, out, r, kvh, rows.slot(r, kvh, p));
      state[r - r0].swap_with(w);
    } else {  // a window starting inside p: this row's own tiles, as the decode kernel runs them
      attend<T, QT, kDot>(g, q, kc, vc, table, r, kvh, t0, t1, w, tile, false, NextRows<T>{});
      store_row(g, w, out, r, kvh, rows.slot(r, kvh, p));
    }
  }
}

#include "paged_prefill_dot.h"
#include "paged_prefill_dot_item.h"
#include "paged_attention_amx.h"

// The decode kernel's exact merge of a row's partitions (in partition order), for KV head kvh.
template <typename QT>
void merge_row(const Geometry& g, const ItemSlots& rows, QT* out, int64_t r, int64_t kvh,
               std::vector<float>& acc) {
  const int64_t np = rows.all->num_parts[r];
  const float* base = rows.slot(r, kvh, rows.all->first_part[r]);
  const int64_t stride = rows.all->part_stride;
  for (int64_t h = 0; h < g.group; ++h) {
    float mx = kNegInf;
    for (int64_t p = 0; p < np; ++p) mx = std::max(mx, base[p * stride + g.group * g.dpad + h]);
    std::fill(acc.begin(), acc.end(), 0.f);
    float den = 0.f;
    for (int64_t p = 0; p < np; ++p) {
      const float* part = base + p * stride;
      const float wgt = std::exp(part[g.group * g.dpad + h] - mx);
      den += wgt * part[g.group * g.dpad + g.group + h];
      const float* a = part + h * g.dpad;
      for (int64_t c = 0; c < g.head_dim; ++c) acc[c] += wgt * a[c];
    }
    QT* o = out + r * g.out_stride_b + (kvh * g.group + h) * g.head_dim;
    const float inv = 1.f / den;
    for (int64_t c = 0; c < g.head_dim; ++c) o[c] = static_cast<QT>(acc[c] * inv);
  }
}

// Work items (query tile, KV head), the largest first, taken by the threads one at a time
// (a loaded host's slow thread takes fewer); each runs its tile's partitions in order, then
// merges the rows that have several.
template <typename T, typename QT>
void run_prefill(const Geometry& g, int64_t cached, const at::Tensor& q, const at::Tensor& kc,
                 const at::Tensor& vc, const int32_t* table, at::Tensor& out, bool vectorized) {
  PrefillRows rows;
  rows.cached = cached;
  rows.num_rows = q.size(0);
  rows.part_stride = g.group * (g.dpad + 2);
  rows.first_part.resize(rows.num_rows);
  rows.num_parts.resize(rows.num_rows);
  for (int64_t r = 0; r < rows.num_rows; ++r) {
    const int64_t L = cached + r + 1;
    const int64_t lo = g.window > 0 ? std::max<int64_t>(0, L - g.window) : 0;
    rows.first_part[r] = lo / g.partition;
    rows.num_parts[r] = (L - 1) / g.partition - rows.first_part[r] + 1;
  }
  struct Item { int64_t r0, kvh; };
  std::vector<Item> items;
  for (int64_t r0 = (rows.num_rows - 1) / kPrefillRows * kPrefillRows; r0 >= 0; r0 -= kPrefillRows)
    for (int64_t kvh = 0; kvh < g.num_kv; ++kvh) items.push_back({r0, kvh});
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
  const QT* qp = q.data_ptr<QT>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  QT* op = out.data_ptr<QT>();
  [[maybe_unused]] void* dot_item = nullptr;  // the blocked bf16 item (a DotItemFn)
#if FS_AVX512 && FS_BF16DOT
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<QT, c10::BFloat16>)
    if (dot) dot_item = reinterpret_cast<void*>(pick_dot_item(g.head_dim));
#endif
  [[maybe_unused]] bool amx = false;
#if FS_AMX_ATTN
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<QT, c10::BFloat16>) {
    TileFn amx_tile = nullptr;
    DotItemFn amx_item = nullptr;
    if (dot && amx_prefill_for(g.group) && pick_amx(g.head_dim, &amx_tile, &amx_item)) {
      tile = amx_tile;
      dot_item = reinterpret_cast<void*>(amx_item);
      amx = true;
    }
  }
#endif
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1,
                   [&](int64_t, int64_t) {
    Scratch& w = thread_scratch(g.group, g.dpad);
    thread_local std::vector<float> partial;
    std::vector<float> acc(g.dpad);
#if FS_AMX_ATTN
    if (amx) amx_attn_configure();
#endif
    for (int64_t it = next++; it < num_items; it = next++) {
      const Item& m = items[it];
      const int64_t r1 = std::min(rows.num_rows, m.r0 + kPrefillRows);
      const int64_t p_begin = rows.first_part[m.r0];
      const int64_t p_end = rows.first_part[r1 - 1] + rows.num_parts[r1 - 1];
      ItemSlots slots{&rows, cached, m.r0, 0, nullptr};
      for (int64_t r = m.r0; r < r1; ++r) slots.max_np = std::max(slots.max_np, rows.num_parts[r]);
      // NOTE: never zeroed, as the decode kernel's partials: every slot read is written first
      const size_t need = static_cast<size_t>((r1 - m.r0) * slots.max_np * rows.part_stride);
      if (partial.size() < need) partial.resize(need);
      slots.base = partial.data();
      for (int64_t p = p_begin; p < p_end; ++p) {
#if FS_AVX512 && FS_BF16DOT
        if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<QT, c10::BFloat16>)
          if (dot_item != nullptr) {
            reinterpret_cast<DotItemFn>(dot_item)(g, slots, qp, kp, vp, table, op, m.r0, r1,
                                                  m.kvh, p, w, tile);
            continue;
          }
#endif
        if (dot)
          prefill_item<T, QT, true>(g, slots, qp, kp, vp, table, op, m.r0, r1, m.kvh, p, w, tile);
        else
          prefill_item<T, QT, false>(g, slots, qp, kp, vp, table, op, m.r0, r1, m.kvh, p, w, tile);
      }
      for (int64_t r = m.r0; r < r1; ++r)
        if (rows.num_parts[r] > 1) merge_row(g, slots, op, r, m.kvh, acc);
    }
#if FS_AMX_ATTN
    if (amx) _tile_release();
#endif
  });
}

// out[i] = attention of query row i (position cached + i) over keys [lo_i, cached + i + 1) of
// one sequence's paged cache; every row bitwise equal to paged_decode_attention's for it.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_table,
                                   int64_t cached, double scale, int64_t window,
                                   int64_t partition_size, bool vectorized) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_prefill_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3, "q must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must both be [num_kv_heads, num_blocks, block_size, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || q.scalar_type() == at::kFloat,
              "q must have the cache's dtype, or be float32 (then so is the output)");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the head_dim axis must be contiguous");
  TORCH_CHECK(block_table.dim() == 1, "block_table must be [max_blocks] (one sequence)");
  TORCH_CHECK(cached >= 0, "cached must be >= 0, got ", cached);
  TORCH_CHECK(partition_size > 0, "partition_size must be positive");
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "cache head_dim differs from q's");
  TORCH_CHECK(num_kv > 0 && num_heads % num_kv == 0, "num_heads must be a multiple of num_kv_heads");
  const at::Tensor table = block_table.to(at::kInt).contiguous();
  const int64_t max_blocks = table.size(0);
  const int32_t* tp = table.data_ptr<int32_t>();
  const int64_t total = cached + num_rows;
  TORCH_CHECK(total <= max_blocks * block_size, "cached + num_tokens = ", total,
              " exceeds the block table (", max_blocks, " blocks of ", block_size, ")");
  const int64_t lo = window > 0 ? std::max<int64_t>(0, cached + 1 - window) : 0;
  for (int64_t j = lo / block_size; j * block_size < total; ++j)  // never read outside the cache
    TORCH_CHECK(tp[j] >= 0 && tp[j] < num_blocks, "block_table[", j, "] = ", tp[j],
                " is not a block of the cache");
  at::Tensor out = at::empty({num_rows, num_heads, head_dim}, q.options());
  if (num_rows == 0) return out;
  const Geometry g = make_geometry(q, k_cache, v_cache, num_heads, num_kv, head_dim, block_size,
                                   max_blocks, partition_size, window, scale);
  const bool q_f32 = q.scalar_type() == at::kFloat;
  switch (k_cache.scalar_type()) {
    case at::kFloat: run_prefill<float, float>(g, cached, q, k_cache, v_cache, tp, out, vectorized); break;
    case at::kBFloat16:
      if (q_f32) run_prefill<c10::BFloat16, float>(g, cached, q, k_cache, v_cache, tp, out, vectorized);
      else run_prefill<c10::BFloat16, c10::BFloat16>(g, cached, q, k_cache, v_cache, tp, out, vectorized);
      break;
    case at::kHalf:
      if (q_f32) run_prefill<c10::Half, float>(g, cached, q, k_cache, v_cache, tp, out, vectorized);
      else run_prefill<c10::Half, c10::Half>(g, cached, q, k_cache, v_cache, tp, out, vectorized);
      break;
    default: TORCH_CHECK(false, "paged_prefill_attention: float32, bfloat16 or float16 caches only");
  }
  return out;
}
