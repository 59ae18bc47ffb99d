// fitserve_dense::bf16_gemv: y = x @ W^T (+ bias) for ONE row of bf16 x and a dense bf16 W.
//
// A batch-1 decode step with dense bf16 weights streams every weight once; torch's bf16
// matrix-vector product reached ~16 GB/s on a Zen 3 (AVX2) and ~14 GB/s on a Zen 4 (AVX512-BF16),
// where this loop streams at the read bandwidth (~23-26 and ~28 GB/s): VDPBF16PS where the CPU
// has it, else bf16 -> fp32 as a 16-bit shift and FMA; 4 accumulators per row.
// Products and sums are fp32 (bias added in fp32), rounded once to bf16 (nearest even).
// fitserve/model/linear.py (DenseLinear) decides where it runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16Dot = true;  // row_dot reads x as bf16 (no fp32 copy of x needed)
#else
constexpr bool kBf16Dot = false;
#endif

// xb: x as bf16; x: the same values in fp32 (only read where !kBf16Dot)
float row_dot(const c10::BFloat16* w, const c10::BFloat16* xb, const float* x, int64_t K) {
  int64_t k = 0;
  float s = 0.f;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)  // kBf16Dot
  // VDPBF16PS: pairs of bf16 products (exact in fp32) added in fp32, 32 weights per
  // instruction and no widening; 4 accumulators, the row's tail through a masked load
  (void)x;
  const auto* p = reinterpret_cast<const uint16_t*>(w);
  const auto* q = reinterpret_cast<const uint16_t*>(xb);
  auto dot = [&](__m512 acc, int64_t i) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(p + i),
                            (__m512bh)_mm512_loadu_si512(q + i));
  };
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 128 <= K; k += 128) {
    a0 = dot(a0, k);
    a1 = dot(a1, k + 32);
    a2 = dot(a2, k + 64);
    a3 = dot(a3, k + 96);
  }
  for (; k + 32 <= K; k += 32) a0 = dot(a0, k);
  if (k < K) {
    const __mmask32 m = static_cast<__mmask32>((1ULL << (K - k)) - 1);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m, p + k),
                          (__m512bh)_mm512_maskz_loadu_epi16(m, q + k));
    k = K;
  }
  s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__) && defined(__FMA__)
  (void)xb;
  const auto* p = reinterpret_cast<const uint16_t*>(w);
  auto load = [&](int64_t i) {  // 8 bf16 -> 8 fp32: the bits moved to the high half
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(load(k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(load(k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(load(k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(load(k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load(k), _mm256_loadu_ps(x + k), a0);
  const __m256 v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; k < K; ++k) s += static_cast<float>(w[k]) * x[k];
  return s;
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_gemv: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16_gemv: x and weight must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "bf16_gemv: x must be [1, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "bf16_gemv: weight must be a contiguous [N, K] with x's K");
  const int64_t N = weight.size(0), K = weight.size(1);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                "bf16_gemv: bias must be a contiguous bfloat16 [N]");
  const at::Tensor xc = x.contiguous();  // kept alive: xb points into it
  const auto* xb = xc.data_ptr<c10::BFloat16>();
  static thread_local std::vector<float> xf;
  if (!kBf16Dot) {
    xf.resize(K);
    for (int64_t k = 0; k < K; ++k) xf[k] = static_cast<float>(xb[k]);
  }
  at::Tensor out = at::empty({1, N}, x.options());
  auto* y = out.data_ptr<c10::BFloat16>();
  const auto* w = weight.data_ptr<c10::BFloat16>();
  const c10::BFloat16* b = has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const float* xp = xf.data();
  // rows per task: >= 16 KB of weights, so a task amortises its scheduling
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, 2 * K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float s = row_dot(w + n * K, xb, xp, K);
      if (b) s += static_cast<float>(b[n]);
      y[n] = c10::BFloat16(s);  // round to nearest even
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fitserve_dense, m) {
  m.def("bf16_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fitserve_dense, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }
