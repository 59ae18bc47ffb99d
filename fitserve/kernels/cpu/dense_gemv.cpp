// fitserve_dense::bf16_gemv: y = x @ W^T (+ bias) for ONE row of bf16 x and a dense bf16 W.
//
// A batch-1 decode step with dense bf16 weights streams every weight once; on CPUs without
// native bf16 (AVX2) torch's bf16 matrix-vector product reached ~16 GB/s there, where this loop
// (bf16 -> fp32 is a 16-bit shift, then FMA, 4 accumulators per row) streams at ~23-26 GB/s.
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

float row_dot(const c10::BFloat16* w, const float* x, int64_t K) {
  int64_t k = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
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
  static thread_local std::vector<float> xf;
  xf.resize(K);
  const auto* xb = x.contiguous().data_ptr<c10::BFloat16>();
  for (int64_t k = 0; k < K; ++k) xf[k] = static_cast<float>(xb[k]);
  at::Tensor out = at::empty({1, N}, x.options());
  auto* y = out.data_ptr<c10::BFloat16>();
  const auto* w = weight.data_ptr<c10::BFloat16>();
  const c10::BFloat16* b = has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const float* xp = xf.data();
  // rows per task: >= 16 KB of weights, so a task amortises its scheduling
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, 2 * K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float s = row_dot(w + n * K, xp, K);
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
