// fitserve::rope_write_kvq_: one call per layer that rotates a step's queries and keys in place
// and writes the keys and values into a quantized KV cache (fitserve/quant/kv_cache.py) as
// codes + scales. It replaces, bit for bit, the module path's
//
//   qk = RotaryEmbedding.forward(qk, tables(positions))     (the rotation in qk's dtype)
//   QuantizedKVCache.write(qk[:, Hq:], v, slots)              (torch's quantizer)
//
// so a step on it gives the same tokens as one through those ~25 small torch ops per layer.
//
// Rotation, as torch computes it: the fp32 cos/sin rows rounded to qk's dtype T, then every
// product and the sum rounded to T (one elementwise op each), never fused into an FMA:
//   split halves  out_i = T(T(x_i c_i) - T(x_{i+D/2} s_i)), out_{i+D/2} = T(T(x_{i+D/2} c_i) + T(x_i s_i))
//   interleaved   the same on the pairs (x_{2i}, x_{2i+1})
// Quantization (per token and KV head, and K per block and channel with "channel-key"):
//   scale = absmax / qmax (an fp32 division); code = encode(x / (scale > 0 ? scale : 1))
//   int8: round half to even, clamp to +-127; fp8: clamp to +-qmax, then c10's RNE cast.
// Per-channel keys keep each block's running absmax: a block the step starts (a slot at offset
// 0) starts from 0; one whose scale grows in any (head, channel) has every code of the block
// re-encoded at the new scales first (decode x old / new), exactly as _write_channel_keys.
// On AVX-512 (bf16 / fp16 activations) the rotation, the encoder, the per-channel scales and the
// re-encode run 16 lanes at a time (kvq_rotate.h, kvq_encode.h), bit-equal to the scalar code.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "fp_rounded.h"
#include "kvq_encode.h"
#include "kvq_rotate.h"

namespace {

enum Codec : int64_t { kInt8 = 0, kE4M3 = 1, kE5M2 = 2 };
constexpr int64_t kMaxHalf = 256;  // head_dim / 2 the vector rotation's stack tables hold

using fitserve::rounded;  // fp_rounded.h: torch rounds the product before the add

template <typename T> inline float in_t(float x) { return rounded(static_cast<float>(static_cast<T>(x))); }

template <typename T>
inline void rotate_pair(T* a, T* b, float c, float s) {
  const float x0 = static_cast<float>(*a), x1 = static_cast<float>(*b);
  const float ct = in_t<T>(c), st = in_t<T>(s);
  const float p0 = in_t<T>(x0 * ct), p1 = in_t<T>(x1 * st);
  const float p2 = in_t<T>(x1 * ct), p3 = in_t<T>(x0 * st);
  *a = static_cast<T>(p0 - p1);
  *b = static_cast<T>(p2 + p3);
}

template <typename T>
void rotate_head(T* h, const float* c, const float* s, int64_t d, bool interleaved) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    if (interleaved) rotate_pair(h + 2 * i, h + 2 * i + 1, c[i], s[i]);
    else rotate_pair(h + i, h + i + half, c[i], s[i]);
  }
}

struct Codes {
  int64_t codec;
  float qmax;
  // x already divided by its scale -> the code's byte
  uint8_t encode(float x) const {
    if (codec == kInt8) {
      const float r = std::min(std::max(std::nearbyint(x), -qmax), qmax);
      return static_cast<uint8_t>(static_cast<int8_t>(r));
    }
    const float y = std::min(std::max(x, -qmax), qmax);
    if (std::isnan(x)) return codec == kE4M3 ? c10::Float8_e4m3fn(x).x : c10::Float8_e5m2(x).x;
    return codec == kE4M3 ? c10::Float8_e4m3fn(y).x : c10::Float8_e5m2(y).x;
  }
  float decode(uint8_t b) const {
    if (codec == kInt8) return static_cast<float>(static_cast<int8_t>(b));
    if (codec == kE4M3) return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
    return static_cast<float>(c10::Float8_e5m2(b, c10::Float8_e5m2::from_bits()));
  }
};

inline float safe(float s) { return s > 0.f ? s : 1.f; }

// One [d] row of x -> codes at its own absmax scale (per token); returns the scale.
template <typename T>
float write_token_row(const Codes& cd, const T* x, int64_t d, uint8_t* codes) {
#if KVQ_ENCODE_AVX512
  if constexpr (kEncode512<T>) {
    const float scale = absmax_512(x, d) / cd.qmax;
    encode_row_512(cd.codec, cd.qmax, x, nullptr, safe(scale), d, codes);
    return scale;
  }
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float scale = amax / cd.qmax;
  const float div = safe(scale);
  for (int64_t i = 0; i < d; ++i) codes[i] = cd.encode(static_cast<float>(x[i]) / div);
  return scale;
}

struct Cache {
  uint8_t *kc, *vc;
  float *ks, *vs;
  int64_t hkv, nb, bs, d;
};

// K with per-channel block scales: the step's tokens grouped by block (see the header).
template <typename T>
void write_channel_keys(const Codes& cd, const Cache& c, const T* k, int64_t k_s0, int64_t k_s1,
                        const int64_t* slots, int64_t n) {
  const int64_t h_n = c.hkv, d = c.d, bs = c.bs, cap = c.nb * bs;
  // NOTE: the buffers are the thread's, kept between calls: a W1 step allocates nothing
  thread_local std::vector<int64_t> order, tokens;
  thread_local std::vector<float> old, fresh_max, scale, div;
  for (auto* b : {&old, &fresh_max, &scale, &div}) b->resize(static_cast<size_t>(h_n * d));
  // the step's tokens grouped by block, in token order within each (a W1 step: one token)
  order.resize(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (n > 1)
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return slots[a] / bs < slots[b] / bs; });
  for (int64_t first = 0; first < n;) {
    const int64_t blk = slots[order[first]] / bs;
    tokens.clear();
    for (; first < n && slots[order[first]] / bs == blk; ++first) tokens.push_back(order[first]);
    bool fresh = false, grew = false;
    std::fill(fresh_max.begin(), fresh_max.end(), 0.f);
    for (int64_t t : tokens) fresh |= slots[t] % bs == 0;
#if KVQ_ENCODE_AVX512
    if constexpr (kEncode512<T>) {
      for (int64_t t : tokens)
        for (int64_t h = 0; h < h_n; ++h) absmax_into_512(k + t * k_s0 + h * k_s1, d, &fresh_max[h * d]);
      for (int64_t h = 0; h < h_n; ++h)
        grew |= grow_scales_512(c.ks + (h * c.nb + blk) * d, &fresh_max[h * d], cd.qmax, d,
                                &old[h * d], &scale[h * d], &div[h * d], fresh);
      if (grew && !fresh)  // see the scalar branch's NOTE
        for (int64_t h = 0; h < h_n; ++h)
          reencode_block_512(cd.codec, cd.qmax, c.kc + (h * c.nb + blk) * bs * d, bs, d,
                             &old[h * d], &scale[h * d]);
    } else
#endif
    {
      for (int64_t t : tokens)
        for (int64_t h = 0; h < h_n; ++h)
          for (int64_t i = 0; i < d; ++i)
            fresh_max[h * d + i] = std::max(fresh_max[h * d + i],
                                            std::fabs(static_cast<float>(k[t * k_s0 + h * k_s1 + i])));
      for (int64_t h = 0; h < h_n; ++h)
        for (int64_t i = 0; i < d; ++i) {
          const int64_t j = h * d + i;
          old[j] = fresh ? 0.f : c.ks[(h * c.nb + blk) * d + i];
          scale[j] = std::max(old[j], fresh_max[j] / cd.qmax);
          grew |= scale[j] > old[j];
        }
      if (grew && !fresh)  // re-encode the block's codes at the grown scales
        // NOTE: only the (head, channel) columns whose scale grew: at an unchanged scale s,
        // encode(decode(c) * s / s) == c for every code (|c| <= qmax, one rounding of 2^-24
        // relative), so skipping them gives the same bytes as re-encoding the whole block (torch)
        for (int64_t h = 0; h < h_n; ++h)
          for (int64_t i = 0; i < d; ++i) {
            const int64_t j = h * d + i;
            if (!(scale[j] > old[j])) continue;
            uint8_t* col = c.kc + (h * c.nb + blk) * bs * d + i;
            for (int64_t tok = 0; tok < bs; ++tok)
              col[tok * d] = cd.encode(rounded(cd.decode(col[tok * d]) * old[j]) / safe(scale[j]));
          }
      for (int64_t h = 0; h < h_n; ++h)
        std::copy_n(scale.data() + h * d, d, c.ks + (h * c.nb + blk) * d);
      for (int64_t j = 0; j < h_n * d; ++j) div[j] = safe(scale[j]);
    }
    for (int64_t t : tokens)
      for (int64_t h = 0; h < h_n; ++h) {
        uint8_t* row = c.kc + (h * cap + slots[t]) * d;
        const T* x = k + t * k_s0 + h * k_s1;
#if KVQ_ENCODE_AVX512
        if constexpr (kEncode512<T>) {
          encode_row_512(cd.codec, cd.qmax, x, div.data() + h * d, 1.f, d, row);
          continue;
        }
#endif
        for (int64_t i = 0; i < d; ++i) row[i] = cd.encode(static_cast<float>(x[i]) / div[h * d + i]);
      }
  }
}

void check(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
           const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ks, const at::Tensor& vs,
           int64_t num_q_heads, int64_t codec, bool channel_keys) {
  TORCH_CHECK(qk.device().is_cpu(), "rope_write_kvq_: CPU tensors only");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "rope_write_kvq_: qk must be [N, H, D], D contiguous");
  TORCH_CHECK(v.dim() == 3 && v.stride(2) == 1 && v.scalar_type() == qk.scalar_type(),
              "rope_write_kvq_: v must be [N, Hkv, D] in qk's dtype, D contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "rope_write_kvq_: rope tables must be contiguous fp32 [max_positions, D/2]");
  TORCH_CHECK(codec == kInt8 || codec == kE4M3 || codec == kE5M2,
              "rope_write_kvq_: codec must be 0 (int8), 1 (fp8 e4m3fn) or 2 (fp8 e5m2), got ", codec);
  const auto want = codec == kInt8 ? at::kChar : at::kByte;
  TORCH_CHECK(kc.scalar_type() == want && vc.scalar_type() == want && kc.is_contiguous() &&
                  vc.is_contiguous() && kc.dim() == 4 && vc.sizes() == kc.sizes(),
              "rope_write_kvq_: codes must be contiguous [Hkv, num_blocks, block_size, D] ",
              codec == kInt8 ? "int8" : "uint8 (fp8 bits)");
  const int64_t hkv = kc.size(0), nb = kc.size(1), bs = kc.size(2), d = kc.size(3);
  TORCH_CHECK(qk.size(1) == num_q_heads + hkv && v.size(1) == hkv && qk.size(2) == d &&
                  v.size(0) == qk.size(0) && d % 2 == 0 && cos.size(1) == d / 2,
              "rope_write_kvq_: head counts or head_dim do not match the cache");
  TORCH_CHECK(ks.scalar_type() == at::kFloat && vs.scalar_type() == at::kFloat &&
                  ks.is_contiguous() && vs.is_contiguous(),
              "rope_write_kvq_: scales must be contiguous float32");
  TORCH_CHECK(vs.dim() == 3 && vs.size(0) == hkv && vs.size(1) == nb && vs.size(2) == bs,
              "rope_write_kvq_: v_scales must be [Hkv, num_blocks, block_size]");
  TORCH_CHECK(ks.dim() == 3 && ks.size(0) == hkv && ks.size(1) == nb &&
                  ks.size(2) == (channel_keys ? d : bs),
              "rope_write_kvq_: k_scales must be [Hkv, num_blocks, ", channel_keys ? "D]" : "block_size]");
}

void rope_write_kvq_(at::Tensor& qk, const at::Tensor& v, const at::Tensor& positions,
                     const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_codes,
                     at::Tensor& v_codes, at::Tensor& k_scales, at::Tensor& v_scales,
                     const at::Tensor& slots, int64_t num_q_heads, bool interleaved, int64_t codec,
                     bool channel_keys) {
  check(qk, v, cos, sin, k_codes, v_codes, k_scales, v_scales, num_q_heads, codec, channel_keys);
  const int64_t n = qk.size(0), heads = qk.size(1), d = qk.size(2);
  const Cache c{static_cast<uint8_t*>(k_codes.data_ptr()), static_cast<uint8_t*>(v_codes.data_ptr()),
                k_scales.data_ptr<float>(), v_scales.data_ptr<float>(), k_codes.size(0),
                k_codes.size(1), k_codes.size(2), d};
  const at::Tensor pos = positions.to(at::kLong).contiguous(), slot = slots.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == n && slot.numel() == n, "rope_write_kvq_: one position and slot per token");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slot.data_ptr<int64_t>();
  const int64_t cap = c.nb * c.bs;
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "rope_write_kvq_: position ", pp[t], " out of range");
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cap, "rope_write_kvq_: slot ", sp[t], " out of range");
  }
  const Codes cd{codec, codec == kInt8 ? 127.f : (codec == kE4M3 ? 448.f : 57344.f)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rope_write_kvq_", [&] {
    scalar_t* base = qk.data_ptr<scalar_t>();
    const scalar_t* vb = v.data_ptr<scalar_t>();
    const int64_t s0 = qk.stride(0), s1 = qk.stride(1), v0 = v.stride(0), v1 = v.stride(1);
    const int64_t half = d / 2;
    for (int64_t t = 0; t < n; ++t) {
      const float* ct = cos.data_ptr<float>() + pp[t] * half;
      const float* st = sin.data_ptr<float>() + pp[t] * half;
#if KVQ_ENCODE_AVX512
      if constexpr (kRotate512<scalar_t>) {
        if (half <= kMaxHalf) {  // the token's tables rounded once, shared by its heads
          float tab[2 * kMaxHalf];
          rounded_tables<scalar_t>(ct, st, half, tab);
          for (int64_t h = 0; h < heads; ++h)
            rotate_head_512<scalar_t>(base + t * s0 + h * s1, tab, half, interleaved);
          continue;
        }
      }
#endif
      for (int64_t h = 0; h < heads; ++h)
        rotate_head<scalar_t>(base + t * s0 + h * s1, ct, st, d, interleaved);
    }
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < c.hkv; ++h) {
        const int64_t row = h * cap + sp[t];
        c.vs[row] = write_token_row(cd, vb + t * v0 + h * v1, d, c.vc + row * d);
        if (!channel_keys)
          c.ks[row] = write_token_row(cd, base + t * s0 + (num_q_heads + h) * s1, d, c.kc + row * d);
      }
    if (channel_keys)
      write_channel_keys(cd, c, base + num_q_heads * s1, s0, s1, sp, n);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fitserve, m) {
  m.def("rope_write_kvq_(Tensor(a!) qk, Tensor v, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) k_codes, Tensor(c!) v_codes, Tensor(d!) k_scales, Tensor(e!) v_scales, "
        "Tensor slots, int num_q_heads, bool interleaved, int codec, bool channel_keys) -> ()");
}

TORCH_LIBRARY_IMPL(fitserve, CPU, m) { m.impl("rope_write_kvq_", &rope_write_kvq_); }
