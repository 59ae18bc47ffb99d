// One work item of the quantized decode kernel (paged_attention_kvq.cpp): keys [t_begin, t_end)
// of one sequence for one KV head, tile by tile, leaving the group's (acc, m, l) in the thread's
// scratch. The AVX-512 group path reads the code rows in place (kvq_group_avx512.h); the other
// tiers widen a tile into fp32 rows first (kvq_tile_ops.h). Include after kvq_tile_ops.h.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "line_queue.h"

namespace {

struct QGeometry {
  int64_t num_kv, group, head_dim, dpad, block_size, max_blocks, partition, window;
  int64_t q_stride_b, q_stride_h, out_stride_b;
  int64_t kc_h, kc_blk, kc_tok, vc_h, vc_blk, vc_tok;  // code strides (elements = bytes)
  int64_t ks_h, ks_blk, ks_in;  // K scales: [h, block, token or channel]
  int64_t vs_h, vs_blk, vs_tok;
  float q_scale;   // softmax scale x the codec factor, folded into q
  float v_factor;  // the codec factor, folded into p
  bool channel_keys;
};

// Per-thread scratch, sized for the largest (group, dpad) seen; every item overwrites it.
struct QScratch {
  std::vector<float> q, qb, k, v, s, p, acc, m, l, ks, vs, part;
  std::vector<const float*> krow, vrow;
  std::vector<const uint8_t*> kcode, vcode;  // the tile's code rows (the group path)
  std::vector<int64_t> seg_first, seg_page;
  fitserve::LineQueue pf;  // the next tile's scale and code lines
  int64_t g_cap = 0, d_cap = 0;
  void reserve(int64_t g, int64_t dpad) {
    if (g <= g_cap && dpad <= d_cap) return;
    g_cap = std::max(g, g_cap);
    d_cap = std::max(dpad, d_cap);
    q.assign(g_cap * d_cap, 0.f);
    acc.assign(g_cap * d_cap, 0.f);
    qb.assign(g_cap * d_cap, 0.f);
    part.assign(g_cap * kLanes * kLanes, 0.f);
    k.assign(kTile * d_cap, 0.f);
    v.assign(kTile * d_cap, 0.f);
    s.assign(g_cap * kTile, 0.f);
    p.assign(kTile, 0.f);
    m.assign(g_cap, 0.f);
    l.assign(g_cap, 0.f);
    ks.assign(kTile, 0.f);
    vs.assign(kTile, 0.f);
    seg_first.assign(kTile + 1, 0);
    seg_page.assign(kTile + 1, 0);
    krow.resize(kTile);
    vrow.resize(kTile);
    kcode.resize(kTile);
    vcode.resize(kTile);
  }
};

inline QScratch& thread_scratch(int64_t g, int64_t dpad) {
  thread_local QScratch w;
  w.reserve(g, dpad);
  for (int64_t i = 0; i < kTile; ++i) {  // rows of the tile buffers at this dpad
    w.krow[i] = w.k.data() + i * dpad;
    w.vrow[i] = w.v.data() + i * dpad;
  }
  return w;
}

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }

// The lines of keys [t_from, t_to) queued in pf: first every block's K / V scale lines (the
// tile reads them all before its first score), then each block's K and V code rows. Blocks sit
// at random places of the pool (the hardware prefetcher loses the stream at each) and their
// scale lines are in other arrays again, so none of this is predicted.
inline void queue_tile(const QGeometry& g, const uint8_t* kh, const uint8_t* vh, const float* ksh,
                       const float* vsh, const int32_t* table, int64_t t_from, int64_t t_to,
                       fitserve::LineQueue& pf) {
  pf.clear();
  if (t_to <= t_from) return;
  const int64_t bs = g.block_size, first = t_from / bs, last = (t_to - 1) / bs;
  // keys [from, from + cnt) of block blk are in [t_from, t_to)
  auto span = [&](int64_t blk, int64_t* from, int64_t* cnt) {
    *from = blk == first ? t_from % bs : 0;
    *cnt = (blk == last ? (t_to - 1) % bs + 1 : bs) - *from;
  };
  int64_t from = 0, cnt = 0;
  for (int64_t blk = first; blk <= last; ++blk) {
    const int64_t page = table[blk];
    span(blk, &from, &cnt);
    pf.add(vsh + page * g.vs_blk + from * g.vs_tok, ((cnt - 1) * g.vs_tok + 1) * 4);
    if (g.channel_keys) pf.add(ksh + page * g.ks_blk, ((g.head_dim - 1) * g.ks_in + 1) * 4);
    else pf.add(ksh + page * g.ks_blk + from * g.ks_in, ((cnt - 1) * g.ks_in + 1) * 4);
  }
  for (int64_t blk = first; blk <= last; ++blk) {
    const int64_t page = table[blk];
    span(blk, &from, &cnt);
    const uint8_t* kr = kh + page * g.kc_blk + from * g.kc_tok;
    const uint8_t* vr = vh + page * g.vc_blk + from * g.vc_tok;
    if (g.kc_tok == g.head_dim) pf.add(kr, cnt * g.head_dim);
    else for (int64_t i = 0; i < cnt; ++i) pf.add(kr + i * g.kc_tok, g.head_dim);
    if (g.vc_tok == g.head_dim) pf.add(vr, cnt * g.head_dim);
    else for (int64_t i = 0; i < cnt; ++i) pf.add(vr + i * g.vc_tok, g.head_dim);
  }
}

// Keys [t0, t0 + n) of the item into the tile buffers: widened rows, V's folded scales, K's
// per-token scales, and (per-channel K) the runs of keys that share a block.
inline int64_t load_tile(const QGeometry& g, const TileOps& ops, const uint8_t* kh,
                         const uint8_t* vh, const float* ksh, const float* vsh,
                         const int32_t* table, int64_t t0, int64_t n, QScratch& w) {
  int64_t blk = t0 / g.block_size, off = t0 % g.block_size, nseg = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t page = table[blk];
    if (i == 0 || off == 0) {
      w.seg_first[nseg] = i;
      w.seg_page[nseg++] = page;
    }
    ops.to_float(kh + page * g.kc_blk + off * g.kc_tok, w.k.data() + i * g.dpad, g.head_dim, g.dpad);
    ops.to_float(vh + page * g.vc_blk + off * g.vc_tok, w.v.data() + i * g.dpad, g.head_dim, g.dpad);
    w.vs[i] = vsh[page * g.vs_blk + off * g.vs_tok] * g.v_factor;
    if (!g.channel_keys) w.ks[i] = ksh[page * g.ks_blk + off * g.ks_in];
    if (++off == g.block_size) {
      off = 0;
      ++blk;
    }
  }
  w.seg_first[nseg] = n;
  return nseg;
}

// Code row pointers and scales of keys [t0, t0 + n) and the runs of keys sharing a block:
// one table read per block, then pointer steps (the strides held in locals: stores into w
// would otherwise make the compiler reload g's fields for every key).
inline int64_t gather_tile(const QGeometry& g, const uint8_t* kh, const uint8_t* vh,
                           const float* ksh, const float* vsh, const int32_t* table, int64_t t0,
                           int64_t n, QScratch& w) {
  const int64_t bs = g.block_size, kc_tok = g.kc_tok, vc_tok = g.vc_tok, vs_tok = g.vs_tok,
                ks_in = g.ks_in;
  const float vf = g.v_factor;
  const bool token_keys = !g.channel_keys;
  const uint8_t** kcode = w.kcode.data();
  const uint8_t** vcode = w.vcode.data();
  float* vs = w.vs.data();
  float* ks = w.ks.data();
  int64_t blk = t0 / bs, off = t0 % bs, nseg = 0;
  for (int64_t i = 0; i < n; ++blk, off = 0) {
    const int64_t page = table[blk], len = std::min(bs - off, n - i);
    w.seg_first[nseg] = i;
    w.seg_page[nseg++] = page;
    const uint8_t* kr = kh + page * g.kc_blk + off * kc_tok;
    const uint8_t* vr = vh + page * g.vc_blk + off * vc_tok;
    const float* vsr = vsh + page * g.vs_blk + off * vs_tok;
    const float* ksr = ksh + page * g.ks_blk + off * ks_in;
    for (int64_t j = 0; j < len; ++j) {
      kcode[i + j] = kr + j * kc_tok;
      vcode[i + j] = vr + j * vc_tok;
      vs[i + j] = vsr[j * vs_tok] * vf;
    }
    if (token_keys)
      for (int64_t j = 0; j < len; ++j) ks[i + j] = ksr[j * ks_in];
    i += len;
  }
  w.seg_first[nseg] = n;
  return nseg;
}

// One tile of the group path (ops.group_scores / group_pv): scores of every head from the K
// codes (q folded with each block's channel scales, or scores times per-token scales), the
// online softmax per head, p times V's scales, then P @ V from the V codes.
inline void group_tile(const QGeometry& g, const TileOps& ops, const float* ksh, int64_t n,
                       int64_t nseg, QScratch& w) {
  const int64_t d = g.head_dim, dp = g.dpad, G = g.group;
  float* s = w.s.data();
  // the next tile's queued lines, a share at each 16-key block of the scores (the most a
  // segment split adds is one block per segment); the rest before P @ V
  const int64_t per_block = w.pf.share((n + kLanes - 1) / kLanes);
  if (g.channel_keys) {
    for (int64_t sg = 0; sg < nseg; ++sg) {
      const float* kscale = ksh + w.seg_page[sg] * g.ks_blk;
      const int64_t i0 = w.seg_first[sg];
      if (g.ks_in == 1) {  // the fold inside group_scores (in registers where q is held)
        ops.group_scores(w.q.data(), G, dp, kscale, w.qb.data(), w.kcode.data() + i0,
                         w.seg_first[sg + 1] - i0, d, s + i0, w.part.data(), &w.pf, per_block);
        continue;
      }
      for (int64_t h = 0; h < G; ++h) {
        for (int64_t c = 0; c < d; ++c) w.qb[h * dp + c] = w.q[h * dp + c] * kscale[c * g.ks_in];
        std::fill(w.qb.data() + h * dp + d, w.qb.data() + (h + 1) * dp, 0.f);
      }
      ops.group_scores(w.qb.data(), G, dp, nullptr, nullptr, w.kcode.data() + i0,
                       w.seg_first[sg + 1] - i0, d, s + i0, w.part.data(), &w.pf, per_block);
    }
  } else {
    ops.group_scores(w.q.data(), G, dp, nullptr, nullptr, w.kcode.data(), n, d, s,
                     w.part.data(), &w.pf, per_block);
    for (int64_t h = 0; h < G; ++h)
      for (int64_t i = 0; i < n; ++i) s[h * kTile + i] *= w.ks[i];
  }
  for (int64_t h = 0; h < G; ++h) {
    float* sh = s + h * kTile;
    ops.softmax(sh, n, &w.m[h], &w.l[h], w.acc.data() + h * dp, dp);
    for (int64_t i = 0; i < n; ++i) sh[i] *= w.vs[i];
  }
  w.pf.issue(w.pf.left());
  ops.group_pv(w.acc.data(), G, dp, s, w.vcode.data(), n, d);
}

// The first tile of the item a thread runs next: the current item's last tile prefetches it
// (as paged_attention.cpp does; at W1 an item is 4 tiles, and its first was a demand miss).
struct NextTile {
  const uint8_t *kh = nullptr, *vh = nullptr;
  const float *ksh = nullptr, *vsh = nullptr;
  const int32_t* table = nullptr;
  int64_t t_from = 0, t_to = 0;
};

// One work item: keys [t_begin, t_end) of sequence b for KV head kvh; leaves (acc, m, l) in w.
template <typename QT>
void attend(const QGeometry& g, const TileOps& ops, const QT* q, const uint8_t* kc,
            const uint8_t* vc, const float* ksc, const float* vsc, const int32_t* table,
            int64_t b, int64_t kvh, int64_t t_begin, int64_t t_end, QScratch& w,
            bool first_prefetched, const NextTile& next) {
  const int64_t d = g.head_dim, dp = g.dpad;
  for (int64_t h = 0; h < g.group; ++h) {
    const QT* qr = q + b * g.q_stride_b + (kvh * g.group + h) * g.q_stride_h;
    float* qf = w.q.data() + h * dp;
    for (int64_t c = 0; c < d; ++c) qf[c] = to_f(qr[c]) * g.q_scale;
    std::fill(qf + d, qf + dp, 0.f);
    std::fill(w.acc.data() + h * dp, w.acc.data() + (h + 1) * dp, 0.f);
    w.m[h] = kNegInf;
    w.l[h] = 0.f;
  }
  const uint8_t* kh = kc + kvh * g.kc_h;
  const uint8_t* vh = vc + kvh * g.vc_h;
  const float* ksh = ksc + kvh * g.ks_h;
  const float* vsh = vsc + kvh * g.vs_h;
  // NOTE: the scale lines go with their tile's codes, one tile ahead (all of an item's at its
  // start was a burst of up to 80 prefetches for 16 blocks, queued behind the first tile's)
  if (!first_prefetched) {
    queue_tile(g, kh, vh, ksh, vsh, table, t_begin, std::min(t_begin + kTile, t_end), w.pf);
    w.pf.issue(w.pf.left());
  }
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    const int64_t n = std::min(kTile, t_end - t0);
    if (t0 + n < t_end)  // the next tile, else the next item's first
      queue_tile(g, kh, vh, ksh, vsh, table, t0 + n, std::min(t0 + n + kTile, t_end), w.pf);
    else
      queue_tile(g, next.kh, next.vh, next.ksh, next.vsh, next.table, next.t_from, next.t_to,
                 w.pf);
    if (ops.group_scores != nullptr) {
      group_tile(g, ops, ksh, n, gather_tile(g, kh, vh, ksh, vsh, table, t0, n, w), w);
      continue;
    }
    w.pf.issue(w.pf.left());  // the fp32 tiers: at once
    const int64_t nseg = load_tile(g, ops, kh, vh, ksh, vsh, table, t0, n, w);
    for (int64_t h = 0; h < g.group; ++h) {
      float* s = w.s.data() + h * kTile;
      float* acc = w.acc.data() + h * dp;
      const float* qf = w.q.data() + h * dp;
      if (g.channel_keys) {
        for (int64_t sg = 0; sg < nseg; ++sg) {  // q' = q (.) the block's channel scales
          const float* kscale = ksh + w.seg_page[sg] * g.ks_blk;
          for (int64_t c = 0; c < d; ++c) w.qb[c] = qf[c] * kscale[c * g.ks_in];
          const int64_t i0 = w.seg_first[sg];
          ops.scores(w.qb.data(), w.krow.data() + i0, w.seg_first[sg + 1] - i0, d, s + i0);
        }
      } else {
        ops.scores(qf, w.krow.data(), n, d, s);
        for (int64_t i = 0; i < n; ++i) s[i] *= w.ks[i];
      }
      ops.softmax(s, n, &w.m[h], &w.l[h], acc, dp);
      for (int64_t i = 0; i < n; ++i) w.p[i] = s[i] * w.vs[i];
      ops.pv(acc, w.p.data(), w.vrow.data(), n, d);
    }
  }
}

}  // namespace
