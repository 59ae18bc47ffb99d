// The register-blocked tile of the bf16 prefill (bf16 q and cache, VDPBF16PS builds): several
// query rows x heads per K/V load, every row bitwise the decode kernel's (tile_avx512<NCH, true>).
//
// Scores. The decode kernel computes, per (row, head) and key, a 16-lane vector x with lane i
// = the VDPBF16PS chain over the head's chunks c (the last chunk first, from zero, then 0, 1,
// ...) of q's bf16 pair i of chunk c times K's, and reduce16 sums the lanes in the fixed tree
//
//   S_b = (x[4b] + x[4b+2]) + (x[4b+1] + x[4b+3]),   s = ((S_0 + S_1) + (S_2 + S_3)) * scale
//
// Here the keys sit in the lanes instead: the K tile is transposed once per tile into kt[c][i]
// = pair i of chunk c of 16 keys (keys in lanes), so lane-vector X_i holds x[i] of 16 keys, and
// the same chain and the same tree of adds run on whole registers (15 adds per 16 keys instead
// of ~45 shuffles + adds), with q's pair broadcast and each K^T register reused by R rows x heads.
//
//   kt:  [chunk c][pair i 0..15][key j 0..kTile)  (uint32: one bf16 pair of one key's row)
//
// P @ V. The decode kernel's chain per (row, head) and 16 columns: acc += p_i * v_i in key order
// (one set), or even keys into acc and odd ones into a zeroed second set summed at the end (two
// sets, where the decode kernel's head block has <= 8 accumulators). Here each V row is widened
// once for R rows x heads with the same chain each; the softmax step is the decode kernel's own.
//
// Included by paged_prefill.h (anonymous namespace of paged_attention.cpp); the work item that
// drives dot_tile is in paged_prefill_dot_item.h.
#pragma once

#if FS_AVX512 && FS_BF16DOT

// One item's rows' state for the blocked tile: index rh = row * G + h.
struct DotRows {
  std::vector<float> acc, m, l, s;  // [rh][dpad], [rh], [rh], [rh][kTile]
  std::vector<uint32_t> qp;         // [rh][qstride]: q's bf16 pairs, zero-padded
  std::vector<uint32_t> kt;         // the transposed K tile (see above)
  std::vector<int64_t> full, own;   // row-heads of one P @ V list
  std::vector<int> full_sets, own_sets;
  int64_t qstride = 0;
  void reserve(const Geometry& g) {
    const int64_t rh = kPrefillRows * g.group;
    qstride = (g.dpad + 2 * kLanes) / 2;
    if (static_cast<int64_t>(acc.size()) < rh * g.dpad) acc.assign(rh * g.dpad, 0.f);
    if (static_cast<int64_t>(m.size()) < rh) {
      m.assign(rh, 0.f);
      l.assign(rh, 0.f);
      s.assign(rh * kTile, 0.f);
    }
    if (static_cast<int64_t>(qp.size()) < rh * qstride) qp.assign(rh * qstride, 0u);
    if (static_cast<int64_t>(kt.size()) < qstride * kTile) kt.assign(qstride * kTile, 0u);
  }
};

inline DotRows& thread_dot_rows(const Geometry& g) {
  thread_local DotRows st;
  st.reserve(g);
  return st;
}

// kt <- the K rows of the tile (n keys), transposed to keys-in-lanes; keys n .. 16-rounded zero.
template <int NC2>
inline void transpose_k_tile(const Geometry& g, const uint16_t* const* rows, int64_t n,
                             uint32_t* kt) {
  const int64_t rest = g.head_dim - (NC2 - 1) * 2 * kLanes;  // 1..32 elements in the last chunk
  const __mmask32 tail32 = rest >= 32 ? 0xFFFFFFFFu : ((1u << rest) - 1u);
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    for (int c = 0; c < NC2; ++c) {
      __m512i r[kLanes], out[kLanes];
      for (int64_t j = 0; j < kLanes; ++j)
        r[j] = j0 + j < n ? _mm512_maskz_loadu_epi16(c == NC2 - 1 ? tail32 : 0xFFFFFFFFu,
                                                     rows[j0 + j] + c * 2 * kLanes)
                          : _mm512_setzero_si512();
      transpose16(r, out);
      for (int i = 0; i < kLanes; ++i)
        _mm512_storeu_si512(kt + (c * kLanes + i) * kTile + j0, out[i]);
    }
  }
}

// X[r] = the decode kernel's lane i of (row-head r) for the 16 keys of kt's column block.
// NOTE: K^T is VDPBF16PS's first source and q's broadcast pair the second (a folded {1to16}
// load): the two bf16 products per lane are exact in fp32, so the swap changes no bit.
template <int NC2, int R>
__attribute__((always_inline)) inline void lane_dots(const uint32_t* const* q, const uint32_t* ktg, int i, __m512* x) {
  __m512bh kv[NC2];
#pragma GCC unroll 8
  for (int c = 0; c < NC2; ++c)
    kv[c] = (__m512bh)_mm512_loadu_si512(ktg + (c * kLanes + i) * kTile);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), kv[NC2 - 1],
                                  (__m512bh)_mm512_set1_epi32(q[r][(NC2 - 1) * kLanes + i]));
#pragma GCC unroll 8
    for (int c = 0; c < NC2 - 1; ++c)
      acc = _mm512_dpbf16_ps(acc, kv[c], (__m512bh)_mm512_set1_epi32(q[r][c * kLanes + i]));
    x[r] = acc;
  }
}

// S_b of the tree for R row-heads: (x[4b] + x[4b+2]) + (x[4b+1] + x[4b+3]).
template <int NC2, int R>
__attribute__((always_inline)) inline void tree_leaf(const uint32_t* const* q, const uint32_t* ktg, int b, __m512* sb) {
  __m512 o[R], t[R];
  lane_dots<NC2, R>(q, ktg, 4 * b, sb);
  lane_dots<NC2, R>(q, ktg, 4 * b + 2, t);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sb[r] = _mm512_add_ps(sb[r], t[r]);
  lane_dots<NC2, R>(q, ktg, 4 * b + 1, o);
  lane_dots<NC2, R>(q, ktg, 4 * b + 3, t);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sb[r] = _mm512_add_ps(sb[r], _mm512_add_ps(o[r], t[r]));
}

// s[r][0 .. 16 * groups) = scale * (q_r . K rows): R row-heads, reduce16's tree on key lanes.
template <int NC2, int R>
inline void scores_rows(const uint32_t* const* q, const uint32_t* kt, int64_t groups,
                        float scale, float* const* s) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t kg = 0; kg < groups; ++kg) {
    const uint32_t* ktg = kt + kg * kLanes;
    __m512 h0[R], h1[R], sb[R];
    tree_leaf<NC2, R>(q, ktg, 0, h0);
    tree_leaf<NC2, R>(q, ktg, 1, sb);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) h0[r] = _mm512_add_ps(h0[r], sb[r]);
    tree_leaf<NC2, R>(q, ktg, 2, h1);
    tree_leaf<NC2, R>(q, ktg, 3, sb);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(s[r] + kg * kLanes,
                       _mm512_mul_ps(_mm512_add_ps(h0[r], _mm512_add_ps(h1[r], sb[r])), sc));
  }
}

template <int NC2, int R>
inline void scores_rows_n(int64_t cnt, const uint32_t* const* q, const uint32_t* kt,
                          int64_t groups, float scale, float* const* s) {
  if (cnt == R) scores_rows<NC2, R>(q, kt, groups, scale, s);
  else if constexpr (R > 1) scores_rows_n<NC2, R - 1>(cnt, q, kt, groups, scale, s);
}

// acc[r] += sum_i p[r][i] v_i over n keys for R row-heads, the decode kernel's chain(s).
template <int NCH, int R, int kSets>
inline void pv_rows(float* const* acc, const float* const* p, const uint16_t* const* rows,
                    int64_t n, __mmask16 tail) {
  __m512 av[kSets][R][NCH];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < NCH; ++c) {
      av[0][r][c] = _mm512_loadu_ps(acc[r] + c * kLanes);
      if constexpr (kSets == 2) av[1][r][c] = _mm512_setzero_ps();
    }
  auto row = [&](auto& a, int64_t i) __attribute__((always_inline)) {
#pragma GCC unroll 16
    for (int c = 0; c < NCH; ++c) {
      const __m512 v = bf16x16_to_f32(_mm256_maskz_loadu_epi16(
          c == NCH - 1 ? tail : static_cast<__mmask16>(0xFFFF), rows[i] + c * kLanes));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][i]), v, a[r][c]);
    }
  };
  int64_t i = 0;
  if constexpr (kSets == 2)
    for (; i + 1 < n; i += 2) {
      row(av[0], i);
      row(av[1], i + 1);
    }
  for (; i < n; ++i) row(av[0], i);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < NCH; ++c) {
      __m512 sum = av[0][r][c];
      if constexpr (kSets == 2) sum = _mm512_add_ps(sum, av[1][r][c]);
      _mm512_storeu_ps(acc[r] + c * kLanes, sum);
    }
}

template <int NCH, int R, int kSets>
inline void pv_rows_n(int64_t cnt, float* const* acc, const float* const* p,
                      const uint16_t* const* rows, int64_t n, __mmask16 tail) {
  if (cnt == R) pv_rows<NCH, R, kSets>(acc, p, rows, n, tail);
  else if constexpr (R > 1) pv_rows_n<NCH, R - 1, kSets>(cnt, acc, p, rows, n, tail);
}

// softmax_step_avx512 for R row-heads over the same n scores, the steps interleaved (the
// reductions' latency overlaps); per row-head the very same operations in the same order.
template <int R>
inline void softmax_rows(DotRows& st, const int64_t* rh, int64_t n, int64_t dpad) {
  __m512 mx[R], sum[R], mv[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) mx[r] = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 k = tail_mask(n - i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      mx[r] = _mm512_mask_max_ps(mx[r], k, mx[r], _mm512_loadu_ps(st.s.data() + rh[r] * kTile + i));
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* m = &st.m[rh[r]];
    const float m_new = std::max(*m, _mm512_reduce_max_ps(mx[r]));
    if (m_new > *m) {
      const float alpha = std::exp(*m - m_new);
      const __m512 av = _mm512_set1_ps(alpha);
      float* acc = st.acc.data() + rh[r] * dpad;
      for (int64_t c = 0; c < dpad; c += kLanes)
        _mm512_storeu_ps(acc + c, _mm512_mul_ps(av, _mm512_loadu_ps(acc + c)));
      st.l[rh[r]] *= alpha;
      *m = m_new;
    }
    mv[r] = _mm512_set1_ps(m_new);
    sum[r] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 k = tail_mask(n - i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* s = st.s.data() + rh[r] * kTile + i;
      const __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s), mv[r]));
      sum[r] = _mm512_mask_add_ps(sum[r], k, sum[r], p);
      _mm512_mask_storeu_ps(s, k, p);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) st.l[rh[r]] += _mm512_reduce_add_ps(sum[r]);
}

// softmax_rows over a list of row-heads (all n keys), in blocks of 6.
inline void softmax_list(DotRows& st, const std::vector<int64_t>& rhs, int64_t n, int64_t dpad) {
  constexpr int64_t kR = 6;
  const int64_t total = static_cast<int64_t>(rhs.size());
  int64_t k = 0;
  for (; k + kR <= total; k += kR) softmax_rows<kR>(st, rhs.data() + k, n, dpad);
  for (; k < total; ++k) softmax_rows<1>(st, rhs.data() + k, n, dpad);
}

// The decode kernel's accumulator sets for head h: its head blocks are 16 / NCH heads wide.
template <int NCH>
inline int decode_sets(int64_t group, int64_t h) {
  constexpr int64_t kMaxHB = NCH >= 16 ? 1 : 16 / NCH;
  const int64_t hb = std::min<int64_t>(kMaxHB, group - h / kMaxHB * kMaxHB);
  return hb * NCH <= 8 ? 2 : 1;
}

// P @ V of a list of row-heads that all see n keys of the tile, blocked by kSets class.
template <int NCH>
inline void pv_list(const std::vector<int64_t>& rhs, const std::vector<int>& sets, DotRows& st,
                    int64_t dpad, const uint16_t* const* vrows, int64_t n, __mmask16 tail) {
  constexpr int kR1 = std::max(1, std::min(8, 24 / NCH));
  constexpr int kR2 = std::max(1, std::min(8, 12 / NCH));
  float* acc[8];
  const float* p[8];
  for (int cls = 1; cls <= 2; ++cls) {
    const int cap = cls == 1 ? kR1 : kR2;
    int cnt = 0;
    for (size_t k = 0; k <= rhs.size(); ++k) {
      if (k < rhs.size()) {
        if (sets[k] != cls) continue;
        acc[cnt] = st.acc.data() + rhs[k] * dpad;
        p[cnt] = st.s.data() + rhs[k] * kTile;
        ++cnt;
      }
      if (cnt == cap || (k == rhs.size() && cnt > 0)) {
        if (cls == 1) pv_rows_n<NCH, kR1, 1>(cnt, acc, p, vrows, n, tail);
        else pv_rows_n<NCH, kR2, 2>(cnt, acc, p, vrows, n, tail);
        cnt = 0;
      }
    }
  }
}

// One key tile for the rows with ends[r] > t0 (row r sees min(kTile, ends[r] - t0) keys):
// scores for all of them, the decode kernel's softmax step per row-head, then P @ V.
template <int NCH>
void dot_tile(const Geometry& g, DotRows& st, const Scratch& w, const int64_t* ends, int64_t nrows,
              int64_t t0, int64_t n_max) {
  constexpr int kNc2 = (NCH + 1) / 2;
  constexpr int kRS = 6;
  const __mmask16 tail = tail_mask(g.head_dim - (NCH - 1) * kLanes);
  transpose_k_tile<kNc2>(g, w.kraw.data(), n_max, st.kt.data());
  const int64_t G = g.group;
  const uint32_t* qs[kRS];
  float* ss[kRS];
  int cnt = 0;
  int64_t groups_max = 0;
  for (int64_t r = 0; r < nrows; ++r) {
    if (ends[r] <= t0) continue;
    const int64_t n = std::min(kTile, ends[r] - t0);
    groups_max = std::max(groups_max, (n + kLanes - 1) / kLanes);
  }
  // scores (all rows over the tile's 16-key groups the longest row needs)
  for (int64_t r = 0; r <= nrows; ++r) {
    if (r < nrows && ends[r] > t0)
      for (int64_t h = 0; h < G; ++h) {
        qs[cnt] = st.qp.data() + (r * G + h) * st.qstride;
        ss[cnt] = st.s.data() + (r * G + h) * kTile;
        if (++cnt == kRS) {
          scores_rows<kNc2, kRS>(qs, st.kt.data(), groups_max, g.scale, ss);
          cnt = 0;
        }
      }
    if (r == nrows && cnt > 0) scores_rows_n<kNc2, kRS>(cnt, qs, st.kt.data(), groups_max, g.scale, ss);
  }
  std::vector<int64_t>& full = st.full;
  std::vector<int>& full_sets = st.full_sets;
  full.clear();
  full_sets.clear();
  for (int64_t r = 0; r < nrows; ++r) {
    if (ends[r] <= t0) continue;
    const int64_t n = std::min(kTile, ends[r] - t0);
    if (n == n_max) {
      for (int64_t h = 0; h < G; ++h) {
        full.push_back(r * G + h);
        full_sets.push_back(decode_sets<NCH>(G, h));
      }
    } else {  // a row ending inside the tile: its own heads over its own keys
      st.own.clear();
      st.own_sets.clear();
      for (int64_t h = 0; h < G; ++h) {
        st.own.push_back(r * G + h);
        st.own_sets.push_back(decode_sets<NCH>(G, h));
      }
      softmax_list(st, st.own, n, g.dpad);
      pv_list<NCH>(st.own, st.own_sets, st, g.dpad, w.vraw.data(), n, tail);
    }
  }
  softmax_list(st, full, n_max, g.dpad);
  pv_list<NCH>(full, full_sets, st, g.dpad, w.vraw.data(), n_max, tail);
}

#endif  // FS_AVX512 && FS_BF16DOT
