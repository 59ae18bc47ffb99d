// One small set of vector primitives per ISA tier, so qlinear_tiles.h is written once.
//
// The tier macro (FITSERVE_TIER_AVX512_VNNI / _AVX512 / _AVX2 / _SCALAR, set by build.py from the
// CPU found at run time) picks one `Simd` struct, from qlinear_simd_<tier>.h. Vocabulary:
//   B  a vector of kBytes bytes (weight bytes or int8 activations)
//   I  kLanes int32 lanes; lane l holds the sum over bytes 4l..4l+3 of a B (dpbusd's shape)
//   F  kLanes float lanes (the same lanes as I, and the float vectors of the fp32 path)
// Integer path: a "chunk" is kBytes weight bytes. fp32 path: a "step" is kFloatBytes weight
// bytes, turned into kLanes floats (int8) or 2 x kLanes floats (int4 low / high nibbles).
#pragma once

#if defined(FITSERVE_TIER_AVX512_VNNI) || defined(FITSERVE_TIER_AVX512)
#include "qlinear_simd_avx512.h"
#elif defined(FITSERVE_TIER_AVX2)
#include "qlinear_simd_avx2.h"
#else
#include "qlinear_simd_scalar.h"
#endif
