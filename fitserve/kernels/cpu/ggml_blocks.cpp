// fitserve::ggml_matmul: y = x @ W^T with W held as a GGUF tensor's raw ggml blocks
// (uint8 [N, (K / block) * type_size], each row its blocks back to back, as the file stores them).
//
// x (fp32 / bf16 [M, K]) is quantized once per call (ggml_blocks_act.h: per 256 columns for the
// K-quants and IQ4_XS, per 32 for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / MXFP4), then the output rows N are split over torch's threads
// (at::parallel_for) in blocks of 4-32 weight rows. Inside a block, the rows of x go in tiles
// of kTileRows (then 2, 1): each weight row's blocks are decoded once per tile and used for
// every row of the tile (ggml_blocks_kquant.h, _kq512.h, _q5.h, _q8.h, _iq4.h), so M > 1 reads and decodes
// the weights M / kTileRows times, not M times; M = 1 is the same code with a tile of one row.
// On AVX-512 the K-quants from T::Panel::kMinRows rows of x run "lane = output row" panels
// instead (ggml_blocks_kqpanel.h: 16 weight rows decoded once per call), with the same bits, and
// where the CPU has AMX-INT8 their 16-row tiles of x on the tiles (ggml_blocks_kqamx.h); the
// 32-column types and IQ4_XS there from 16 rows of x on AMX tiles too (ggml_blocks_lanes_amx.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "build_tier.h"
#include "ggml_blocks_iq4.h"
#include "ggml_blocks_kquant.h"
#include "ggml_blocks_lanes_amx.h"
#include "ggml_blocks_q5.h"
#include "ggml_blocks_q8.h"
#include "ggml_blocks_run.h"

namespace fitserve::ggml {
namespace {

template <class T>
void run_type(const Act& a, int64_t M, const uint8_t* W, int64_t N, float* out) {
  const int64_t nblk = a.K / T::kQK, row_bytes = nblk * T::kBytes, nb = block_rows(N);
#ifdef FS_GGML_AVX512
  if constexpr (kIsKQuant<T>) {  // many rows of x: the lane = output row panels (_kqpanel.h)
    if (M >= T::Panel::kMinRows)
      return at::parallel_for(0, (N + kPanelLanes - 1) / kPanelLanes, 1, [&](int64_t p0, int64_t p1) {
        const bool amx = kq_amx_start<typename T::Panel>(M);
        for (int64_t p = p0; p < p1; ++p)
          kq_panel_run<typename T::Panel>(W, row_bytes, nblk, a, M, p * kPanelLanes, N, out, amx);
        kq_amx_end(amx);
      });
  }
#endif
#if defined(FS_GGML_VNNI) && defined(FITSERVE_AMX_INT8)
  if constexpr (has_amx_blocks<T>::value) {  // 32-column blocks on AMX tiles (_lanes_amx.h)
    if (lanes_amx_runs<T>(M)) return lanes_amx_run<T>(W, row_bytes, a.K / 32, a, M, N, out);
  }
#endif
  at::parallel_for(0, (N + nb - 1) / nb, 1, [&](int64_t b0, int64_t b1) {
    if constexpr (kIsKQuant<T>) {  // the K-quants' own drivers (ggml_blocks_kqrun.h)
      if (M == 1)
        return kq_rows_quarters<T>(W, row_bytes, nblk, a, b0 * nb, std::min(N, b1 * nb), out);
      for (int64_t blk = b0; blk < b1; ++blk)
        kq_rows_range<T>(W, row_bytes, nblk, a, 0, M, blk * nb, std::min(N, blk * nb + nb), N, out);
      return;
    }
#ifdef FS_GGML_VNNI
    if constexpr (lanes_m1<T>::value) {  // the 32-column block types: 4-row tiles
      if (M == 1)
        return rows_quarters<T>(W, row_bytes, nblk, a, b0 * nb, std::min(N, b1 * nb), out,
                                [&](const uint8_t* const* w4, float* res) {
                                  lanes_rows_m1<T, 4>(w4, nblk, a, 0, res, kLanesAhead);
                                });
    }
#endif
    if (M == 1 && streams_m1<T>(row_bytes))
      return rows_streamed<T>(W, row_bytes, nblk, a, b0 * nb, std::min(N, b1 * nb), out);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * nb, n1 = std::min(N, n0 + nb);
      rows_range<T>(W, row_bytes, nblk, a, 0, M, n0, n1, N, out);
    }
  });
}

template <class T>
void run_x(const at::Tensor& x, const uint8_t* W, int64_t N, float* out) {
  static thread_local ActBuf buf;
  const int64_t M = x.size(0), K = x.size(1);
  // ggml_blocks_lanes.h; the AMX tiles read x in natural order (ggml_blocks_lanes_amx.h)
  const bool lanes_t = M > 1 && lanes_tiles<T>::value && !lanes_amx_runs<T>(M);
  const Act a = x.scalar_type() == at::kBFloat16
                    ? quantize(x.data_ptr<c10::BFloat16>(), M, K, T::kActBlock, T::kPerm128, buf,
                               nullptr, lanes_t)
                    : quantize(x.data_ptr<float>(), M, K, T::kActBlock, T::kPerm128, buf,
                               nullptr, lanes_t);
  run_type<T>(a, M, W, N, out);
  if (buf.q.size() > (size_t{1} << 24)) buf = ActBuf();  // a large prefill's buffers: freed
}

struct TypeInfo {
  const char* name;
  int64_t block, bytes;
  void (*run)(const at::Tensor&, const uint8_t*, int64_t, float*);
};

const TypeInfo kTypes[] = {
    {"Q4_K", Q4K::kQK, Q4K::kBytes, &run_x<Q4K>},
    {"Q5_K", Q5K::kQK, Q5K::kBytes, &run_x<Q5K>},
    {"Q6_K", Q6K::kQK, Q6K::kBytes, &run_x<Q6K>},
    {"Q4_0", Q4_0::kQK, Q4_0::kBytes, &run_x<Q4_0>},
    {"Q4_1", Q4_1::kQK, Q4_1::kBytes, &run_x<Q4_1>},
    {"Q8_0", Q8_0::kQK, Q8_0::kBytes, &run_x<Q8_0>},
    {"Q5_0", Q5_0::kQK, Q5_0::kBytes, &run_x<Q5_0>},
    {"Q5_1", Q5_1::kQK, Q5_1::kBytes, &run_x<Q5_1>},
    {"IQ4_NL", IQ4NL::kQK, IQ4NL::kBytes, &run_x<IQ4NL>},
    {"IQ4_XS", IQ4XS::kQK, IQ4XS::kBytes, &run_x<IQ4XS>},
    {"MXFP4", MXFP4::kQK, MXFP4::kBytes, &run_x<MXFP4>},
};

const TypeInfo& type_info(const std::string& name) {
  for (const TypeInfo& t : kTypes)
    if (name == t.name) return t;
  TORCH_CHECK(false, "ggml_matmul: no kernel for GGML type ", name);
}

at::Tensor ggml_matmul(const at::Tensor& x, const at::Tensor& blocks, const std::string& type,
                       int64_t n, int64_t k) {
  const TypeInfo& t = type_info(type);
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "ggml_matmul: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k,
              "ggml_matmul: x must be a contiguous [M, K=", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "ggml_matmul: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(k > 0 && k % t.block == 0, "ggml_matmul: K=", k, " is not a multiple of ",
              type, "'s block size ", t.block);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.dim() == 2 &&
                  blocks.size(0) == n && blocks.size(1) == k / t.block * t.bytes,
              "ggml_matmul: blocks must be contiguous uint8 [N=", n, ", ", k / t.block * t.bytes,
              "] for ", type, " with K=", k, ", got ", blocks.sizes(), " ",
              blocks.scalar_type());
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0 || n == 0) return out;
  t.run(x, blocks.data_ptr<uint8_t>(), n, out.data_ptr<float>());
  return out;
}

std::vector<std::string> ggml_kernel_types() {
  std::vector<std::string> v;
  for (const TypeInfo& t : kTypes) v.emplace_back(t.name);
  return v;
}

std::string ggml_blocks_tier() { return build_tier_name(); }

// Whether the K-quants' panels run on AMX-INT8 tiles from kKqAmxMinRows rows
// (ggml_blocks_kqamx.h): compiled for this CPU and granted by the OS. ggml_blocks_set_amx turns
// the path on / off for later calls (tests compare the two) and returns whether it is on.
bool ggml_blocks_amx_active() {
#if defined(FS_GGML_AVX512) && defined(FITSERVE_AMX_INT8)
  return fitserve::amx_usable();
#else
  return false;
#endif
}

bool ggml_blocks_set_amx(bool on) {
#if defined(FS_GGML_AVX512) && defined(FITSERVE_AMX_INT8)
  return fitserve::amx_set(on);
#else
  (void)on;
  return false;
#endif
}

}  // namespace
}  // namespace fitserve::ggml

TORCH_LIBRARY_FRAGMENT(fitserve, m) {
  m.def("ggml_matmul(Tensor x, Tensor blocks, str ggml_type, int n, int k) -> Tensor");
  m.def("ggml_kernel_types() -> str[]", &fitserve::ggml::ggml_kernel_types);
  m.def("ggml_blocks_tier() -> str", &fitserve::ggml::ggml_blocks_tier);
  m.def("ggml_blocks_amx_active() -> bool", &fitserve::ggml::ggml_blocks_amx_active);
  m.def("ggml_blocks_set_amx(bool on) -> bool", &fitserve::ggml::ggml_blocks_set_amx);
}

TORCH_LIBRARY_IMPL(fitserve, CPU, m) { m.impl("ggml_matmul", &fitserve::ggml::ggml_matmul); }
