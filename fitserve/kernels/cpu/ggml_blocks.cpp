// fitserve::ggml_matmul: y = x @ W^T with W held as a GGUF tensor's raw ggml blocks
// (uint8 [N, (K / block) * type_size], each row its blocks back to back, as the file stores them).
//
// x (fp32 / bf16 [M, K]) is quantized once per call (ggml_blocks_act.h: per 256 columns for the
// K-quants and IQ4_XS, per 32 for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / MXFP4), then the output rows N are split over torch's threads
// (at::parallel_for) in blocks of 4-32 weight rows. Inside a block, the rows of x go in tiles
// of kTileRows (then 2, 1): each weight row's blocks are decoded once per tile and used for
// every row of the tile (ggml_blocks_kquant.h, _kq512.h, _q5.h, _q8.h, _iq4.h), so M > 1 reads and decodes
// the weights M / kTileRows times, not M times; M = 1 is the same code with a tile of one row.
// On AVX-512 the K-quants (and IQ4_XS on AVX512-VNNI: ggml_blocks_iq4panel.h) from
// T::Panel::kMinRows rows of x run "lane = output row" panels instead (ggml_blocks_kqpanel.h: 16
// weight rows decoded once per call), with the same bits, and where the CPU has AMX-INT8 the
// K-quants' 16-row tiles of x on the tiles (ggml_blocks_kqamx.h); the 32-column types there
// from 16 rows of x on AMX tiles too (ggml_blocks_lanes_amx.h).
// Otherwise on AVX512-VNNI those types decode each weight row once per call from 9 rows of x
// (ggml_blocks_lanes_panel.h), every tile of x reading the decoded steps.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <type_traits>
#include <vector>

#include "build_tier.h"
#include "ggml_blocks_iq4.h"
#include "ggml_blocks_kquant.h"
#include "ggml_blocks_lanes_amx.h"
#include "ggml_blocks_lanes_panel.h"
#include "ggml_blocks_q5.h"
#include "ggml_blocks_q8.h"
#include "ggml_blocks_run.h"
#include "ggml_dequant_rows.h"
#include "row_lookup.h"

namespace fitserve::ggml {
namespace {

// Weight rows in blocks [b0, b1) of nb rows (one thread's share of run_type's loop) on M rows of
// x: the K-quants' drivers, the 32-column types' 4-row tiles at M = 1, the streamed rows, else
// rows_range; each output row's bits are its own whatever the split (ggml_blocks_run.h).
template <class T>
void run_blocks(const Act& a, int64_t M, const uint8_t* W, int64_t N, int64_t nb, int64_t b0,
                int64_t b1, float* out) {
  const int64_t nblk = a.K / T::kQK, row_bytes = nblk * T::kBytes;
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
  if constexpr (lanes_tiles<T>::value) {  // each weight row decoded once (_lanes_panel.h)
    if (a.lanes_t && M >= kLanesPanelMinRows) {
      for (int64_t blk = b0; blk < b1; ++blk)
        lanes_panel_range<T>(W, row_bytes, nblk, a, M, blk * nb, std::min(N, blk * nb + nb), N,
                             out);
      return;
    }
  }
#endif
  if (M == 1 && streams_m1<T>(row_bytes))
    return rows_streamed<T>(W, row_bytes, nblk, a, b0 * nb, std::min(N, b1 * nb), out);
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t n0 = blk * nb, n1 = std::min(N, n0 + nb);
    rows_range<T>(W, row_bytes, nblk, a, 0, M, n0, n1, N, out);
  }
}

// The types with "lane = output row" panels for many rows of x: the K-quants on AVX-512, IQ4_XS
// on AVX512-VNNI (T::Panel).
template <class T, class = void>
struct has_panel : std::false_type {};
template <class T>
struct has_panel<T, std::void_t<typename T::Panel>> : std::true_type {};

template <class T>
void run_type(const Act& a, int64_t M, const uint8_t* W, int64_t N, float* out) {
  const int64_t nblk = a.K / T::kQK, row_bytes = nblk * T::kBytes, nb = block_rows(N);
#ifdef FS_GGML_AVX512
  if constexpr (has_panel<T>::value) {  // many rows of x: lane = output row panels (_kqpanel.h)
    if (M >= T::Panel::kMinRows)
      return at::parallel_for(0, (N + kPanelLanes - 1) / kPanelLanes, 1, [&](int64_t p0, int64_t p1) {
        const bool amx = kq_amx_start<typename T::Panel>(M);
        // two panels (32 weight rows) per register tile where the share has them (not AMX)
        for (int64_t p = p0; p < p1; p += amx ? 1 : 2)
          kq_panel_run<typename T::Panel>(W, row_bytes, nblk, a, M, p * kPanelLanes, N, out, amx,
                                          !amx && p + 1 < p1);
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
    run_blocks<T>(a, M, W, N, nb, b0, b1, out);
  });
}

// x's rows (bf16 / fp32 [M, K]) quantized for T into buf; lanes_t: the VNNI tiles' layout
template <class T>
Act quantize_x(const at::Tensor& x, ActBuf& buf, bool lanes_t) {
  const int64_t M = x.size(0), K = x.size(1);
  return x.scalar_type() == at::kBFloat16
             ? quantize(x.data_ptr<c10::BFloat16>(), M, K, T::kActBlock, T::kPerm128, buf,
                        nullptr, lanes_t)
             : quantize(x.data_ptr<float>(), M, K, T::kActBlock, T::kPerm128, buf, nullptr,
                        lanes_t);
}

template <class T>
void run_x(const at::Tensor& x, const uint8_t* W, int64_t N, float* out) {
  static thread_local ActBuf buf;
  const int64_t M = x.size(0);
  // ggml_blocks_lanes.h; the AMX tiles read x in natural order (ggml_blocks_lanes_amx.h)
  const bool lanes_t = M > 1 && lanes_tiles<T>::value && !lanes_amx_runs<T>(M);
  run_type<T>(quantize_x<T>(x, buf, lanes_t), M, W, N, out);
  if (buf.q.size() > (size_t{1} << 24)) buf = ActBuf();  // a large prefill's buffers: freed
}

struct TypeInfo {
  const char* name;
  int64_t block, bytes;
  void (*run)(const at::Tensor&, const uint8_t*, int64_t, float*);
  // ggml_matmul_parts' pieces: x's quantization (act_block, perm128 name the layout, so parts of
  // types that share it share one) and a thread's share of the weight-row blocks
  int64_t act_block;
  bool perm128;
  Act (*quantize)(const at::Tensor&, ActBuf&, bool);
  void (*run_blocks)(const Act&, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t,
                     float*);
  void (*dequant)(const uint8_t*, float*);  // one block -> float32 (ggml_dequant_rows.h)
};

#define FS_GGML_TYPE(name, T) \
  {name, T::kQK, T::kBytes, &run_x<T>, T::kActBlock, T::kPerm128, &quantize_x<T>, &run_blocks<T>, \
   &dequant_block<T>}
const TypeInfo kTypes[] = {
    FS_GGML_TYPE("Q4_K", Q4K),     FS_GGML_TYPE("Q5_K", Q5K),   FS_GGML_TYPE("Q6_K", Q6K),
    FS_GGML_TYPE("Q4_0", Q4_0),    FS_GGML_TYPE("Q4_1", Q4_1),  FS_GGML_TYPE("Q8_0", Q8_0),
    FS_GGML_TYPE("Q5_0", Q5_0),    FS_GGML_TYPE("Q5_1", Q5_1),  FS_GGML_TYPE("IQ4_NL", IQ4NL),
    FS_GGML_TYPE("IQ4_XS", IQ4XS), FS_GGML_TYPE("MXFP4", MXFP4),
};
#undef FS_GGML_TYPE

const TypeInfo& type_info(const std::string& name, const char* op = "ggml_matmul") {
  for (const TypeInfo& t : kTypes)
    if (name == t.name) return t;
  TORCH_CHECK(false, op, ": no kernel for GGML type ", name);
}

// blocks: contiguous CPU uint8 [N, K / block * bytes] of type t (n >= 0: N = n rows)
void check_blocks(const char* op, const at::Tensor& blocks, const TypeInfo& t,
                  const std::string& type, int64_t n, int64_t k) {
  TORCH_CHECK(k > 0 && k % t.block == 0, op, ": K=", k, " is not a multiple of ",
              type, "'s block size ", t.block);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous() && blocks.dim() == 2 &&
                  (n < 0 || blocks.size(0) == n) && blocks.size(1) == k / t.block * t.bytes,
              op, ": blocks must be contiguous uint8 [N", n < 0 ? "" : "=" + std::to_string(n),
              ", ", k / t.block * t.bytes, "] for ", type, " with K=", k, ", got ",
              blocks.sizes(), " ", blocks.scalar_type());
}

void check_args(const char* op, const at::Tensor& x, const at::Tensor& blocks, const TypeInfo& t,
                const std::string& type, int64_t n, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k,
              op, ": x must be a contiguous [M, K=", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              op, ": x must be float32 or bfloat16, got ", x.scalar_type());
  check_blocks(op, blocks, t, type, n, k);
}

// fitserve::ggml_dequant_rows: rows `ids` of blocks [N, K / block * bytes] dequantized,
// [*ids.shape, K] of dtype (a GGUF token embedding's lookup; ggml_dequant_rows.h)
at::Tensor ggml_dequant_rows(const at::Tensor& blocks, const at::Tensor& ids,
                             const std::string& type, int64_t k, at::ScalarType dtype) {
  const TypeInfo& t = type_info(type, "ggml_dequant_rows");
  check_blocks("ggml_dequant_rows", blocks, t, type, -1, k);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const int64_t nblk = k / t.block, row_bytes = nblk * t.bytes;
  return lookup_rows("ggml_dequant_rows", ids, blocks.size(0), k, dtype, blocks.options(),
                     [&](int64_t id, float* row) {
                       const uint8_t* src = bp + id * row_bytes;
                       for (int64_t b = 0; b < nblk; ++b)
                         t.dequant(src + b * t.bytes, row + b * t.block);
                     });
}

at::Tensor ggml_matmul(const at::Tensor& x, const at::Tensor& blocks, const std::string& type,
                       int64_t n, int64_t k) {
  const TypeInfo& t = type_info(type);
  check_args("ggml_matmul", x, blocks, t, type, n, k);
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0 || n == 0) return out;
  t.run(x, blocks.data_ptr<uint8_t>(), n, out.data_ptr<float>());
  return out;
}

// fitserve::ggml_matmul_parts: the ggml_matmul of each part (weight rows of its own type) side
// by side, [M, sum of the parts' N], float32 or, with out_x_dtype, rounded to x's dtype as
// `.to()` rounds: the bits of torch.cat([ggml_matmul(x, part) ...], -1)[.to(x.dtype)]. One row
// of x (a decode step's linear of several GGUF tensors, e.g. a Q4_K_M qkv whose attn_v is Q6_K)
// runs every part in one parallel region, each thread its share of every part's row blocks.
// NOTE: one fork / join, no cat and no cast op where the parts took a region, an output, a cat
// and a cast each (~12 us of a Qwen3-MoE layer's 87 us qkv at batch 1, on the calling thread)
at::Tensor ggml_matmul_parts(const at::Tensor& x, at::TensorList blocks,
                             at::ArrayRef<std::string> types, bool out_x_dtype) {
  const int64_t P = static_cast<int64_t>(blocks.size());
  TORCH_CHECK(P >= 1 && static_cast<int64_t>(types.size()) == P,
              "ggml_matmul_parts: one type per part, got ", P, " parts and ", types.size(),
              " types");
  TORCH_CHECK(x.dim() == 2, "ggml_matmul_parts: x must be [M, K], got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<const TypeInfo*> info(P);
  std::vector<int64_t> off(P + 1, 0);
  for (int64_t i = 0; i < P; ++i) {
    info[i] = &type_info(types[i]);
    check_args("ggml_matmul_parts", x, blocks[i], *info[i], types[i], blocks[i].size(0), K);
    off[i + 1] = off[i] + blocks[i].size(0);
  }
  const int64_t N = off[P];
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  if (M == 1) {
    static thread_local std::vector<ActBuf> bufs;
    if (static_cast<int64_t>(bufs.size()) < P) bufs.resize(P);
    std::vector<Act> acts;
    for (int64_t i = 0; i < P; ++i) {
      int64_t same = 0;
      while (same < i && (info[same]->act_block != info[i]->act_block ||
                          info[same]->perm128 != info[i]->perm128))
        ++same;
      acts.push_back(same < i ? acts[same] : info[i]->quantize(x, bufs[i], false));
    }
    std::vector<int64_t> nb(P), nblocks(P);
    for (int64_t i = 0; i < P; ++i) {
      const int64_t n = off[i + 1] - off[i];
      nb[i] = block_rows(n);
      nblocks[i] = (n + nb[i] - 1) / nb[i];
    }
    const int64_t T = std::max<int64_t>(1, at::get_num_threads());
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t i = 0; i < P; ++i) {
          const int64_t b0 = nblocks[i] * t / T, b1 = nblocks[i] * (t + 1) / T;
          if (b0 < b1)
            info[i]->run_blocks(acts[i], 1, blocks[i].data_ptr<uint8_t>(), off[i + 1] - off[i],
                                nb[i], b0, b1, yp + off[i]);
        }
    });
  } else if (M > 0 && P == 1) {
    info[0]->run(x, blocks[0].data_ptr<uint8_t>(), N, yp);
  } else if (M > 0) {  // each part in turn, then into its columns
    for (int64_t i = 0; i < P; ++i) {
      const int64_t n = off[i + 1] - off[i];
      at::Tensor part = at::empty({M, n}, y.options());
      info[i]->run(x, blocks[i].data_ptr<uint8_t>(), n, part.data_ptr<float>());
      y.narrow(1, off[i], n).copy_(part);
    }
  }
  if (!out_x_dtype || x.scalar_type() == at::kFloat) return y;
  if (M != 1) return y.to(x.scalar_type());
  at::Tensor out = at::empty({1, N}, x.options());  // one row: rounded here, no op call
  auto* o = out.data_ptr<c10::BFloat16>();
  for (int64_t c = 0; c < N; ++c) o[c] = c10::BFloat16(yp[c]);
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
  m.def("ggml_matmul_parts(Tensor x, Tensor[] blocks, str[] ggml_types, bool out_x_dtype) "
        "-> Tensor");
  m.def("ggml_dequant_rows(Tensor blocks, Tensor ids, str ggml_type, int k, ScalarType dtype) "
        "-> Tensor");
  m.def("ggml_kernel_types() -> str[]", &fitserve::ggml::ggml_kernel_types);
  m.def("ggml_blocks_tier() -> str", &fitserve::ggml::ggml_blocks_tier);
  m.def("ggml_blocks_amx_active() -> bool", &fitserve::ggml::ggml_blocks_amx_active);
  m.def("ggml_blocks_set_amx(bool on) -> bool", &fitserve::ggml::ggml_blocks_set_amx);
}

TORCH_LIBRARY_IMPL(fitserve, CPU, m) {
  m.impl("ggml_matmul", &fitserve::ggml::ggml_matmul);
  m.impl("ggml_matmul_parts", &fitserve::ggml::ggml_matmul_parts);
  m.impl("ggml_dequant_rows", &fitserve::ggml::ggml_dequant_rows);
}
