// The quantized KV cache's write lines prefetched ahead of the write (decode_step.cpp).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace {

// NOTE: the quantized write's lines, requested before the layer's qkv GEMV so they arrive
// while it runs (the weight stream evicted them since the layer's last step): each new token's
// V row and V scale, its K row and K scale per token, or with per-channel key scales its key
// block's codes and scales (a grown scale re-encodes the block: ~45% of rope_write_kvq_'s time
// before they were prefetched; the new rows' write misses were ~1/4 of the rest).
void prefetch_write_lines(const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ks,
                          const at::Tensor& vs, const at::Tensor& slots, bool channel_keys) {
  const int64_t n = slots.numel();
  if (n > 8 || !kc.is_contiguous() || !vc.is_contiguous() || !ks.is_contiguous() ||
      !vs.is_contiguous() || kc.dim() != 4 ||
      (slots.scalar_type() != at::kLong && slots.scalar_type() != at::kInt))
    return;
  const int64_t hkv = kc.size(0), nb = kc.size(1), bs = kc.size(2), d = kc.size(3);
  const auto* kcodes = static_cast<const char*>(kc.data_ptr());
  const auto* vcodes = static_cast<const char*>(vc.data_ptr());
  const auto* kscales = static_cast<const char*>(ks.data_ptr());
  const auto* vscales = static_cast<const char*>(vs.data_ptr());
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = slots.scalar_type() == at::kLong ? slots.data_ptr<int64_t>()[t]
                                                          : slots.data_ptr<int32_t>()[t];
    const int64_t blk = slot / bs;
    if (slot < 0 || blk >= nb) continue;
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t row = h * nb * bs + slot;  // the token's row of head h
      for (int64_t b = 0; b < d; b += 64) __builtin_prefetch(vcodes + row * d + b, 1, 3);
      __builtin_prefetch(vscales + row * 4, 1, 3);
      if (!channel_keys) {
        for (int64_t b = 0; b < d; b += 64) __builtin_prefetch(kcodes + row * d + b, 1, 3);
        __builtin_prefetch(kscales + row * 4, 1, 3);
        continue;
      }
      const char* c = kcodes + (h * nb + blk) * bs * d;
      for (int64_t b = 0; b < bs * d; b += 64) __builtin_prefetch(c + b, 1, 2);
      const char* sc = kscales + (h * nb + blk) * d * 4;
      for (int64_t b = 0; b < d * 4; b += 64) __builtin_prefetch(sc + b, 1, 2);
    }
  }
}

}  // namespace
