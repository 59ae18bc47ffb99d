// The frame of a row lookup op (a token embedding held quantized: ggml_dequant_rows.h,
// qlinear_held_rows.h): ids checked against the table's rows, the output [*ids.shape, k]
// allocated in float32 / bfloat16 / float16, and each id's row made in float32 by the caller's
// row_fn then rounded once to the output dtype (c10's round to nearest even: the bits of .to()).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace fitserve {

// row_fn(id, float* row): row id's k values. op names the caller in the errors.
template <class RowFn>
at::Tensor lookup_rows(const char* op, const at::Tensor& ids, int64_t n_rows, int64_t k,
                       at::ScalarType dtype, const at::TensorOptions& options, RowFn&& row_fn) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, op, ": ids must be int64, got ", ids.scalar_type());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": dtype must be float32, bfloat16 or float16, got ", dtype);
  const at::Tensor flat = ids.reshape({-1}).contiguous();
  const int64_t R = flat.numel();
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK_INDEX(ip[r] >= 0 && ip[r] < n_rows, op, ": index ", ip[r],
                      " is out of bounds for ", n_rows, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, options.dtype(dtype));
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(k);
    for (int64_t r = r0; r < r1; ++r) {
      row_fn(ip[r], row.data());
      if (dtype == at::kFloat) {
        std::memcpy(out.data_ptr<float>() + r * k, row.data(), k * sizeof(float));
      } else if (dtype == at::kBFloat16) {
        c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + r * k;
        for (int64_t c = 0; c < k; ++c) o[c] = static_cast<c10::BFloat16>(row[c]);
      } else {
        c10::Half* o = out.data_ptr<c10::Half>() + r * k;
        for (int64_t c = 0; c < k; ++c) o[c] = static_cast<c10::Half>(row[c]);
      }
    }
  });
  return out;
}

}  // namespace fitserve
