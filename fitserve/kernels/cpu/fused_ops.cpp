// Fused elementwise ops of the decoder layer (vLLM-style custom ops): each replaces 4-10 small
// ATen calls per layer, which at batch 1 cost more in dispatch than in arithmetic.
//
//   rms_norm(x, w, eps)               y = w * to_dtype(x * rsqrt(mean(x^2) + eps))   (fp32 sum in
//                                     ATen's vectorized order: norm_row below)
//   add_rms_norm_(res, x, w, eps)     res = to_dtype(res + x); returns rms_norm(res, w, eps)
//   silu_and_mul(gate_up)             y = silu(gate) * up, gate/up the two halves of the last dim
//   rope_write_kv_(qk, v, pos, cos, sin, k_cache, v_cache, slots, num_q_heads, interleaved)
//       rotates the query and key heads of qk [N, Hq + Hkv, D] in place with the fp32 tables
//       cos/sin [P, D/2] at positions pos [N], then writes the rotated keys and v [N, Hkv, D]
//       into the head-major caches [Hkv, NB, bs, D] at flat slots [N].
//   argmax(x)                         torch.argmax(x, -1) of logits [B, V] (greedy sampling)
//   rms_norm_heads(x, w, eps)         fused.rms_norm_reference bit for bit on bf16 x [N, H, D]
//       (per-head q/k norms, Qwen3): w [D] or [H, D]; ATen's own order of operations (below)
//
// Rounding follows the eager Hugging Face reference: the normalised value is rounded to the
// activation dtype before the weight multiply; everything else is fp32 and rounded once.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include "fp_rounded.h"
#include "simd_exp.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

template <typename T> inline float f32(T v) { return static_cast<float>(v); }
template <typename T> inline T from_f32(float v) { return static_cast<T>(v); }

// RMSNorm rows in one order for every row count (so a token's bits do not depend on its batch):
// the sum of squares is ATen's vectorized inner sum (4 accumulators of 8 lanes, accumulator k
// taking every fourth 8-lane chunk, the chunks past the last group of four into accumulator 0,
// then lane-wise ((0 + 1) + 2) + 3 and the 8 lanes in turn; what F.rms_norm does for D a
// multiple of 8 up to 512, see rms_norm_heads below), then the D % 8 tail in turn. Written with
// GCC vector types: ymm on AVX2 / AVX-512, scalar code elsewhere, the same bits.
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

// v * v kept out of an FMA with the add that takes it (fp_rounded.h)
inline f32x8 squared8(f32x8 v) { return fitserve::rounded(v * v); }

inline f32x8 load8f(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x8 load8f(const c10::BFloat16* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u32x8 b = __builtin_convertvector(h, u32x8) << 16;
  f32x8 v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}
// v rounded to T's values (bf16: nearest even, NaN -> the quiet NaN, as c10::BFloat16 does)
inline f32x8 round8(f32x8 v, float*) { return v; }
inline u32x8 bf16_bits8(f32x8 v) {
  u32x8 b;
  std::memcpy(&b, &v, sizeof b);
  const u32x8 r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const i32x8 nan = v != v;
  return (r & ~reinterpret_cast<const u32x8&>(nan)) | (0x7FC0u & reinterpret_cast<const u32x8&>(nan));
}
inline f32x8 round8(f32x8 v, c10::BFloat16*) {
  const u32x8 b = bf16_bits8(v) << 16;
  f32x8 r;
  std::memcpy(&r, &b, sizeof r);
  return r;
}
inline void store8f(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }
inline void store8f(c10::BFloat16* p, f32x8 v) {
  const u16x8 h = __builtin_convertvector(bf16_bits8(v), u16x8);
  std::memcpy(p, &h, sizeof h);
}

// One row: xr (+ add, rounded to T and written back to xr: add_rms_norm_'s residual), then
// y = T(w * T(x * rsqrt(mean(x^2) + eps))). xf: D floats of scratch.
template <typename T>
void norm_row(T* xr, const T* add, const T* w, T* y, int64_t D, float eps, float* xf) {
  const int64_t D8 = D / 8 * 8, chunks = D / 8, in_fours = chunks / 4 * 4;
  const auto chunk = [&](int64_t c) {  // x's chunk c as floats (+ add, rounded, written back)
    f32x8 v = load8f(xr + c * 8);
    if (add) {
      v = round8(v + load8f(add + c * 8), static_cast<T*>(nullptr));
      store8f(xr + c * 8, v);
    }
    store8f(xf + c * 8, v);
    return v;
  };
  f32x8 acc[4] = {};
  int64_t c = 0;
  for (; c < in_fours; c += 4)  // chunk c into accumulator c % 4 ...
    for (int k = 0; k < 4; ++k) acc[k] += squared8(chunk(c + k));
  for (; c < chunks; ++c) acc[0] += squared8(chunk(c));  // ... the chunks past them into 0
  for (int64_t i = D8; i < D; ++i) {
    if (add) xr[i] = from_f32<T>(f32(xr[i]) + f32(add[i]));
    xf[i] = f32(xr[i]);
  }
  const f32x8 lanes = ((acc[0] + acc[1]) + acc[2]) + acc[3];
  float ss = 0.f;
  for (int j = 0; j < 8; ++j) ss += lanes[j];
  for (int64_t i = D8; i < D; ++i) ss += fitserve::rounded(xf[i] * xf[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D8; i += 8) {
    const f32x8 n = round8(load8f(xf + i) * inv, static_cast<T*>(nullptr));
    store8f(y + i, load8f(w + i) * n);
  }
  // round the normalised value to T first, as the reference does
  for (int64_t i = D8; i < D; ++i) y[i] = from_f32<T>(f32(w[i]) * f32(from_f32<T>(xf[i] * inv)));
}

// The rows of add_rms_norm_ / rms_norm; Half (no vector rounding here) keeps one fp32 sum in turn.
template <typename T>
void rms_norm_rows(T* x, const T* add, const T* w, T* y, int64_t rows, int64_t dim,
                   int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    std::vector<float> buf(dim);
    for (int64_t r = b; r < e; ++r) {
      T* xr = x + r * x_stride;
      const T* ar = add ? add + r * dim : nullptr;
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
        norm_row<T>(xr, ar, w, y + r * dim, dim, eps, buf.data());
        continue;
      }
      float ss = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        if (ar) xr[i] = from_f32<T>(f32(xr[i]) + f32(ar[i]));
        buf[i] = f32(xr[i]);
        ss += buf[i] * buf[i];
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
      T* yr = y + r * dim;
      for (int64_t i = 0; i < dim; ++i)
        yr[i] = from_f32<T>(f32(w[i]) * f32(from_f32<T>(buf[i] * inv)));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [N, D] with unit stride");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype must match x");
  auto w = weight.contiguous();
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(const_cast<scalar_t*>(x.data_ptr<scalar_t>()), nullptr,
                            w.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            x.stride(0), static_cast<float>(eps));
  });
  return y;
}

at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                         double eps) {
  TORCH_CHECK(residual.is_contiguous() && residual.dim() == 2, "add_rms_norm_: residual [N, D]");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: x must match residual");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "add_rms_norm_: weight dtype must match x");
  auto xc = x.contiguous();
  auto w = weight.contiguous();
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    rms_norm_rows<scalar_t>(residual.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(),
                            w.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            x.size(1), static_cast<float>(eps));
  });
  return y;
}

#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// float -> bf16 bits, round to nearest even (c10::BFloat16's rule for finite values)
inline __m512i round_bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb),
                           16);
}
inline __m512 to_bf16_and_back(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16_bits(v), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bf16_bits(v)));
}

// y[0:n) = silu(g) * u, 16 lanes at a time; bf16 rounds silu(g) before the multiply (as the
// reference, F.silu then *, does); returns how many elements it did (a multiple of 16)
template <typename T>
int64_t silu_mul_vec(const T* g, const T* u, T* y, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
      const __m512 gv = load16(g + i);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
      if constexpr (std::is_same_v<T, c10::BFloat16>) s = to_bf16_and_back(s);
      store16(y + i, _mm512_mul_ps(s, load16(u + i)));
    }
  }
  return i;
}
#elif defined(__AVX2__) && defined(__FMA__)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// float -> bf16 bits (in the low 16 bits of each lane), round to nearest even
inline __m256i round_bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb),
                           16);
}
inline __m256 to_bf16_and_back(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16_bits(v), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i b = round_bf16_bits(v);  // 8 x 16-bit values, zero-extended: pack within lanes
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// The AVX2 twin of the AVX-512 loop above (8 lanes; exp256 gives exp512's values).
template <typename T>
int64_t silu_mul_vec(const T* g, const T* u, T* y, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
      const __m256 gv = load8(g + i);
      const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
      if constexpr (std::is_same_v<T, c10::BFloat16>) s = to_bf16_and_back(s);
      store8(y + i, _mm256_mul_ps(s, load8(u + i)));
    }
  }
  return i;
}
#else
template <typename T>
int64_t silu_mul_vec(const T*, const T*, T*, int64_t) { return 0; }
#endif

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: [N, 2I]");
  auto g = gate_up.contiguous();
  const int64_t rows = g.size(0), inter = g.size(1) / 2;
  auto y = at::empty({rows, inter}, g.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = g.data_ptr<scalar_t>();
    scalar_t* dst = y.data_ptr<scalar_t>();
    // NOTE: rows, then columns (an index split by a runtime divisor costs more than the exp);
    // a decode step's few rows run on the calling thread
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, inter)),
                     [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* gr = src + r * 2 * inter;
        const scalar_t* ur = gr + inter;
        scalar_t* yr = dst + r * inter;
        for (int64_t i = silu_mul_vec<scalar_t>(gr, ur, yr, inter); i < inter; ++i) {
          const float gv = f32(gr[i]);
          // F.silu(gate) is rounded to the dtype before the multiply in the reference
          const float s = f32(from_f32<scalar_t>(gv / (1.0f + std::exp(-gv))));
          yr[i] = from_f32<scalar_t>(s * f32(ur[i]));
        }
      }
    });
  });
  return y;
}

template <typename T>
void rotate_head(T* h, const float* c, const float* s, int64_t d, bool interleaved) {
  const int64_t half = d / 2;
  if (interleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const float x0 = f32(h[2 * i]), x1 = f32(h[2 * i + 1]);
      h[2 * i] = from_f32<T>(x0 * c[i] - x1 * s[i]);
      h[2 * i + 1] = from_f32<T>(x1 * c[i] + x0 * s[i]);
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float x0 = f32(h[i]), x1 = f32(h[i + half]);
      h[i] = from_f32<T>(x0 * c[i] - x1 * s[i]);
      h[i + half] = from_f32<T>(x1 * c[i] + x0 * s[i]);
    }
  }
}

void rope_write_kv_(at::Tensor& qk, const at::Tensor& v, const at::Tensor& positions,
                    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slots, int64_t num_q_heads,
                    bool interleaved) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "rope_write_kv_: qk must be [N, H, D]");
  TORCH_CHECK(v.dim() == 3 && v.stride(2) == 1, "rope_write_kv_: v must be [N, Hkv, D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous(), "rope tables must be contiguous fp32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == qk.scalar_type() && v.scalar_type() == qk.scalar_type(),
              "rope_write_kv_: qk, v and the caches must share a dtype");
  const int64_t n = qk.size(0), heads = qk.size(1), d = qk.size(2);
  const int64_t hkv = k_cache.size(0), nb = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(heads == num_q_heads + hkv && v.size(1) == hkv && k_cache.size(3) == d,
              "rope_write_kv_: head counts do not match the cache");
  auto pos = positions.to(at::kLong).contiguous();
  auto slot = slots.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slot.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0), half = d / 2, capacity = nb * bs;
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rope_write_kv_: position out of range");
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "rope_write_kv_: slot out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rope", [&] {
    scalar_t* base = qk.data_ptr<scalar_t>();
    const scalar_t* vb = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const float* cb = cos.data_ptr<float>();
    const float* sb = sin.data_ptr<float>();
    const int64_t s0 = qk.stride(0), s1 = qk.stride(1), v0 = v.stride(0), v1 = v.stride(1);
    at::parallel_for(0, n * heads, 64, [&](int64_t b, int64_t e) {
      for (int64_t idx = b; idx < e; ++idx) {
        const int64_t t = idx / heads, h = idx % heads;
        scalar_t* hp = base + t * s0 + h * s1;
        rotate_head<scalar_t>(hp, cb + pp[t] * half, sb + pp[t] * half, d, interleaved);
        if (h >= num_q_heads) {
          const int64_t kh = h - num_q_heads;
          scalar_t* kd = kc + (kh * capacity + sp[t]) * d;
          scalar_t* vd = vc + (kh * capacity + sp[t]) * d;
          const scalar_t* vs = vb + t * v0 + kh * v1;
          for (int64_t i = 0; i < d; ++i) {
            kd[i] = hp[i];
            vd[i] = vs[i];
          }
        }
      }
    });
  });
}

// ---- argmax: the first index of the largest value of each row; a NaN is larger than every
// number, so a row with NaNs gives its first NaN (torch.argmax's rule). NOTE: torch's CPU argmax
// is a scalar loop (~75 us for one 49k-entry vocabulary row at 1 thread, slower at 2); this
// takes two vector passes over the row (max, then the first lane equal to it), ~10 us.
#if defined(__AVX2__)
template <typename T> inline __m256 load8(const T* p);
template <> inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <> inline __m256 load8<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX2__)
  constexpr bool kVec = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
                        std::is_same_v<T, c10::Half>;
  if constexpr (kVec) {
    __m256 vm = _mm256_set1_ps(m), vnan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = load8<T>(x + i);
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vm = _mm256_max_ps(vm, v);
    }
    nan = _mm256_movemask_ps(vnan) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vm);
    for (float v : lanes) m = std::max(m, v);
  }
#endif
  for (; i < n && !nan; ++i) {
    const float v = f32(x[i]);
    nan = std::isnan(v);
    m = std::max(m, v);
  }
  i = 0;
#if defined(__AVX2__)
  if constexpr (kVec) {
    const __m256 target = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = load8<T>(x + i);
      const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                             : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
      if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = f32(x[i]);
    if (nan ? std::isnan(v) : v == m) return i;
  }
  return 0;  // unreachable for n > 0: the max is one of the values
}

at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax: x must be [B, V] with V > 0");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "argmax", [&] {
    const scalar_t* p = xc.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) o[r] = row_argmax<scalar_t>(p + r * n, n);
    });
  });
  return out;
}

// ---- rms_norm_heads ---------------------------------------------------------------------
// fused.rms_norm_reference = w * F.rms_norm(x.float(), (D,), eps).to(dtype), which ATen runs as
// a dozen ops (pow(2), mean -> sum + div_, add_(eps), rsqrt, mul, .to, the bf16 product): ~60 us
// at batch 1 for Qwen3-MoE's 20 q/k heads, ~11% of its W1 step on the calling thread. Here in
// one pass with the same bits: norm_row (above) adds each row's squares in ATen's vectorized
// inner-sum order (the AVX2 reduction kernel, which torch 2.13 dispatches to at the AVX512
// capability too) for D a multiple of 8 up to 512 (past it the sum's cascade levels differ).
// The order is an implementation detail of torch, so the first call compares both ways on a
// probe and keeps the ATen ops for the process if they differ.

at::Tensor rms_norm_heads_aten(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor normed = at::rms_norm(x.to(at::kFloat), {x.size(-1)}, std::nullopt, eps);
  return w * normed.to(x.scalar_type());
}

constexpr int64_t kHeadsMaxDim = 512;

at::Tensor rms_norm_heads_rows(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  const int64_t w_head = w.dim() == 2 ? D : 0;  // [H, D]: a row per head; [D]: one for all
  at::Tensor out = at::empty({N, H, D}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  float xf[kHeadsMaxDim];
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      auto* row = const_cast<c10::BFloat16*>(xp + n * x.stride(0) + h * x.stride(1));
      norm_row<c10::BFloat16>(row, nullptr, wp + h * w_head, op + (n * H + h) * D, D,
                              static_cast<float>(eps), xf);
    }
  return out;
}

// Whether the one-pass kernel gives ATen's bits on this torch (compared once per process).
bool rms_norm_heads_one_pass() {
  static const bool same = [] {
    // NOTE: values from sin(), not randn(): the probe must not move torch's global generator
    const at::Tensor base = at::arange(3 * 4 * 128, at::kFloat).mul(0.7548776662).sin();
    const at::Tensor probe =
        (base.view({3, 4, 128}) * at::tensor({1e-3f, 1.f, 40.f}).view({3, 1, 1}))
            .to(at::kBFloat16);
    const at::Tensor pw = base.narrow(0, 0, 4 * 128).mul(3.1f).cos().view({4, 128})
                              .to(at::kBFloat16);
    const bool equal = at::equal(rms_norm_heads_rows(probe, pw, 1e-6),
                                 rms_norm_heads_aten(probe, pw, 1e-6));
    if (!equal)
      TORCH_WARN("fitserve_fused::rms_norm_heads: this torch sums in another order than the "
                 "one-pass kernel; using the ATen ops");
    return equal;
  }();
  return same;
}

at::Tensor rms_norm_heads(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3, "rms_norm_heads: x must be [N, H, D], got ", x.sizes());
  const int64_t D = x.size(2);
  const bool w_ok = (weight.dim() == 1 && weight.size(0) == D) ||
                    (weight.dim() == 2 && weight.size(0) == x.size(1) && weight.size(1) == D);
  TORCH_CHECK(w_ok, "rms_norm_heads: weight must be [D] or [H, D] for x ", x.sizes(), ", got ",
              weight.sizes());
  if (x.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16 ||
      x.stride(2) != 1 || !weight.is_contiguous() || D % 8 != 0 || D > kHeadsMaxDim)
    return rms_norm_heads_aten(x, weight, eps);
  return rms_norm_heads_one_pass() ? rms_norm_heads_rows(x, weight, eps)
                                   : rms_norm_heads_aten(x, weight, eps);
}

}  // namespace

TORCH_LIBRARY(fitserve_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope_write_kv_(Tensor(a!) qk, Tensor v, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, int num_q_heads, "
        "bool interleaved) -> ()");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("rms_norm_heads(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_heads_one_pass() -> bool", &rms_norm_heads_one_pass);
}

// CPU kernels only (no CompositeImplicitAutograd): torch.compile then sees opaque ops with the
// fake kernels registered in fused.py.
TORCH_LIBRARY_IMPL(fitserve_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_write_kv_", &rope_write_kv_);
  m.impl("argmax", &argmax);
  m.impl("rms_norm_heads", &rms_norm_heads);
}
