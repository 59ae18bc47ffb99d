// dequant_block<T>: one ggml block of type T dequantized to float32, the values of
// fitserve/quant/ggml_blocks.py's dequantize_blocks (hence gguf-py's) bit for bit: each product
// and sum is one fp32 rounding in gguf-py's order (rounded() keeps a product from being
// contracted into an FMA with the add after it). ggml_blocks.cpp's TypeInfo holds it per type;
// its ggml_dequant_rows op (a GGUF token embedding's lookup, model/ggml_linear.py's
// GgmlEmbedding) runs it over the rows of ids: ~180 us a decode step as dequantize_blocks'
// ~20 torch ops on a 1024-wide Q4_K embedding, ~9 us as one call.
// Included by ggml_blocks.cpp (after the type headers).
#pragma once

#include <cstdint>
#include <type_traits>

#include "fp_rounded.h"
#include "ggml_blocks_iq4.h"
#include "ggml_blocks_kquant.h"
#include "ggml_blocks_q5.h"
#include "ggml_blocks_q8.h"

namespace fitserve::ggml {
namespace {

// a 32-value block's nibble order: bytes 0..15 low nibbles, then their high nibbles
inline int nibble32(const uint8_t* qs, int j) { return j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4; }

// Q4_K / Q5_K: 8 sub-blocks of 32, w = d * sc * q - dmin * m (gguf-py: (d * sc) * q - dmin * m)
template <bool kFifth>
void dequant_k45(const uint8_t* b, float* out) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  uint64_t sc, mn;  // byte j: sub-block j's 6-bit scale / min
  scale_min_k4(b + 4, sc, mn);
  const uint8_t* qh = b + 16;
  for (int j = 0; j < 8; ++j) {
    const float dl = d * static_cast<float>((sc >> (8 * j)) & 0xFF);
    const float ml = dmin * static_cast<float>((mn >> (8 * j)) & 0xFF);
    const uint8_t* qs = b + (kFifth ? 48 : 16) + (j / 2) * 32;
    for (int l = 0; l < 32; ++l) {
      int q = j % 2 == 0 ? qs[l] & 0x0F : qs[l] >> 4;
      if constexpr (kFifth) q |= ((qh[l] >> j) & 1) << 4;
      out[j * 32 + l] = rounded(dl * static_cast<float>(q)) - ml;
    }
  }
}

// Q6_K: 16 sub-blocks of 16, w = (d * sc) * (q - 32); ql / qh in two halves of 128 values
inline void dequant_q6k(const uint8_t* b, float* out) {
  const float d = f16_at(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int i = 0; i < 256; ++i) {
    const int g = i / 128, r = i % 128;
    const uint8_t lo = b[g * 64 + r % 64];
    const int ql = r < 64 ? lo & 0x0F : lo >> 4;
    const int qh = (b[128 + g * 32 + i % 32] >> (2 * (r / 32))) & 3;
    const int q = static_cast<int8_t>(ql | (qh << 4)) - 32;
    out[i] = rounded(d * static_cast<float>(sc[i / 16])) * static_cast<float>(q);
  }
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1: w = d * (q - offset), or (d * q) + m with a min
template <bool kMin, bool kFifth>
void dequant_nibble(const uint8_t* b, float* out) {
  using T = NibbleBlock<kMin, kFifth>;
  const float d = f16_at(b);
  const uint8_t* qh = b + T::kQhOff;
  for (int j = 0; j < 32; ++j) {
    int q = nibble32(b + T::kQsOff, j);
    if constexpr (kFifth) q |= ((qh[j / 8] >> (j % 8)) & 1) << 4;
    if constexpr (kMin) out[j] = rounded(d * static_cast<float>(q)) + f16_at(b + 2);
    else out[j] = d * static_cast<float>(q - (kFifth ? 16 : 8));
  }
}

// IQ4_NL / MXFP4: w = scale * table[nibble] (MXFP4's scale the e8m0 byte, halved)
template <bool kMx>
void dequant_table4(const uint8_t* b, float* out) {
  const float s = kMx ? e8m0_half_at(b) : f16_at(b);
  const int8_t* values = kMx ? kMxfp4Values : kIq4Values;
  for (int j = 0; j < 32; ++j)
    out[j] = s * static_cast<float>(values[nibble32(b + (kMx ? 1 : 2), j)]);
}

// IQ4_XS: 8 sub-blocks of 32, w = (d * (ls - 32)) * table[nibble]
inline void dequant_iq4xs(const uint8_t* b, float* out) {
  const float d = f16_at(b);
  const int hi16 = b[2] | (b[3] << 8);
  for (int j = 0; j < 8; ++j) {
    const int lo = j % 2 == 0 ? b[4 + j / 2] & 0x0F : b[4 + j / 2] >> 4;
    const float dl = d * static_cast<float>((lo | (((hi16 >> (2 * j)) & 3) << 4)) - 32);
    for (int l = 0; l < 32; ++l)
      out[j * 32 + l] = dl * static_cast<float>(kIq4Values[nibble32(b + 8 + j * 16, l)]);
  }
}

template <class T>
void dequant_block(const uint8_t* b, float* out) {
  if constexpr (std::is_same_v<T, Q4K>) dequant_k45<false>(b, out);
  else if constexpr (std::is_same_v<T, Q5K>) dequant_k45<true>(b, out);
  else if constexpr (std::is_same_v<T, Q6K>) dequant_q6k(b, out);
  else if constexpr (std::is_same_v<T, Q8_0>) {
    const float d = f16_at(b);
    for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
  } else if constexpr (std::is_same_v<T, IQ4XS>) dequant_iq4xs(b, out);
  else if constexpr (std::is_same_v<T, IQ4NL>) dequant_table4<false>(b, out);
  else if constexpr (std::is_same_v<T, MXFP4>) dequant_table4<true>(b, out);
  else if constexpr (std::is_same_v<T, Q4_0>) dequant_nibble<false, false>(b, out);
  else if constexpr (std::is_same_v<T, Q4_1>) dequant_nibble<true, false>(b, out);
  else if constexpr (std::is_same_v<T, Q5_0>) dequant_nibble<false, true>(b, out);
  else if constexpr (std::is_same_v<T, Q5_1>) dequant_nibble<true, true>(b, out);
  else static_assert(!sizeof(T), "dequant_block: no dequantization for this type");
}

}  // namespace
}  // namespace fitserve::ggml
