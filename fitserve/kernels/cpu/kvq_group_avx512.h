// The AVX-512 group tile of the quantized decode kernel (paged_attention_kvq.cpp): scores and
// P @ V for all G query heads of a KV head straight from the one-byte code rows. Each K and V
// row is widened in registers once for the whole group (no fp32 copy of the tile, no call per
// row), as paged_attention.cpp's bf16 path reads its raw rows. Include after kv_codes.h.
#pragma once
#include <algorithm>
#include <cstdint>

namespace {

#if FS_AVX512
// NCH registers of one code row (lanes past d are 0: the masked load reads none of them).
template <int C, int NCH>
inline void widen_row(const uint8_t* src, __mmask16 tail, __m512* out) {
  if constexpr (C != kInt8 && NCH % 2 == 0) {  // the fp8 codes 32 at a time (kv_codes.h)
#pragma GCC unroll 16
    for (int c = 0; c < NCH - 2; c += 2)
      codes32_to_f32<C>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c * kLanes)),
                        out[c], out[c + 1]);
    const __mmask32 last = static_cast<__mmask32>(0xFFFFu) | (static_cast<__mmask32>(tail) << 16);
    codes32_to_f32<C>(_mm256_maskz_loadu_epi8(last, src + (NCH - 2) * kLanes), out[NCH - 2],
                      out[NCH - 1]);
    return;
  }
#pragma GCC unroll 16
  for (int c = 0; c < NCH - 1; ++c)
    out[c] = codes16_to_f32<C>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c * kLanes)));
  out[NCH - 1] = codes16_to_f32<C>(_mm_maskz_loadu_epi8(tail, src + (NCH - 1) * kLanes));
}

// group_scores for a group of G heads known at compile time: the G * NCH registers of q loaded
// once per call (times the block's per-channel key scales when kscale is not null) and every
// loop unrolled (the generic loop reloaded q per row and head), each head's dot in two
// independent FMA chains.
template <int C, int NCH, int G>
void group_scores_g(const float* q, int64_t dpad, const float* kscale, const uint8_t* const* rows,
                    int64_t n, __mmask16 tail, float* s, float* part, fitserve::LineQueue* pf,
                    int64_t pf_per_block) {
  __m512 qv[G][NCH];
#pragma GCC unroll 16
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < NCH; ++c) qv[h][c] = _mm512_loadu_ps(q + h * dpad + c * kLanes);
  if (kscale != nullptr) {
#pragma GCC unroll 16
    for (int c = 0; c < NCH; ++c) {
      const __m512 ks = _mm512_maskz_loadu_ps(c + 1 < NCH ? static_cast<__mmask16>(0xFFFF) : tail,
                                              kscale + c * kLanes);
#pragma GCC unroll 16
      for (int h = 0; h < G; ++h) qv[h][c] = _mm512_mul_ps(qv[h][c], ks);
    }
  }
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - i0);
    pf->issue(pf_per_block);
    for (int64_t i = 0; i < m; ++i) {
      __m512 k[NCH];
      widen_row<C, NCH>(rows[i0 + i], tail, k);
#pragma GCC unroll 16
      for (int h = 0; h < G; ++h) {
        __m512 dot[2] = {_mm512_mul_ps(qv[h][0], k[0]), _mm512_setzero_ps()};
#pragma GCC unroll 16
        for (int c = 1; c < NCH; ++c) dot[c & 1] = _mm512_fmadd_ps(qv[h][c], k[c], dot[c & 1]);
        _mm512_storeu_ps(part + (h * kLanes + i) * kLanes,
                         NCH > 1 ? _mm512_add_ps(dot[0], dot[1]) : dot[0]);
      }
    }
#pragma GCC unroll 16
    for (int h = 0; h < G; ++h) {
      __m512 a[kLanes];
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i)
        a[i] = i < m ? _mm512_loadu_ps(part + (h * kLanes + i) * kLanes) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(s + h * kTile + i0, tail_mask(m), reduce16(a));
    }
  }
}

// s[h * kTile + i] = (q_h (.) kscale) . raw(rows[i]) for the g heads of q ([g, dpad], zero past
// d), i < n; kscale: the block's d per-channel key scales (contiguous), or null for none; qb a
// [g, dpad] scratch for the fold on the generic path. Before each 16 keys, pf_per_block more
// of the next tile's queued lines are requested.
// Per row, one register of products per head; every 16 rows a transpose tree sums them.
template <int C, int NCH>
void group_scores(const float* q, int64_t g, int64_t dpad, const float* kscale, float* qb,
                  const uint8_t* const* rows, int64_t n, int64_t d, float* s, float* part,
                  fitserve::LineQueue* pf, int64_t pf_per_block) {
  const __mmask16 tail = tail_mask(d - (NCH - 1) * kLanes);
  // NOTE: q of up to 24 registers held (G * NCH <= 24 of the 32), the rest as before
  if (g * NCH <= 24 && g <= 8) {
    switch (g) {
      case 1: return group_scores_g<C, NCH, 1>(q, dpad, kscale, rows, n, tail, s, part, pf, pf_per_block);
      case 2: return group_scores_g<C, NCH, std::min(2, std::max(1, 24 / NCH))>(q, dpad, kscale, rows, n, tail, s, part, pf, pf_per_block);
      case 3: return group_scores_g<C, NCH, std::min(3, std::max(1, 24 / NCH))>(q, dpad, kscale, rows, n, tail, s, part, pf, pf_per_block);
      case 4: return group_scores_g<C, NCH, std::min(4, std::max(1, 24 / NCH))>(q, dpad, kscale, rows, n, tail, s, part, pf, pf_per_block);
      case 6: return group_scores_g<C, NCH, std::min(6, std::max(1, 24 / NCH))>(q, dpad, kscale, rows, n, tail, s, part, pf, pf_per_block);
      case 8: return group_scores_g<C, NCH, std::min(8, std::max(1, 24 / NCH))>(q, dpad, kscale, rows, n, tail, s, part, pf, pf_per_block);
      default: break;
    }
  }
  if (kscale != nullptr) {
    for (int64_t h = 0; h < g; ++h)
      for (int64_t c = 0; c < dpad; ++c) qb[h * dpad + c] = c < d ? q[h * dpad + c] * kscale[c] : 0.f;
    q = qb;
  }
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - i0);
    pf->issue(pf_per_block);
    for (int64_t i = 0; i < m; ++i) {
      __m512 k[NCH];
      widen_row<C, NCH>(rows[i0 + i], tail, k);
      for (int64_t h = 0; h < g; ++h) {
        const float* qh = q + h * dpad;
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]);
#pragma GCC unroll 16
        for (int c = 1; c < NCH; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c * kLanes), k[c], dot);
        _mm512_storeu_ps(part + (h * kLanes + i) * kLanes, dot);
      }
    }
    for (int64_t h = 0; h < g; ++h) {
      __m512 a[kLanes];
      for (int64_t i = 0; i < kLanes; ++i)
        a[i] = i < m ? _mm512_loadu_ps(part + (h * kLanes + i) * kLanes) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(s + h * kTile + i0, tail_mask(m), reduce16(a));
    }
  }
}

// acc_h[0..d) += sum_i p[h * kTile + i] raw(rows[i]) for heads h0 .. h0 + HB - 1: the HB * NCH
// accumulators in registers, each V row widened once for them.
template <int C, int NCH, int HB>
inline void pv_heads(float* acc, int64_t dpad, const float* p, const uint8_t* const* rows,
                     int64_t n, __mmask16 tail) {
  // NOTE: every loop over HB / NCH unrolled, so av stays in registers (without it GCC kept av
  // on the stack: a store and a reload per accumulator per row, 1.4x the kernel's time)
  __m512 av[HB][NCH];
#pragma GCC unroll 16
  for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < NCH; ++c) av[h][c] = _mm512_loadu_ps(acc + h * dpad + c * kLanes);
  for (int64_t i = 0; i < n; ++i) {
    __m512 v[NCH];
    widen_row<C, NCH>(rows[i], tail, v);
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * kTile + i]);
#pragma GCC unroll 16
      for (int c = 0; c < NCH; ++c) av[h][c] = _mm512_fmadd_ps(ph, v[c], av[h][c]);
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < NCH; ++c) _mm512_storeu_ps(acc + h * dpad + c * kLanes, av[h][c]);
}

// Every head of the group, in blocks of up to kMaxHB (HB * NCH <= 16 accumulator registers).
template <int C, int NCH>
void group_pv(float* acc, int64_t g, int64_t dpad, const float* p, const uint8_t* const* rows,
              int64_t n, int64_t d) {
  constexpr int kMaxHB = std::max(1, std::min(8, 16 / NCH));
  const __mmask16 tail = tail_mask(d - (NCH - 1) * kLanes);
  for (int64_t h0 = 0; h0 < g; h0 += kMaxHB) {
    float* a = acc + h0 * dpad;
    const float* ph = p + h0 * kTile;
    switch (std::min<int64_t>(kMaxHB, g - h0)) {
      case 1: pv_heads<C, NCH, 1>(a, dpad, ph, rows, n, tail); break;
      case 2: pv_heads<C, NCH, std::min(2, kMaxHB)>(a, dpad, ph, rows, n, tail); break;
      case 3: pv_heads<C, NCH, std::min(3, kMaxHB)>(a, dpad, ph, rows, n, tail); break;
      case 4: pv_heads<C, NCH, std::min(4, kMaxHB)>(a, dpad, ph, rows, n, tail); break;
      case 5: pv_heads<C, NCH, std::min(5, kMaxHB)>(a, dpad, ph, rows, n, tail); break;
      case 6: pv_heads<C, NCH, std::min(6, kMaxHB)>(a, dpad, ph, rows, n, tail); break;
      case 7: pv_heads<C, NCH, std::min(7, kMaxHB)>(a, dpad, ph, rows, n, tail); break;
      default: pv_heads<C, NCH, std::min(8, kMaxHB)>(a, dpad, ph, rows, n, tail); break;
    }
  }
}
#endif  // FS_AVX512

}  // namespace
