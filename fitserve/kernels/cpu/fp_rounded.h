// fitserve::rounded(x): x through an opaque register copy, so the compiler cannot contract the
// product that made it with a later add into an FMA (torch rounds each op: pow(2) then sum,
// a * b then + c), whatever -ffp-contract the tier's flags imply. Used where a kernel must give
// an ATen composite's bits (fused_ops.cpp's RMSNorm rows, kvq_write.cpp's rotation). T: float,
// or a GCC vector of floats (a 32-byte one sits in a vector register only with AVX).
#pragma once

namespace fitserve {

template <class T>
inline T rounded(T x) {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (sizeof(T) <= 16
#if defined(__AVX__)
                || sizeof(T) == 32
#endif
  ) {
    asm volatile("" : "+x"(x));
    return x;
  }
#endif
  volatile T y = x;
  return y;
}

}  // namespace fitserve
