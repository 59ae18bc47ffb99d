// fitserve::ggml_dequant_rows: rows `ids` of a weight held as ggml blocks, dequantized to
// float32 (then rounded once to bf16 / fp16 where asked): a GGUF token embedding's lookup
// (model/ggml_linear.py's GgmlEmbedding). The same values as fitserve/quant/ggml_blocks.py's
// dequantize_blocks, hence gguf-py's dequantization, bit for bit: each product and sum is one
// fp32 rounding in gguf-py's order (rounded() keeps a product from being contracted into an
// FMA with the add after it). One token's row of a 1024-wide Q4_K embedding took ~180 us as
// those ~20 torch ops, a few us here.
// Included by ggml_blocks.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fp_rounded.h"

namespace fitserve::ggml::dequant {
namespace {

inline float f16_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h.x, p, 2);
  return static_cast<float>(h);
}

constexpr float kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                  1,    13,   25,  38,  53,  69,  89,  113};
constexpr float kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// d * q + m as two roundings (gguf-py: (d * q) + m)
inline float mul_add(float d, float q, float m) { return fitserve::rounded(d * q) + m; }
// d * q - m as two roundings (gguf-py: d * q - m)
inline float mul_sub(float d, float q, float m) { return fitserve::rounded(d * q) - m; }

// Q4_K / Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes s
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 0x3F;
    mn = s[4 + j] & 0x3F;
  } else {
    sc = (s[8 + j - 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[8 + j - 4] >> 4) | ((s[4 + j - 4] >> 2) & 0x30);
  }
}

// a block's low / high nibble order over 32 values: bytes 0..15 low nibbles, then high
inline int nibble32(const uint8_t* qs, int j) { return j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4; }

// one block b -> out[0 .. block size)
void q4_k(const uint8_t* b, float* out) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(b + 4, j, sc, mn);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(mn);
    const uint8_t* qs = b + 16 + (j / 2) * 32;
    for (int l = 0; l < 32; ++l) {
      const int q = j % 2 == 0 ? qs[l] & 0x0F : qs[l] >> 4;
      out[j * 32 + l] = mul_sub(dl, static_cast<float>(q), ml);
    }
  }
}

void q5_k(const uint8_t* b, float* out) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t* qh = b + 16;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(b + 4, j, sc, mn);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(mn);
    const uint8_t* qs = b + 48 + (j / 2) * 32;
    for (int l = 0; l < 32; ++l) {
      const int q = (j % 2 == 0 ? qs[l] & 0x0F : qs[l] >> 4) | (((qh[l] >> j) & 1) << 4);
      out[j * 32 + l] = mul_sub(dl, static_cast<float>(q), ml);
    }
  }
}

void q6_k(const uint8_t* b, float* out) {
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

// Q5_0 / Q5_1's 5-bit code j: the nibble (qs after qh) and bit j of the 4 qh bytes
inline int q5_code(const uint8_t* qh, const uint8_t* qs, int j) {
  return nibble32(qs, j) | (((qh[j / 8] >> (j % 8)) & 1) << 4);
}

void q4_0(const uint8_t* b, float* out) {
  const float d = f16_at(b);
  for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(nibble32(b + 2, j) - 8);
}

void q4_1(const uint8_t* b, float* out) {
  const float d = f16_at(b), m = f16_at(b + 2);
  for (int j = 0; j < 32; ++j) out[j] = mul_add(d, static_cast<float>(nibble32(b + 4, j)), m);
}

void q8_0(const uint8_t* b, float* out) {
  const float d = f16_at(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(q[j]);
}

void q5_0(const uint8_t* b, float* out) {
  const float d = f16_at(b);
  for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(q5_code(b + 2, b + 6, j) - 16);
}

void q5_1(const uint8_t* b, float* out) {
  const float d = f16_at(b), m = f16_at(b + 2);
  for (int j = 0; j < 32; ++j) out[j] = mul_add(d, static_cast<float>(q5_code(b + 4, b + 8, j)), m);
}

void iq4_nl(const uint8_t* b, float* out) {
  const float d = f16_at(b);
  for (int j = 0; j < 32; ++j) out[j] = d * kIq4Values[nibble32(b + 2, j)];
}

void iq4_xs(const uint8_t* b, float* out) {
  const float d = f16_at(b);
  const int hi16 = b[2] | (b[3] << 8);
  for (int j = 0; j < 8; ++j) {
    const int lo = j % 2 == 0 ? b[4 + j / 2] & 0x0F : b[4 + j / 2] >> 4;
    const float dl = d * static_cast<float>((lo | (((hi16 >> (2 * j)) & 3) << 4)) - 32);
    for (int l = 0; l < 32; ++l) out[j * 32 + l] = dl * kIq4Values[nibble32(b + 8 + j * 16, l)];
  }
}

void mxfp4(const uint8_t* b, float* out) {
  // ggml_e8m0_to_fp32_half: 2^(e - 128) from its bits (e < 2: the subnormals)
  const uint32_t e = b[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
  float s;
  std::memcpy(&s, &bits, 4);
  for (int j = 0; j < 32; ++j) out[j] = s * kMxfp4Values[nibble32(b + 1, j)];
}

struct Dequant {
  const char* name;
  int block, bytes;
  void (*fn)(const uint8_t*, float*);
};

constexpr Dequant kDequant[] = {
    {"Q4_K", 256, 144, q4_k}, {"Q5_K", 256, 176, q5_k},    {"Q6_K", 256, 210, q6_k},
    {"Q4_0", 32, 18, q4_0},   {"Q4_1", 32, 20, q4_1},      {"Q8_0", 32, 34, q8_0},
    {"Q5_0", 32, 22, q5_0},   {"Q5_1", 32, 24, q5_1},      {"IQ4_NL", 32, 18, iq4_nl},
    {"IQ4_XS", 256, 136, iq4_xs}, {"MXFP4", 32, 17, mxfp4},
};

template <class O>
void store(const float* v, int n, O* out) {
  for (int i = 0; i < n; ++i) out[i] = static_cast<O>(v[i]);  // one RNE rounding, as .to()
}

}  // namespace

// blocks uint8 [N, K / block * bytes], ids int64 (any shape) -> [*ids.shape, K] of dtype
// (float32, bfloat16 or float16)
at::Tensor ggml_dequant_rows(const at::Tensor& blocks, const at::Tensor& ids,
                             const std::string& ggml_type, int64_t k, at::ScalarType dtype) {
  const Dequant* t = nullptr;
  for (const Dequant& d : kDequant)
    if (ggml_type == d.name) t = &d;
  TORCH_CHECK(t != nullptr, "ggml_dequant_rows: no dequantization for GGML type ", ggml_type);
  TORCH_CHECK(k > 0 && k % t->block == 0, "ggml_dequant_rows: K=", k,
              " is not a positive multiple of ", ggml_type, "'s block size ", t->block);
  const int64_t row_bytes = k / t->block * t->bytes;
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous() && blocks.dim() == 2 && blocks.size(1) == row_bytes,
              "ggml_dequant_rows: blocks must be contiguous uint8 [N, ", row_bytes, "] for ",
              ggml_type, " with K=", k, ", got ", blocks.sizes(), " ", blocks.scalar_type());
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ggml_dequant_rows: ids must be int64, got ",
              ids.scalar_type());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "ggml_dequant_rows: dtype must be float32, bfloat16 or float16, got ", dtype);
  const at::Tensor flat = ids.reshape({-1}).contiguous();
  const int64_t R = flat.numel(), N = blocks.size(0);
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK_INDEX(ip[r] >= 0 && ip[r] < N, "ggml_dequant_rows: index ", ip[r],
                      " is out of bounds for ", N, " rows");
  std::vector<int64_t> out_shape(ids.sizes().begin(), ids.sizes().end());
  out_shape.push_back(k);
  at::Tensor out = at::empty(out_shape, blocks.options().dtype(dtype));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(k);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* src = bp + ip[r] * row_bytes;
      for (int64_t b = 0; b < k / t->block; ++b) t->fn(src + b * t->bytes, row.data() + b * t->block);
      if (dtype == at::kFloat)
        std::memcpy(out.data_ptr<float>() + r * k, row.data(), k * sizeof(float));
      else if (dtype == at::kBFloat16)
        store(row.data(), static_cast<int>(k), out.data_ptr<c10::BFloat16>() + r * k);
      else
        store(row.data(), static_cast<int>(k), out.data_ptr<c10::Half>() + r * k);
    }
  });
  return out;
}

}  // namespace fitserve::ggml::dequant
