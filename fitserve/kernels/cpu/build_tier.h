// The ISA tier this translation unit was compiled for: build.py passes one FITSERVE_TIER_*
// macro per build (isa.py chooses it at run time), and each extension reports it by name.
#pragma once

namespace fitserve {

inline const char* build_tier_name() {
#if defined(FITSERVE_TIER_AVX512_VNNI)
  return "avx512_vnni";
#elif defined(FITSERVE_TIER_AVX512)
  return "avx512";
#elif defined(FITSERVE_TIER_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace fitserve
