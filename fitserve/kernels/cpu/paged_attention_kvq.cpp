// Fused paged decode attention over a quantized KV cache (fitserve/quant/kv_cache.py): K and V
// are one-byte codes (int8, fp8 e4m3fn, fp8 e5m2) read in place through the block table with
// their float32 scales; no dequantized copy of the cache is made. The work split (items of
// sequence x KV head x fixed partition of absolute positions, exact merge), the online softmax
// and the fp32 tile pieces are those of paged_attention.cpp (shared: paged_attention_simd.h).
//
// Layout, per layer (head-major like the dense cache):
//   k_codes, v_codes [Hkv, num_blocks, block_size, D]   int8 (int8) or uint8 (fp8 bits)
//   v_scales         [Hkv, num_blocks, block_size]      one per token
//   k_scales         [Hkv, num_blocks, block_size]      per token           (channel_keys=false)
//                    [Hkv, num_blocks, D]               per block, per channel (channel_keys=true)
//
// The scales are folded into the products, never into the codes:
//   per-token K:    s_j = (scale * f * q) . raw(k_j)  *  ks_j
//   per-channel K:  s_j = (scale * f * q (.) ks_blk) . raw(k_j)   (q' made once per block run)
//   V (per token):  acc += (p_j * vs_j * f) * raw(v_j);   l sums the unscaled p_j
// with f the codec's factor (kv_codes.h). On AVX-512 each tile's code rows are widened in
// registers once for the G query heads of the KV head and used there (kvq_group_avx512.h);
// elsewhere they are widened into L1-resident fp32 rows (kTile x D floats) first.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "line_queue.h"
#include "paged_attention_simd.h"
#include "kv_codes.h"
#include "kvq_group_avx512.h"
#include "kvq_tile_ops.h"
#include "kvq_item.h"

namespace {

inline void partition_range(const QGeometry& g, int64_t L, int64_t p, int64_t* first,
                            int64_t* last) {
  const int64_t lo = g.window > 0 ? std::max<int64_t>(0, L - g.window) : 0;
  *first = std::max(lo, p * g.partition);
  *last = std::min(L, (p + 1) * g.partition);
}

// Items (b, h, p) in sequence order, each sequence's contiguous; the exact merge of partitions
// as in paged_attention.cpp (so the result does not depend on the batch or thread count).
template <typename QT>
void run(const QGeometry& g, const TileOps& ops, const at::Tensor& q, const at::Tensor& kc,
         const at::Tensor& vc, const at::Tensor& ks, const at::Tensor& vs,
         const at::Tensor& tables, const std::vector<int64_t>& lens, at::Tensor& out) {
  const int64_t num_seqs = static_cast<int64_t>(lens.size());
  std::vector<int64_t> first_part(num_seqs), num_parts(num_seqs), item_start(num_seqs + 1, 0);
  bool any_split = false;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t L = lens[b];
    const int64_t lo = g.window > 0 ? std::max<int64_t>(0, L - g.window) : 0;
    first_part[b] = lo / g.partition;
    num_parts[b] = L > lo ? (L - 1) / g.partition - first_part[b] + 1 : 0;
    item_start[b + 1] = item_start[b] + num_parts[b] * g.num_kv;
    any_split |= num_parts[b] > 1;
  }
  const int64_t num_items = item_start[num_seqs];
  const int64_t part_stride = g.group * (g.dpad + 2);  // acc [G, dpad], then G maxima, G sums
  std::unique_ptr<float[]> partial(any_split ? new float[num_items * part_stride] : nullptr);
  std::vector<int64_t> item_seq(num_items);
  for (int64_t b = 0; b < num_seqs; ++b)
    std::fill(item_seq.begin() + item_start[b], item_seq.begin() + item_start[b + 1], b);
  const QT* qp = q.data_ptr<QT>();
  const uint8_t* kp = static_cast<const uint8_t*>(kc.data_ptr());
  const uint8_t* vp = static_cast<const uint8_t*>(vc.data_ptr());
  const float* ksp = ks.data_ptr<float>();
  const float* vsp = vs.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  QT* op = out.data_ptr<QT>();
  const int64_t d = g.head_dim;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    QScratch& w = thread_scratch(g.group, g.dpad);
    auto locate = [&](int64_t it, int64_t* b, int64_t* kvh, int64_t* t0, int64_t* t1) {
      *b = item_seq[it];
      const int64_t local = it - item_start[*b];
      *kvh = local / num_parts[*b];
      partition_range(g, lens[*b], first_part[*b] + local % num_parts[*b], t0, t1);
    };
    for (int64_t it = begin; it < end; ++it) {
      int64_t b = 0, kvh = 0, t0 = 0, t1 = 0;
      locate(it, &b, &kvh, &t0, &t1);
      NextTile next;
      if (it + 1 < end) {
        int64_t nb = 0, nh = 0, n0 = 0, n1 = 0;
        locate(it + 1, &nb, &nh, &n0, &n1);
        next = {kp + nh * g.kc_h, vp + nh * g.vc_h, ksp + nh * g.ks_h, vsp + nh * g.vs_h,
                tp + nb * g.max_blocks, n0, std::min(n0 + kTile, n1)};
      }
      attend<QT>(g, ops, qp, kp, vp, ksp, vsp, tp + b * g.max_blocks, b, kvh, t0, t1, w,
                 it > begin, next);
      if (num_parts[b] == 1) {
        for (int64_t h = 0; h < g.group; ++h) {
          QT* o = op + b * g.out_stride_b + (kvh * g.group + h) * d;
          const float inv = 1.f / w.l[h];
          const float* acc = w.acc.data() + h * g.dpad;
          for (int64_t c = 0; c < d; ++c) o[c] = static_cast<QT>(acc[c] * inv);
        }
      } else {
        float* dst = partial.get() + it * part_stride;
        std::copy_n(w.acc.begin(), g.group * g.dpad, dst);
        std::copy_n(w.m.begin(), g.group, dst + g.group * g.dpad);
        std::copy_n(w.l.begin(), g.group, dst + g.group * g.dpad + g.group);
      }
    }
  });
  for (int64_t b = 0; b < num_seqs; ++b)
    if (num_parts[b] == 0) out[b].zero_();  // no visible key: zeros
  if (!any_split) return;
  // NOTE: the merge is a few floats per partition: on the calling thread (see paged_attention.cpp)
  std::vector<float> acc(g.dpad);
  for (int64_t bh = 0; bh < num_seqs * g.num_kv; ++bh) {
    const int64_t b = bh / g.num_kv, kvh = bh % g.num_kv, np = num_parts[b];
    if (np <= 1) continue;
    const float* base = partial.get() + (item_start[b] + kvh * np) * part_stride;
    for (int64_t h = 0; h < g.group; ++h) {
      float mx = kNegInf;
      for (int64_t p = 0; p < np; ++p) mx = std::max(mx, base[p * part_stride + g.group * g.dpad + h]);
      std::fill(acc.begin(), acc.end(), 0.f);
      float den = 0.f;
      for (int64_t p = 0; p < np; ++p) {
        const float* part = base + p * part_stride;
        const float wgt = std::exp(part[g.group * g.dpad + h] - mx);
        den += wgt * part[g.group * g.dpad + g.group + h];
        for (int64_t c = 0; c < d; ++c) acc[c] += wgt * part[h * g.dpad + c];
      }
      QT* o = op + b * g.out_stride_b + (kvh * g.group + h) * d;
      for (int64_t c = 0; c < d; ++c) o[c] = static_cast<QT>(acc[c] / den);
    }
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& ks, const at::Tensor& vs, int64_t codec, bool channel_keys) {
  TORCH_CHECK(q.device().is_cpu() && kc.device().is_cpu() && vc.device().is_cpu() &&
                  ks.device().is_cpu() && vs.device().is_cpu(),
              "paged_decode_attention_kvq: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [num_seqs, num_heads, head_dim], head_dim contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
                  q.scalar_type() == at::kHalf, "q must be float32, bfloat16 or float16");
  TORCH_CHECK(codec == kInt8 || codec == kE4M3 || codec == kE5M2,
              "codec must be 0 (int8), 1 (fp8 e4m3fn) or 2 (fp8 e5m2), got ", codec);
  const auto want = codec == kInt8 ? at::kChar : at::kByte;
  TORCH_CHECK(kc.scalar_type() == want && vc.scalar_type() == want,
              "codes must be ", codec == kInt8 ? "int8 for the int8 codec" : "uint8 (fp8 bits)");
  TORCH_CHECK(kc.dim() == 4 && vc.sizes() == kc.sizes() && kc.stride(3) == 1 && vc.stride(3) == 1,
              "k_codes and v_codes must both be [num_kv_heads, num_blocks, block_size, head_dim], "
              "head_dim contiguous");
  TORCH_CHECK(kc.size(3) == q.size(2), "the codes' head_dim differs from q's");
  TORCH_CHECK(ks.scalar_type() == at::kFloat && vs.scalar_type() == at::kFloat,
              "k_scales and v_scales must be float32");
  const int64_t h = kc.size(0), nb = kc.size(1), bs = kc.size(2), d = kc.size(3);
  TORCH_CHECK(vs.dim() == 3 && vs.size(0) == h && vs.size(1) == nb && vs.size(2) == bs,
              "v_scales must be [num_kv_heads, num_blocks, block_size]");
  TORCH_CHECK(ks.dim() == 3 && ks.size(0) == h && ks.size(1) == nb &&
                  ks.size(2) == (channel_keys ? d : bs),
              channel_keys ? "per-channel k_scales must be [num_kv_heads, num_blocks, head_dim]"
                           : "per-token k_scales must be [num_kv_heads, num_blocks, block_size]");
  TORCH_CHECK(h > 0 && q.size(1) % h == 0, "num_heads must be a multiple of num_kv_heads");
}

at::Tensor paged_decode_attention_kvq(const at::Tensor& q, const at::Tensor& k_codes,
                                      const at::Tensor& v_codes, const at::Tensor& k_scales,
                                      const at::Tensor& v_scales, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, double scale, int64_t window,
                                      int64_t codec, bool channel_keys, int64_t partition_size,
                                      bool vectorized) {
  check_inputs(q, k_codes, v_codes, k_scales, v_scales, codec, channel_keys);
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 && block_tables.size(0) == q.size(0) &&
                  seq_lens.size(0) == q.size(0),
              "block_tables [num_seqs, max_blocks] and seq_lens [num_seqs] must match q");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt || seq_lens.scalar_type() == at::kLong,
              "seq_lens must be int32 or int64");
  TORCH_CHECK(partition_size > 0, "partition_size must be positive");
  const int64_t num_seqs = q.size(0), block_size = k_codes.size(2), num_blocks = k_codes.size(1);
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();  // no-op for int32 input
  // NOTE: int32 lengths (the engine's) read as they are: a .to(kLong) was a tensor allocated
  // and copied per layer call, which the dense kernel does not pay
  const at::Tensor lens_t = seq_lens.contiguous();
  std::vector<int64_t> lens(num_seqs);
  for (int64_t b = 0; b < num_seqs; ++b)
    lens[b] = seq_lens.scalar_type() == at::kInt ? lens_t.data_ptr<int32_t>()[b]
                                                 : lens_t.data_ptr<int64_t>()[b];
  const int64_t max_blocks = tables.size(1);
  const int32_t* tp = tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < num_seqs; ++b) {  // never read outside the cache
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_blocks * block_size, "seq_lens[", b, "] = ",
                lens[b], " exceeds its block table");
    const int64_t lo = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    for (int64_t j = lo / block_size; j * block_size < lens[b]; ++j) {
      const int32_t page = tp[b * max_blocks + j];
      TORCH_CHECK(page >= 0 && page < num_blocks, "block_tables[", b, ", ", j, "] = ", page,
                  " is not a block of the cache");
    }
  }
  at::Tensor out = at::empty({num_seqs, q.size(1), q.size(2)}, q.options());
  if (num_seqs == 0) return out;
  QGeometry g{};
  g.num_kv = k_codes.size(0);
  g.group = q.size(1) / g.num_kv;
  g.head_dim = q.size(2);
  g.dpad = (g.head_dim + kLanes - 1) / kLanes * kLanes;
  g.block_size = block_size;
  g.max_blocks = max_blocks;
  g.partition = partition_size;
  g.window = window;
  g.q_stride_b = q.stride(0);
  g.q_stride_h = q.stride(1);
  g.out_stride_b = q.size(1) * q.size(2);
  g.kc_h = k_codes.stride(0), g.kc_blk = k_codes.stride(1), g.kc_tok = k_codes.stride(2);
  g.vc_h = v_codes.stride(0), g.vc_blk = v_codes.stride(1), g.vc_tok = v_codes.stride(2);
  g.ks_h = k_scales.stride(0), g.ks_blk = k_scales.stride(1), g.ks_in = k_scales.stride(2);
  g.vs_h = v_scales.stride(0), g.vs_blk = v_scales.stride(1), g.vs_tok = v_scales.stride(2);
  g.q_scale = static_cast<float>(scale) * code_factor(static_cast<int>(codec));
  g.v_factor = code_factor(static_cast<int>(codec));
  g.channel_keys = channel_keys;
  const TileOps ops = pick_tile_ops(static_cast<int>(codec), g.head_dim, vectorized);
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(g, ops, q, k_codes, v_codes, k_scales, v_scales, tables, lens, out); break;
    case at::kBFloat16:
      run<c10::BFloat16>(g, ops, q, k_codes, v_codes, k_scales, v_scales, tables, lens, out);
      break;
    default: run<c10::Half>(g, ops, q, k_codes, v_codes, k_scales, v_scales, tables, lens, out);
  }
  return out;
}

std::string paged_attention_kvq_isa() {
#if FS_AVX512
  return "avx512";
#elif FS_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fitserve, m) {
  m.def(
      "paged_decode_attention_kvq(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_scales, "
      "Tensor v_scales, Tensor block_tables, Tensor seq_lens, float scale, int window, int codec, "
      "bool channel_keys, int partition_size=256, bool vectorized=True) -> Tensor");
  m.def("paged_attention_kvq_isa() -> str", &paged_attention_kvq_isa);
}

TORCH_LIBRARY_IMPL(fitserve, CPU, m) {
  m.impl("paged_decode_attention_kvq", &paged_decode_attention_kvq);
}
