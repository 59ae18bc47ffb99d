// fitserve::moe_route: a sparse MoE layer's routing in one call (fitserve/model/moe.py route):
//
//   p[t, e]  = softmax over e of logits[t, :]   (fp32 exp, float64 sum, rounded to fp32 once)
//   ids[t]   = the k experts of largest p[t, e], largest first; equal p: lower e first
//   w[t, j]  = p[t, ids[t, j]], or (renormalize) exp(l_id - max) over the sum of the k chosen
//              exp(l - max), divided in float64 and rounded once (Mixtral / norm_topk_prob: the
//              softmax of the top-k logits, the same numbers as the top-k renormalised)
//
// NOTE: it replaces five ATen calls per layer (float, softmax, topk, sum, div; ~15 us at batch 1
// on the calling thread). Its softmax is within an ulp or two of torch's fp32 one; what must be
// bit-identical is the engine's paths among themselves (module path, Python decode loop and
// decode_layers all call this op).
// Included by moe_experts.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace fitserve::moe {
namespace {

template <class T>
void route_rows(const T* logits, int64_t N, int64_t E, int64_t k, bool renormalize, float* w,
                int64_t* ids) {
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / E), [&](int64_t t0, int64_t t1) {
    std::vector<float> ex(E), p(E);
    std::vector<int64_t> top(k + 1);
    for (int64_t t = t0; t < t1; ++t) {
      const T* l = logits + t * E;
      float mx = -INFINITY;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, static_cast<float>(l[e]));
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        // NOTE: l - max is exact in fp32 for all but far-apart logits; fp32 exp (< 1 ulp) and
        // a float64 sum: within an ulp of the exact softmax, ~4x cheaper than exp in float64
        ex[e] = std::exp(static_cast<float>(l[e]) - mx);
        sum += ex[e];
      }
      for (int64_t e = 0; e < E; ++e) p[e] = static_cast<float>(ex[e] / sum);
      // the k largest p, largest first, by insertion (experts in ascending order: an equal p
      // never moves ahead of the lower expert already placed)
      int64_t n = 0;
      for (int64_t e = 0; e < E; ++e) {
        if (n == k && !(p[e] > p[top[k - 1]])) continue;
        int64_t i = n < k ? n++ : k - 1;
        for (; i > 0 && p[e] > p[top[i - 1]]; --i) top[i] = top[i - 1];
        top[i] = e;
      }
      double chosen = 0.0;
      for (int64_t j = 0; j < k; ++j) chosen += ex[top[j]];
      for (int64_t j = 0; j < k; ++j) {
        ids[t * k + j] = top[j];
        w[t * k + j] = renormalize ? static_cast<float>(ex[top[j]] / chosen) : p[top[j]];
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t k,
                                             bool renormalize) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2,
              "moe_route: logits must be a CPU [N, E] tensor, got ", logits.sizes(), " on ",
              logits.device());
  const int64_t N = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "moe_route: k = ", k, " experts of ", E);
  const at::Tensor l = logits.contiguous();
  at::Tensor w = at::empty({N, k}, l.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({N, k}, l.options().dtype(at::kLong));
  if (N == 0) return {w, ids};
  float* wp = w.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  switch (l.scalar_type()) {
    case at::kFloat: route_rows(l.data_ptr<float>(), N, E, k, renormalize, wp, ip); break;
    case at::kBFloat16:
      route_rows(l.data_ptr<c10::BFloat16>(), N, E, k, renormalize, wp, ip);
      break;
    case at::kHalf: route_rows(l.data_ptr<c10::Half>(), N, E, k, renormalize, wp, ip); break;
    default: TORCH_CHECK(false, "moe_route: logits must be float32 / bfloat16 / float16, got ",
                         l.scalar_type());
  }
  return {w, ids};
}

}  // namespace
}  // namespace fitserve::moe
