// Smoke source for the build machinery: y = 2 * x with at::parallel_for (threads via OpenMP).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

static at::Tensor twice(const at::Tensor& x) {
  auto xc = x.contiguous().to(at::kFloat);
  auto y = at::empty_like(xc);
  const float* src = xc.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  at::parallel_for(0, xc.numel(), 1024, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = 2.0f * src[i];
  });
  return y;
}

static int64_t threads_used() {
  int64_t n = 0;
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) { seen++; });
  n = seen.load();
  return n;
}

TORCH_LIBRARY(fitserve_selftest, m) {
  m.def("twice(Tensor x) -> Tensor", &twice);
  m.def("chunks() -> int", &threads_used);
}
