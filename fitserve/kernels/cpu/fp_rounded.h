// fitserve::rounded(x): x through an opaque register copy, so the compiler cannot contract the
// product that made it with a later add into an FMA (torch rounds each op: pow(2) then sum,
// a * b then + c), whatever -ffp-contract the tier's flags imply. Used where a kernel must give
// an ATen composite's bits (fused_ops.cpp's rms_norm_heads, kvq_write.cpp's rotation).
#pragma once

namespace fitserve {

inline float rounded(float x) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("" : "+x"(x));
#else
  volatile float y = x;
  x = y;
#endif
  return x;
}

}  // namespace fitserve
