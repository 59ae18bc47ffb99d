// The bf16 prefill's work item (bf16 q and cache, VDPBF16PS builds): one (query tile, KV head,
// partition) through dot_tile (paged_prefill_dot.h), each row bitwise what its own tiles give.
//
// Included by paged_prefill.h (anonymous namespace of paged_attention.cpp) after prefill_item:
// it uses ItemSlots, store_state, store_row, load_tile and attend defined before it.
#pragma once

#if FS_AVX512 && FS_BF16DOT
// prefill_item for bf16 q and cache with the rows' tiles run together by rows_tile (called as
// rows_tile(g, st, w, ends, nrows, t0, n_max) per key tile: dot_tile, or the AMX tile of
// paged_attention_amx.h), each row bitwise what its own tile gives.
template <class RowsTile>
void prefill_item_rows(const Geometry& g, const ItemSlots& rows, const c10::BFloat16* q,
                       const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table,
                       c10::BFloat16* out, int64_t r0, int64_t r1, int64_t kvh, int64_t p,
                       Scratch& w, TileFn tile, RowsTile rows_tile) {
  const c10::BFloat16* kh = kc + kvh * g.k_stride_h;
  const c10::BFloat16* vh = vc + kvh * g.v_stride_h;
  DotRows& st = thread_dot_rows(g);
  const int64_t start = p * g.partition, G = g.group;
  int64_t shared_end = start, num_shared = 0;
  int64_t ends[kPrefillRows];
  for (int64_t r = r0; r < r1; ++r) {  // rows whose keys in p start at its first key
    int64_t t0 = 0, t1 = 0;
    partition_range(g, rows.cached + r + 1, p, &t0, &t1);
    ends[r - r0] = t0 == start && t1 > t0 ? t1 : start;
    if (ends[r - r0] == start) continue;
    shared_end = std::max(shared_end, t1);
    ++num_shared;
    for (int64_t h = 0; h < G; ++h) {  // init_row's state: raw q pairs, acc 0, m -inf, l 0
      const int64_t rh = (r - r0) * G + h;
      uint32_t* qd = st.qp.data() + rh * st.qstride;
      std::fill(qd, qd + st.qstride, 0u);
      std::memcpy(qd, q + r * g.q_stride_b + (kvh * G + h) * g.q_stride_h,
                  g.head_dim * sizeof(uint16_t));
      std::fill(st.acc.data() + rh * g.dpad, st.acc.data() + (rh + 1) * g.dpad, 0.f);
      st.m[rh] = kNegInf;
      st.l[rh] = 0.f;
    }
  }
  if (num_shared > 0) prefetch_rows(g, kh, vh, table, start, std::min(start + kTile, shared_end));
  for (int64_t t0 = start; t0 < shared_end; t0 += kTile) {
    const int64_t n_max = std::min(kTile, shared_end - t0);
    prefetch_rows(g, kh, vh, table, t0 + n_max, std::min(t0 + n_max + kTile, shared_end));
    load_tile<c10::BFloat16, true>(g, kh, vh, table, t0, n_max, w);
    rows_tile(g, st, w, ends, r1 - r0, t0, n_max);
  }
  for (int64_t r = r0; r < r1; ++r) {
    int64_t t0 = 0, t1 = 0;
    partition_range(g, rows.cached + r + 1, p, &t0, &t1);
    if (t1 <= t0) continue;
    const int64_t rh = (r - r0) * G;
    if (ends[r - r0] > start) {
      store_state(g, st.acc.data() + rh * g.dpad, st.m.data() + rh, st.l.data() + rh, out, r,
                  kvh, rows.slot(r, kvh, p));
    } else {  // a window starting inside p: this row's own tiles, as the decode kernel runs them
      attend<c10::BFloat16, c10::BFloat16, true>(g, q, kc, vc, table, r, kvh, t0, t1, w, tile,
                                                 false, NextRows<c10::BFloat16>{});
      store_row(g, w, out, r, kvh, rows.slot(r, kvh, p));
    }
  }
}

// The VDPBF16PS build's item: dot_tile (several rows x heads per K/V load).
template <int NCH>
void prefill_item_dot(const Geometry& g, const ItemSlots& rows, const c10::BFloat16* q,
                      const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table,
                      c10::BFloat16* out, int64_t r0, int64_t r1, int64_t kvh, int64_t p,
                      Scratch& w, TileFn tile) {
  prefill_item_rows(g, rows, q, kc, vc, table, out, r0, r1, kvh, p, w, tile,
                    [](const Geometry& gg, DotRows& st, const Scratch& ws, const int64_t* ends,
                       int64_t nrows, int64_t t0, int64_t n_max) {
                      dot_tile<NCH>(gg, st, ws, ends, nrows, t0, n_max);
                    });
}

using DotItemFn = void (*)(const Geometry&, const ItemSlots&, const c10::BFloat16*,
                           const c10::BFloat16*, const c10::BFloat16*, const int32_t*,
                           c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, Scratch&, TileFn);

// The blocked item for this head_dim (the head_dims pick_tile_for vectorises), or nullptr.
inline DotItemFn pick_dot_item(int64_t head_dim) {
  switch ((head_dim + kLanes - 1) / kLanes) {
    case 1: return &prefill_item_dot<1>;
    case 2: return &prefill_item_dot<2>;
    case 3: return &prefill_item_dot<3>;
    case 4: return &prefill_item_dot<4>;
    case 5: return &prefill_item_dot<5>;
    case 6: return &prefill_item_dot<6>;
    case 7: return &prefill_item_dot<7>;
    case 8: return &prefill_item_dot<8>;
    case 12: return &prefill_item_dot<12>;
    case 16: return &prefill_item_dot<16>;
    default: return nullptr;
  }
}
#endif  // FS_AVX512 && FS_BF16DOT
