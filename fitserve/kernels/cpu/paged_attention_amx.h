// The bf16 attention step on AMX-BF16 tiles (bf16 q and cache; compiled where the CPU has
// AMX-BF16, FITSERVE_AMX_BF16, and used when the OS grants the tile state): one online-softmax
// step of up to 16 "row-heads" (a decode row's G query heads, or a prefill item's rows x heads)
// over a tile of n <= kTile keys of one KV head.
//
//   S  = Q . K^T   A: Q [16 row-heads][32 dims as bf16 pairs]; B: K^T, the tile's keys
//                  transposed to keys-in-lanes (transpose_k_tile, the VDPBF16PS prefill's);
//                  C: S [16][16 keys], fp32; chunks of 32 dims summed in order into zero.
//   softmax        s = S * scale, then softmax_step_avx512 per row-head (the decode kernel's).
//   O += P . V     A: P [16][32 keys] as two bf16 parts, P = hi + lo (hi = P rounded to
//                  bf16, lo = the rest rounded to bf16: P to ~2^-17, so the outputs stay
//                  correctly rounded as the fp32 P of the other tiles keeps them), each part a
//                  tile dot in turn; B: V with the keys in pairs (vt: key 2r and 2r+1 of 16
//                  columns in row r); C: acc [16][16 dims].
//
// NOTE: batch invariance. Element (r, j) of a tile product depends only on row r of A, column
// j of B and C's (r, j), so a row-head's scores and P . V are the same bits whichever row-heads
// share its tile; keys a row does not see enter as P = 0 against zero-padded K / V (exact
// zeros). The decode tile (tile_amx) and the prefill item (prefill_item_amx) run these steps
// per row-head, so every prefill row keeps the decode kernel's bits, as on the other tiers.
// The bits differ from the VDPBF16PS tile's (another summation order, P in two parts), so a
// model runs one or the other for both ops (amx_decode_for / amx_prefill_for: paged_attention.cpp
// says which, by the query heads per KV head).
//
// Tiles: 0 = A (Q), 1 = B (K^T), 2-3 = C (S, two key groups), 4 = A (P), 5 = B (V), 6-7 = C
// (acc, two 16-column blocks); every tile 16 rows x 64 bytes.
//
// Included by paged_prefill.h (anonymous namespace of paged_attention.cpp) after the bf16
// prefill's headers: it uses transpose_k_tile, DotRows and prefill_item_rows.
#pragma once

#if FS_AMX_ATTN

constexpr int64_t kAmxRowHeads = 16;  // row-heads per tile (A / C rows)

void amx_attn_configure() {
  fitserve::AmxConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  fitserve::amx_load_config(c);
}

// Per-thread tile buffers, sized for the largest head_dim / group seen.
struct AmxAttnBufs {
  std::vector<uint32_t> kt;  // [pair (c * 16 + i)][key 0..kTile): transpose_k_tile's layout
  std::vector<uint32_t> vt;  // [32-key chunk][16-column block][pair row 0..16][16 columns]
  std::vector<uint16_t> q;   // decode: A rows of 16 row-heads, [16][nc * 32]
  std::vector<float> s, acc;  // decode: [16][kTile], [16][dpad]
  std::vector<uint16_t> p;   // P's bf16 parts: [row-head][hi: kTile, lo: kTile]
  void reserve(const Geometry& g, int64_t row_heads) {
    const int64_t nc = (g.head_dim + 31) / 32, ndc = g.dpad / kLanes;
    auto grow = [](auto& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.assign(n, 0);
    };
    grow(kt, nc * kLanes * kTile);
    grow(vt, (kTile / 32) * ndc * 256);
    grow(q, kAmxRowHeads * nc * 32);
    grow(s, kAmxRowHeads * kTile);
    grow(acc, kAmxRowHeads * g.dpad);
    grow(p, std::max(row_heads, kAmxRowHeads) * 2 * kTile);
  }
};

inline AmxAttnBufs& thread_amx_bufs(const Geometry& g, int64_t row_heads) {
  thread_local AmxAttnBufs b;
  b.reserve(g, row_heads);
  return b;
}

// vt <- the V rows of keys [0, n) with the keys in pairs: row r of (chunk kc, block dc) holds,
// for the 16 columns dc * 16 + j, key 32 kc + 2 r in the low half of dword j and the next key
// in the high half; keys past n and columns past head_dim are zero.
inline void build_vt(const Geometry& g, const uint16_t* const* rows, int64_t n, uint32_t* vt) {
  const int64_t ndc = g.dpad / kLanes, nkc = (n + 31) / 32;
  // qwords of unpacklo / unpackhi (a's and b's 16-bit columns interleaved per 128-bit lane) in
  // column order: columns 0-15 of the 32 are lo.L0, hi.L0, lo.L1, hi.L1; 16-31 the L2, L3 ones
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int64_t kc = 0; kc < nkc; ++kc)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t a = kc * 32 + 2 * r, b = a + 1;
      for (int64_t dc = 0; dc < ndc; dc += 2) {
        const int64_t rest = g.head_dim - dc * kLanes;
        const __mmask32 m = rest >= 32 ? 0xFFFFFFFFu : ((1u << rest) - 1u);
        const __m512i va = a < n ? _mm512_maskz_loadu_epi16(m, rows[a] + dc * kLanes)
                                 : _mm512_setzero_si512();
        const __m512i vb = b < n ? _mm512_maskz_loadu_epi16(m, rows[b] + dc * kLanes)
                                 : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi16(va, vb), hi = _mm512_unpackhi_epi16(va, vb);
        _mm512_storeu_si512(vt + ((kc * ndc + dc) * 16 + r) * 16,
                            _mm512_permutex2var_epi64(lo, first, hi));
        if (dc + 1 < ndc)
          _mm512_storeu_si512(vt + ((kc * ndc + dc + 1) * 16 + r) * 16,
                              _mm512_permutex2var_epi64(lo, second, hi));
      }
    }
}

// S [16][16 * nkg] (row stride ss bytes) = Q (A rows at q, stride qs bytes) . K^T, nc chunks.
inline void amx_scores(const void* q, int64_t qs, int64_t nc, const uint32_t* kt, int64_t nkg,
                       float* s, int64_t ss) {
  const char* qb = static_cast<const char*>(q);
  for (int64_t kg = 0; kg < nkg; kg += 2) {
    const bool two = kg + 1 < nkg;
    _tile_zero(2);
    if (two) _tile_zero(3);
    for (int64_t c = 0; c < nc; ++c) {
      _tile_loadd(0, qb + c * 64, qs);
      _tile_loadd(1, kt + c * kLanes * kTile + kg * kLanes, kTile * 4);
      _tile_dpbf16ps(2, 0, 1);
      if (two) {
        _tile_loadd(1, kt + c * kLanes * kTile + (kg + 1) * kLanes, kTile * 4);
        _tile_dpbf16ps(3, 0, 1);
      }
    }
    _tile_stored(2, s + kg * kLanes, ss);
    if (two) _tile_stored(3, s + (kg + 1) * kLanes, ss);
  }
}

// acc [16][dpad] (row stride as bytes) += P . V, nkc key chunks; P's hi part at p, its lo part
// kTile further, rows ps bytes apart.
inline void amx_pv(const Geometry& g, const uint16_t* p, int64_t ps, const uint32_t* vt,
                   int64_t nkc, float* acc, int64_t as) {
  const int64_t ndc = g.dpad / kLanes;
  for (int64_t dc = 0; dc < ndc; dc += 2) {
    const bool two = dc + 1 < ndc;
    _tile_loadd(6, acc + dc * kLanes, as);
    if (two) _tile_loadd(7, acc + (dc + 1) * kLanes, as);
    for (int64_t kc = 0; kc < nkc; ++kc) {
      for (int64_t part = 0; part < 2; ++part) {  // hi, then lo
        _tile_loadd(4, p + part * kTile + kc * 32, ps);
        _tile_loadd(5, vt + (kc * ndc + dc) * 256, 64);
        _tile_dpbf16ps(6, 4, 5);
        if (two) {
          _tile_loadd(5, vt + (kc * ndc + dc + 1) * 256, 64);
          _tile_dpbf16ps(7, 4, 5);
        }
      }
    }
    _tile_stored(6, acc + dc * kLanes, as);
    if (two) _tile_stored(7, acc + (dc + 1) * kLanes, as);
  }
}

inline __mmask16 mask_upto(int64_t n) { return n <= 0 ? 0 : tail_mask(n); }

// One row-head's step: s[0..n) *= scale, the decode kernel's online-softmax step (m, l, acc
// rescaled), then P's bf16 parts into p[0..npad) (hi) and p[kTile..kTile + npad) (lo), zeros
// past n.
inline void softmax_to_p(float* s, int64_t n, float scale, float* m, float* l, float* acc,
                         int64_t dpad, uint16_t* p, int64_t npad) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(s + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), sc));
  }
  softmax_step_avx512(s, n, m, l, acc, dpad);
  for (int64_t i = 0; i < npad; i += 32) {
    const __m512 lo = _mm512_maskz_loadu_ps(mask_upto(n - i), s + i);
    const __m512 hi = _mm512_maskz_loadu_ps(mask_upto(n - i - 16), s + i + 16);
    const __m512i top = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 in the low half
    const __m512 lo_r = bf16x16_to_f32(_mm512_castsi512_si256(top));
    const __m512 hi_r = bf16x16_to_f32(_mm512_extracti64x4_epi64(top, 1));
    _mm512_storeu_si512(p + i, top);
    _mm512_storeu_si512(p + kTile + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(hi, hi_r),
                                                                      _mm512_sub_ps(lo, lo_r)));
  }
}

// The decode tile (TileFn) on AMX: Scratch's G row-heads, 16 at a time.
template <int NC2>
void tile_amx(const Geometry& g, Scratch& w, int64_t n) {
  AmxAttnBufs& b = thread_amx_bufs(g, kAmxRowHeads);
  const int64_t nkg = (n + kLanes - 1) / kLanes, nkc = (n + 31) / 32, qrow = NC2 * 32;
  transpose_k_tile<NC2>(g, w.kraw.data(), n, b.kt.data());
  w.pf.issue(w.pf.share(2));  // half of the next tile's lines, the rest after the V transpose
  build_vt(g, w.vraw.data(), n, b.vt.data());
  w.pf.issue(w.pf.left());
  for (int64_t h0 = 0; h0 < g.group; h0 += kAmxRowHeads) {
    const int64_t mh = std::min(kAmxRowHeads, g.group - h0);
    for (int64_t r = 0; r < mh; ++r)  // rows past mh: stale but never read back
      std::memcpy(b.q.data() + r * qrow, w.qb.data() + (h0 + r) * (g.dpad + 2 * kLanes),
                  qrow * sizeof(uint16_t));
    amx_scores(b.q.data(), qrow * 2, NC2, b.kt.data(), nkg, b.s.data(), kTile * 4);
    for (int64_t r = 0; r < mh; ++r) {
      float* acc = w.acc.data() + (h0 + r) * g.dpad;
      softmax_to_p(b.s.data() + r * kTile, n, g.scale, &w.m[h0 + r], &w.l[h0 + r], acc, g.dpad,
                   b.p.data() + r * 2 * kTile, nkc * 32);
      std::memcpy(b.acc.data() + r * g.dpad, acc, g.dpad * sizeof(float));
    }
    amx_pv(g, b.p.data(), kTile * 4, b.vt.data(), nkc, b.acc.data(), g.dpad * 4);
    for (int64_t r = 0; r < mh; ++r)
      std::memcpy(w.acc.data() + (h0 + r) * g.dpad, b.acc.data() + r * g.dpad,
                  g.dpad * sizeof(float));
  }
}

// The tile of a prefill item's row-heads on AMX (dot_tile's job): every row-head whose row
// sees keys of [t0, t0 + n_max) runs tile_amx's steps on its own (acc, m, l).
template <int NC2>
void amx_rows_tile(const Geometry& g, DotRows& st, AmxAttnBufs& b, const Scratch& w,
                   const int64_t* ends, int64_t nrows, int64_t t0, int64_t n_max) {
  const int64_t G = g.group, nrh = nrows * G;
  transpose_k_tile<NC2>(g, w.kraw.data(), n_max, b.kt.data());
  build_vt(g, w.vraw.data(), n_max, b.vt.data());
  for (int64_t m0 = 0; m0 < nrh; m0 += kAmxRowHeads) {
    const int64_t me = std::min(nrh, m0 + kAmxRowHeads);
    int64_t n_tile = 0;  // the most keys a row-head of this tile sees
    for (int64_t rh = m0; rh < me; ++rh)
      n_tile = std::max(n_tile, std::min(kTile, ends[rh / G] - t0));
    if (n_tile <= 0) continue;  // no row-head sees this tile: their state stays as it is
    const int64_t nkg = (n_tile + kLanes - 1) / kLanes, nkc = (n_tile + 31) / 32;
    amx_scores(st.qp.data() + m0 * st.qstride, st.qstride * 4, NC2, b.kt.data(), nkg,
               st.s.data() + m0 * kTile, kTile * 4);
    for (int64_t rh = m0; rh < m0 + kAmxRowHeads; ++rh) {
      uint16_t* p = b.p.data() + rh * 2 * kTile;
      const int64_t n = rh < me ? std::min(kTile, ends[rh / G] - t0) : 0;
      if (n <= 0) {  // P = 0: the row-head's acc gains exact zeros
        std::fill(p, p + nkc * 32, uint16_t{0});
        std::fill(p + kTile, p + kTile + nkc * 32, uint16_t{0});
        continue;
      }
      softmax_to_p(st.s.data() + rh * kTile, n, g.scale, &st.m[rh], &st.l[rh],
                   st.acc.data() + rh * g.dpad, g.dpad, p, nkc * 32);
    }
    amx_pv(g, b.p.data() + m0 * 2 * kTile, kTile * 4, b.vt.data(), nkc,
           st.acc.data() + m0 * g.dpad, g.dpad * 4);
  }
}

// The prefill item on AMX: prefill_item_rows with amx_rows_tile for the rows' tiles (and
// tile_amx, the TileFn it is given, for a row of its own).
template <int NC2>
void prefill_item_amx(const Geometry& g, const ItemSlots& rows, const c10::BFloat16* q,
                      const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table,
                      c10::BFloat16* out, int64_t r0, int64_t r1, int64_t kvh, int64_t p,
                      Scratch& w, TileFn tile) {
  AmxAttnBufs& b = thread_amx_bufs(g, kPrefillRows * g.group);
  prefill_item_rows(g, rows, q, kc, vc, table, out, r0, r1, kvh, p, w, tile,
                    [&b](const Geometry& gg, DotRows& st, const Scratch& ws, const int64_t* ends,
                         int64_t nrows, int64_t t0, int64_t n_max) {
                      amx_rows_tile<NC2>(gg, st, b, ws, ends, nrows, t0, n_max);
                    });
}

// The AMX tile and prefill item for this head_dim (up to 256), or nullptrs.
inline bool pick_amx(int64_t head_dim, TileFn* tile, DotItemFn* item) {
  switch ((head_dim + 31) / 32) {
#define FS_AMX_CASE(n)                 \
  case n:                              \
    *tile = &tile_amx<n>;              \
    *item = &prefill_item_amx<n>;      \
    return true;
    FS_AMX_CASE(1)
    FS_AMX_CASE(2)
    FS_AMX_CASE(3)
    FS_AMX_CASE(4)
    FS_AMX_CASE(5)
    FS_AMX_CASE(6)
    FS_AMX_CASE(7)
    FS_AMX_CASE(8)
#undef FS_AMX_CASE
    default: return false;
  }
}

TileFn amx_decode_tile(int64_t head_dim) {
  TileFn tile = nullptr;
  DotItemFn item = nullptr;
  return pick_amx(head_dim, &tile, &item) ? tile : nullptr;
}

#endif  // FS_AMX_ATTN
