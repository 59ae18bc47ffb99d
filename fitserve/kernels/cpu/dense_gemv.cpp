// fitserve_dense::bf16_gemv: y = x @ W^T (+ bias) for ONE row of bf16 x and a dense bf16 W.
//
// A batch-1 decode step with dense bf16 weights streams every weight once; torch's bf16
// matrix-vector product reached ~16 GB/s on a Zen 3 (AVX2) and ~14 GB/s on a Zen 4 (AVX512-BF16),
// where this loop streams at the read bandwidth (~23-26 and ~28 GB/s): VDPBF16PS where the CPU
// has it, else bf16 -> fp32 as a 16-bit shift and FMA; 4 accumulators per row.
// Products and sums are fp32 (bias added in fp32), rounded once to bf16 (nearest even).
// fitserve/model/linear.py (DenseLinear) decides where it runs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "dense_row_dot.h"
#include "row_runs.h"
#include "stream_prefetch.h"

namespace {

using fitserve::dense::kBf16Dot;
using fitserve::dense::row_dot;

constexpr int64_t kAheadBytes = 4096;  // requested ahead of the row computed, per run

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
  const auto finish = [&](int64_t n, float s) {  // + bias in fp32, one rounding to bf16
    if (b) s += static_cast<float>(b[n]);
    y[n] = c10::BFloat16(s);  // round to nearest even
  };
  const auto row = [&](int64_t n) { finish(n, row_dot(w + n * K, xb, xp, K)); };
  const int64_t row_bytes = 2 * K;
  const auto prefetch = [&](int64_t n) {
    const auto* r = reinterpret_cast<const char*>(w + n * K);
    for (int64_t o = 0; o < row_bytes; o += 64) fitserve::prefetch_stream(r + o);
  };
  const int64_t ahead = std::max<int64_t>(1, (kAheadBytes + row_bytes - 1) / row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)  // kBf16Dot: four rows, x read once
    fitserve::rows_in_runs(n0, n1, ahead, prefetch, row, [&](const int64_t* ns) {
      const c10::BFloat16* ws[4] = {w + ns[0] * K, w + ns[1] * K, w + ns[2] * K, w + ns[3] * K};
      float s[4];
      fitserve::dense::row_dot4(ws, xb, K, s);
      for (int r = 0; r < 4; ++r) finish(ns[r], s[r]);
    });
#else
    fitserve::rows_in_runs(n0, n1, ahead, prefetch, row);  // row_runs.h
#endif
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fitserve_dense, m) {
  m.def("bf16_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fitserve_dense, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }
