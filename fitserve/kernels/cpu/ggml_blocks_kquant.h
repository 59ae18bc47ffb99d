// Q4_K, Q5_K, Q6_K super-blocks (256 columns) against Q8_K-style activations (ggml_blocks_act.h).
//
// Each type is a struct with the block geometry and `row<MT>(w, nsb, act, m0, res)`: one weight
// row (nsb super-blocks, ggml's bytes as stored) against rows m0 .. m0+MT-1 of x, res[i] = the
// dot for row m0+i. Every super-block is decoded ONCE (into registers) and used for all MT rows.
//
// Block layouts (ggml-common.h):
//   Q4_K 144 B: d f16, dmin f16, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128]
//               qs[32j + l]: low nibble -> column 64j + l, high -> 64j + 32 + l;
//               w = d * sc[s] * q - dmin * m[s], s = column / 32
//   Q5_K 176 B: d, dmin, scales[12], qh[32], qs[128]; as Q4_K plus bit s of qh[l] -> +16 for
//               column 32s + l
//   Q6_K 210 B: ql[128], qh[64], scales[16] int8, d f16; per 128-column half h (ql + 64h,
//               qh + 32h): column 32t + l (t = 0..3) takes nibble (t >= 2) of ql[32(t%2) + l]
//               and bits 2t..2t+1 of qh[l] as bits 4..5; w = d * sc[col / 16] * (q - 32)
#pragma once

#include <type_traits>

#include "ggml_blocks_act.h"
#include "stream_prefetch.h"

namespace fitserve::ggml {

// NOTE: the GEMV's rows (tiles of one row of x) request the weight bytes kKqAhead past each
// super-block as they go (a thread's rows are contiguous, so that is the row's stream 2 KB
// ahead, into the next row): DRAM requests stay in flight at a steady distance. The bursts of
// whole-row hints before (rows_streamed; rows over 4 KB: the row after next) held K = 8192 rows
// (4.6-6.7 KB) at 0.66-0.75 of a plain read of the same bytes, now 0.84-0.89 (one thread, CPU
// clock, bench_ggml_blocks --vs-read, loaded host). A hint past the weights' end never faults.
constexpr int kKqAhead = 2048;

template <int kBytes>
[[gnu::always_inline]] inline void kq_prefetch_ahead(const uint8_t* b, int64_t ahead = kKqAhead) {
#ifdef FS_GGML_AVX2
  for (int o = 0; o < kBytes; o += 64)
    prefetch_stream(b + ahead + o);
#else
  (void)b;
  (void)ahead;
#endif
}

}  // namespace fitserve::ggml

#include "ggml_blocks_kq512.h"
#include "ggml_blocks_kqpanel.h"

namespace fitserve::ggml {

// Q4_K (kHigh = false) and Q5_K (kHigh = true): the same code, Q5_K adds the qh bit plane.
template <bool kHigh>
struct Q45K {
  static constexpr int64_t kQK = 256, kBytes = kHigh ? 176 : 144, kActBlock = 256;
  static constexpr int64_t kQsOff = kHigh ? 48 : 16;

#if defined(FS_GGML_AVX512)
  static constexpr bool kPerm128 = true;  // x permuted per 128 columns (ggml_blocks_kq512.h)
  template <int MT>
  static void row(const uint8_t* w, int64_t nsb, const Act& a, int64_t m0, float* res) {
    q45k_row512<kHigh, MT>(w, nsb, a, m0, res);
  }
  // weight rows w[0 .. NW-1] against rows m0 .. m0+MT-1 of x: res[j * MT + i] = row<MT>'s bits;
  // a one-row tile (MT = 1) requests the bytes `ahead` past each super-block it reads
  template <int NW, int MT>
  static void tile(const uint8_t* const* w, int64_t nsb, const Act& a, int64_t m0, float* res,
                   int64_t ahead = kKqAhead) {
    q45k_tile512<kHigh, NW, MT>(w, nsb, a, m0, res, ahead);
  }
  using Panel = Q45KPanel<kHigh>;  // M >= kKqPanelMinRows (ggml_blocks_kqpanel.h)
#elif !defined(FS_GGML_AVX2)
  static constexpr bool kPerm128 = false;
  template <int MT>
  static void row(const uint8_t* w, int64_t nsb, const Act& a, int64_t m0, float* res) {
    float acc[MT] = {};
    uint8_t q[256], sc[8], mn[8];
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + sb * kBytes;
      const float d = f16_at(b), dmin = f16_at(b + 2);
      uint64_t scv, mnv;
      scale_min_k4(b + 4, scv, mnv);
      std::memcpy(sc, &scv, 8);
      std::memcpy(mn, &mnv, 8);
      const uint8_t* qs = b + kQsOff;
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) {
          q[64 * j + l] = qs[32 * j + l] & 15;
          q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
          if constexpr (kHigh) {
            q[64 * j + l] |= ((b[16 + l] >> (2 * j)) & 1) << 4;
            q[64 * j + 32 + l] |= ((b[16 + l] >> (2 * j + 1)) & 1) << 4;
          }
        }
      for (int i = 0; i < MT; ++i) {
        const int8_t* aq = a.qrow(m0 + i) + sb * 256;
        const int16_t* s32 = a.s32row(m0 + i) + sb * 8;
        int32_t isum = 0, msum = 0;
        for (int s = 0; s < 8; ++s) {
          int32_t dot = 0;
          for (int l = 0; l < 32; ++l) dot += q[32 * s + l] * aq[32 * s + l];
          isum += sc[s] * dot;
          msum += mn[s] * s32[s];
        }
        const float da = a.drow(m0 + i)[sb];
        acc[i] += d * da * static_cast<float>(isum) - dmin * da * static_cast<float>(msum);
      }
    }
    for (int i = 0; i < MT; ++i) res[i] = acc[i];
  }
#else
  static constexpr bool kPerm128 = false;
  template <int MT>
  static void row(const uint8_t* w, int64_t nsb, const Act& a, int64_t m0, float* res) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MT];
    const int8_t* aq[MT];
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
      acc[i] = _mm256_setzero_ps();
      aq[i] = a.qrow(m0 + i);
    }
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + sb * kBytes;
      if constexpr (MT == 1) kq_prefetch_ahead<kBytes>(b);
      uint64_t scv, mnv;
      scale_min_k4(b + 4, scv, mnv);
      const __m256i sc16 = _mm256_broadcastsi128_si256(
          _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(scv))));
      const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mnv)));
      __m256i hb;
      if constexpr (kHigh) hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      __m256i ia[MT];
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) ia[i] = _mm256_setzero_si256();
      const uint8_t* qs = b + kQsOff;
      FS_GGML_UNROLL for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
        __m256i lo = _mm256_and_si256(v, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if constexpr (kHigh) {
          switch (j) {  // bit 2j -> the low nibbles' 16, bit 2j+1 -> the high nibbles'
            case 0: lo = _mm256_or_si256(lo, bit_to_0x10<0>(hb)); hi = _mm256_or_si256(hi, bit_to_0x10<1>(hb)); break;
            case 1: lo = _mm256_or_si256(lo, bit_to_0x10<2>(hb)); hi = _mm256_or_si256(hi, bit_to_0x10<3>(hb)); break;
            case 2: lo = _mm256_or_si256(lo, bit_to_0x10<4>(hb)); hi = _mm256_or_si256(hi, bit_to_0x10<5>(hb)); break;
            default: lo = _mm256_or_si256(lo, bit_to_0x10<6>(hb)); hi = _mm256_or_si256(hi, bit_to_0x10<7>(hb)); break;
          }
        }
        const __m256i slo = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(word_sel(2 * j)));
        const __m256i shi = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(word_sel(2 * j + 1)));
        FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
          const int8_t* p = aq[i] + sb * 256 + 64 * j;
          const __m256i alo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
          const __m256i ahi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
          ia[i] = madd_acc(ia[i], _mm256_maddubs_epi16(lo, alo), slo);
          ia[i] = madd_acc(ia[i], _mm256_maddubs_epi16(hi, ahi), shi);
        }
      }
      const float d = f16_at(b), dmin = f16_at(b + 2);
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
        const float da = a.drow(m0 + i)[sb];
        const __m128i bs = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(a.s32row(m0 + i) + sb * 8));
        const __m256i mi =
            _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_madd_epi16(mn16, bs), 0);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]), _mm256_set1_ps(d * da), acc[i]);
        acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mi), _mm256_set1_ps(dmin * da), acc[i]);
      }
    }
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) res[i] = hsum(acc[i]);
  }
#endif
};

using Q4K = Q45K<false>;
using Q5K = Q45K<true>;

struct Q6K {
  static constexpr int64_t kQK = 256, kBytes = 210, kActBlock = 256;
  static constexpr bool kPerm128 = false;

#if defined(FS_GGML_AVX512)
  template <int MT>
  static void row(const uint8_t* w, int64_t nsb, const Act& a, int64_t m0, float* res) {
    q6k_row512<MT>(w, nsb, a, m0, res);
  }
  template <int NW, int MT>  // as Q45K::tile
  static void tile(const uint8_t* const* w, int64_t nsb, const Act& a, int64_t m0, float* res,
                   int64_t ahead = kKqAhead) {
    q6k_tile512<NW, MT>(w, nsb, a, m0, res, ahead);
  }
  using Panel = Q6KPanel;
#elif !defined(FS_GGML_AVX2)
  template <int MT>
  static void row(const uint8_t* w, int64_t nsb, const Act& a, int64_t m0, float* res) {
    float acc[MT] = {};
    uint8_t q[256];
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + sb * kBytes;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16_at(b + 208);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        for (int l = 0; l < 32; ++l) {
          q[128 * h + l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
          q[128 * h + 32 + l] = (ql[32 + l] & 15) | (((qh[l] >> 2) & 3) << 4);
          q[128 * h + 64 + l] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
          q[128 * h + 96 + l] = (ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
      }
      for (int i = 0; i < MT; ++i) {
        const int8_t* aq = a.qrow(m0 + i) + sb * 256;
        const int16_t* s16 = a.s16row(m0 + i) + sb * 16;
        int32_t isum = 0;
        for (int s = 0; s < 16; ++s) {
          int32_t dot = 0;
          for (int l = 0; l < 16; ++l) dot += q[16 * s + l] * aq[16 * s + l];
          isum += sc[s] * (dot - 32 * s16[s]);
        }
        acc[i] += d * a.drow(m0 + i)[sb] * static_cast<float>(isum);
      }
    }
    for (int i = 0; i < MT; ++i) res[i] = acc[i];
  }
#else
  template <int MT>
  static void row(const uint8_t* w, int64_t nsb, const Act& a, int64_t m0, float* res) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[MT];
    const int8_t* aq[MT];
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
      acc[i] = _mm256_setzero_ps();
      aq[i] = a.qrow(m0 + i);
    }
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + sb * kBytes;
      if constexpr (MT == 1) kq_prefetch_ahead<kBytes>(b);
      // int16 scales [s0..s7 | s8..s15]; the -32 offset: -32 * sum_s sc[s] * (sum of a over s)
      const __m256i sc16 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
      __m256i ia[MT];
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
        const __m256i bs = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(a.s16row(m0 + i) + sb * 16));
        ia[i] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                 _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
      }
      FS_GGML_UNROLL for (int h = 0; h < 2; ++h) {
        const __m256i sh = _mm256_permute4x64_epi64(sc16, h ? 0xEE : 0x44);  // both lanes: 8h..
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
        FS_GGML_UNROLL for (int t = 0; t < 4; ++t) {
          const __m256i lv = t % 2 ? l1 : l0;
          const __m256i nib = t < 2 ? _mm256_and_si256(lv, m4)
                                    : _mm256_and_si256(_mm256_srli_epi16(lv, 4), m4);
          __m256i hv;  // bits 2t, 2t+1 of qh -> bits 4, 5
          if (t == 0) hv = _mm256_slli_epi16(qh, 4);
          else if (t == 1) hv = _mm256_slli_epi16(qh, 2);
          else if (t == 2) hv = qh;
          else hv = _mm256_srli_epi16(qh, 2);
          const __m256i u = _mm256_or_si256(nib, _mm256_and_si256(hv, m30));
          // sub-blocks 2t (bytes 0-15, lane 0) and 2t+1 (lane 1) of this half
          const __m256i s = _mm256_shuffle_epi8(
              sh, _mm256_set_m128i(_mm_set1_epi16(word_sel(2 * t + 1)),
                                   _mm_set1_epi16(word_sel(2 * t))));
          FS_GGML_UNROLL for (int i = 0; i < MT; ++i) {
            const __m256i av = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(aq[i] + sb * 256 + 128 * h + 32 * t));
            ia[i] = madd_acc(ia[i], _mm256_maddubs_epi16(u, av), s);
          }
        }
      }
      const float d = f16_at(b + 208);
      FS_GGML_UNROLL for (int i = 0; i < MT; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]),
                                 _mm256_set1_ps(d * a.drow(m0 + i)[sb]), acc[i]);
    }
    FS_GGML_UNROLL for (int i = 0; i < MT; ++i) res[i] = hsum(acc[i]);
  }
#endif
};

// The K-quant types, whose GEMV tiles prefetch their own stream (kq_rows_quarters runs them).
template <class T>
inline constexpr bool kIsKQuant =
    std::is_same_v<T, Q4K> || std::is_same_v<T, Q5K> || std::is_same_v<T, Q6K>;

}  // namespace fitserve::ggml

#include "ggml_blocks_kqrun.h"
