// The four steps of the quantized decode tile (paged_attention_kvq.cpp) for one ISA tier and
// head_dim, picked once per call: widen code rows, q . K rows, online softmax, P @ V. The
// AVX-512 and AVX2 ones are paged_attention_simd.h's fp32 pieces; the scalar ones are the plain
// loops the tests also run (vectorized=False). Include after paged_attention_simd.h, kv_codes.h.
// On AVX-512 the group steps (kvq_group_avx512.h) replace widen + scores + P @ V: every head of
// the group from the code rows themselves (group_scores / group_pv; null on the other tiers).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

struct TileOps {
  void (*to_float)(const uint8_t* src, float* dst, int64_t d, int64_t dpad);
  void (*scores)(const float* q, const float* const* rows, int64_t n, int64_t d, float* s);
  void (*softmax)(float* s, int64_t n, float* m, float* l, float* acc, int64_t dpad);
  void (*pv)(float* acc, const float* p, const float* const* rows, int64_t n, int64_t d);
  void (*group_scores)(const float* q, int64_t g, int64_t dpad, const float* kscale, float* qb,
                       const uint8_t* const* rows, int64_t n, int64_t d, float* s,
                       float* part, fitserve::LineQueue* pf, int64_t pf_per_block) = nullptr;
  void (*group_pv)(float* acc, int64_t g, int64_t dpad, const float* p,
                   const uint8_t* const* rows, int64_t n, int64_t d) = nullptr;
};

void scores_scalar(const float* q, const float* const* rows, int64_t n, int64_t d, float* s) {
  for (int64_t i = 0; i < n; ++i) {
    float dot = 0.f;
    for (int64_t c = 0; c < d; ++c) dot += q[c] * rows[i][c];
    s[i] = dot;
  }
}

void softmax_scalar(float* s, int64_t n, float* m, float* l, float* acc, int64_t dpad) {
  float mx = kNegInf;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  const float m_new = std::max(*m, mx);
  if (m_new > *m) {
    const float alpha = std::exp(*m - m_new);
    for (int64_t c = 0; c < dpad; ++c) acc[c] *= alpha;
    *l *= alpha;
    *m = m_new;
  }
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m_new);
    sum += s[i];
  }
  *l += sum;
}

void pv_scalar(float* acc, const float* p, const float* const* rows, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < d; ++c) acc[c] += p[i] * rows[i][c];
}

template <int C>
TileOps scalar_ops() {
  return {&codes_to_float_scalar<C>, &scores_scalar, &softmax_scalar, &pv_scalar};
}

#if FS_AVX512
template <int NCH>
void scores_512(const float* q, const float* const* rows, int64_t n, int64_t d, float* s) {
  scores_avx512<NCH>(q, rows, n, tail_mask(d - (NCH - 1) * kLanes), s);
}

template <int NCH>
void pv_512(float* acc, const float* p, const float* const* rows, int64_t n, int64_t d) {
  pv_avx512<NCH>(acc, p, rows, n, tail_mask(d - (NCH - 1) * kLanes));
}

template <int C, int NCH>
TileOps ops_512() {
  return {&codes_to_float_avx512<C>, &scores_512<NCH>, &softmax_step_avx512, &pv_512<NCH>,
          &group_scores<C, NCH>, &group_pv<C, NCH>};
}

// NCH = ceil(head_dim / 16) registers per row; false for a head_dim without a tile.
template <int C>
bool pick_512(int64_t head_dim, TileOps* ops) {
  switch ((head_dim + kLanes - 1) / kLanes) {
    case 1: *ops = ops_512<C, 1>(); return true;
    case 2: *ops = ops_512<C, 2>(); return true;
    case 3: *ops = ops_512<C, 3>(); return true;
    case 4: *ops = ops_512<C, 4>(); return true;
    case 5: *ops = ops_512<C, 5>(); return true;
    case 6: *ops = ops_512<C, 6>(); return true;
    case 7: *ops = ops_512<C, 7>(); return true;
    case 8: *ops = ops_512<C, 8>(); return true;
    case 12: *ops = ops_512<C, 12>(); return true;
    case 16: *ops = ops_512<C, 16>(); return true;
    default: return false;
  }
}
#endif

#if FS_AVX2
template <int NCH>
void scores_256(const float* q, const float* const* rows, int64_t n, int64_t d, float* s) {
  scores_avx2<NCH>(q, rows, n, tail_mask8(d - (NCH - 1) * kLanes8), s);
}

template <int NCH>
void pv_256(float* acc, const float* p, const float* const* rows, int64_t n, int64_t d) {
  pv_avx2<NCH>(acc, p, rows, n, tail_mask8(d - (NCH - 1) * kLanes8));
}

template <int C, int NCH>
TileOps ops_256() {
  return {&codes_to_float_avx2<C>, &scores_256<NCH>, &softmax_step_avx2, &pv_256<NCH>};
}

template <int C>
bool pick_256(int64_t head_dim, TileOps* ops) {
  switch ((head_dim + kLanes8 - 1) / kLanes8) {
    case 1: *ops = ops_256<C, 1>(); return true;
    case 2: *ops = ops_256<C, 2>(); return true;
    case 3: *ops = ops_256<C, 3>(); return true;
    case 4: *ops = ops_256<C, 4>(); return true;
    case 5: *ops = ops_256<C, 5>(); return true;
    case 6: *ops = ops_256<C, 6>(); return true;
    case 7: *ops = ops_256<C, 7>(); return true;
    case 8: *ops = ops_256<C, 8>(); return true;
    case 10: *ops = ops_256<C, 10>(); return true;
    case 12: *ops = ops_256<C, 12>(); return true;
    case 16: *ops = ops_256<C, 16>(); return true;
    default: return false;
  }
}
#endif

template <int C>
TileOps pick_for_codec(int64_t head_dim, bool vectorized) {
  TileOps ops = scalar_ops<C>();
#if FS_AVX512
  if (vectorized) pick_512<C>(head_dim, &ops);
#elif FS_AVX2
  if (vectorized) pick_256<C>(head_dim, &ops);
#else
  (void)head_dim;
  (void)vectorized;
#endif
  return ops;
}

// The tile steps for this codec (kv_codes.h), head_dim and tier; vectorized=false: scalar.
TileOps pick_tile_ops(int codec, int64_t head_dim, bool vectorized) {
  if (codec == kInt8) return pick_for_codec<kInt8>(head_dim, vectorized);
  if (codec == kE4M3) return pick_for_codec<kE4M3>(head_dim, vectorized);
  return pick_for_codec<kE5M2>(head_dim, vectorized);
}

}  // namespace
