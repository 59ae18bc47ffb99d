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
// with f the codec's factor (kv_codes.h). Each tile's code rows are widened in registers into
// L1-resident fp32 rows (kTile x D floats) once for the G query heads of the KV head.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "paged_attention_simd.h"
#include "kv_codes.h"
#include "kvq_tile_ops.h"

namespace {

struct QGeometry {
  int64_t num_kv, group, head_dim, dpad, block_size, max_blocks, partition, window;
  int64_t q_stride_b, q_stride_h, out_stride_b;
  int64_t kc_h, kc_blk, kc_tok, vc_h, vc_blk, vc_tok;  // code strides (elements = bytes)
  int64_t ks_h, ks_blk, ks_in;  // K scales: [h, block, token or channel]
  int64_t vs_h, vs_blk, vs_tok;
  float q_scale;   // softmax scale x the codec factor, folded into q
  float v_factor;  // the codec factor, folded into p
  bool channel_keys;
};

// Per-thread scratch, sized for the largest (group, dpad) seen; every item overwrites it.
struct QScratch {
  std::vector<float> q, qb, k, v, s, p, acc, m, l, ks, vs;
  std::vector<const float*> krow, vrow;
  std::vector<int64_t> seg_first, seg_page;
  int64_t g_cap = 0, d_cap = 0;
  void reserve(int64_t g, int64_t dpad) {
    if (g <= g_cap && dpad <= d_cap) return;
    g_cap = std::max(g, g_cap);
    d_cap = std::max(dpad, d_cap);
    q.assign(g_cap * d_cap, 0.f);
    acc.assign(g_cap * d_cap, 0.f);
    qb.assign(d_cap, 0.f);
    k.assign(kTile * d_cap, 0.f);
    v.assign(kTile * d_cap, 0.f);
    s.assign(g_cap * kTile, 0.f);
    p.assign(kTile, 0.f);
    m.assign(g_cap, 0.f);
    l.assign(g_cap, 0.f);
    ks.assign(kTile, 0.f);
    vs.assign(kTile, 0.f);
    seg_first.assign(kTile + 1, 0);
    seg_page.assign(kTile + 1, 0);
    krow.resize(kTile);
    vrow.resize(kTile);
  }
};

inline QScratch& thread_scratch(int64_t g, int64_t dpad) {
  thread_local QScratch w;
  w.reserve(g, dpad);
  for (int64_t i = 0; i < kTile; ++i) {  // rows of the tile buffers at this dpad
    w.krow[i] = w.k.data() + i * dpad;
    w.vrow[i] = w.v.data() + i * dpad;
  }
  return w;
}

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }

inline void prefetch_codes(const QGeometry& g, const uint8_t* kh, const uint8_t* vh,
                           const int32_t* table, int64_t t_from, int64_t t_to) {
  for (int64_t t = t_from; t < t_to; ++t) {
    const int64_t page = table[t / g.block_size], off = t % g.block_size;
    const uint8_t* kr = kh + page * g.kc_blk + off * g.kc_tok;
    const uint8_t* vr = vh + page * g.vc_blk + off * g.vc_tok;
    for (int64_t byte = 0; byte < g.head_dim; byte += 64) {
      __builtin_prefetch(kr + byte, 0, 3);
      __builtin_prefetch(vr + byte, 0, 3);
    }
  }
}

// Keys [t0, t0 + n) of the item into the tile buffers: widened rows, V's folded scales, K's
// per-token scales, and (per-channel K) the runs of keys that share a block.
inline int64_t load_tile(const QGeometry& g, const TileOps& ops, const uint8_t* kh,
                         const uint8_t* vh, const float* ksh, const float* vsh,
                         const int32_t* table, int64_t t0, int64_t n, QScratch& w) {
  int64_t blk = t0 / g.block_size, off = t0 % g.block_size, nseg = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t page = table[blk];
    if (i == 0 || off == 0) {
      w.seg_first[nseg] = i;
      w.seg_page[nseg++] = page;
    }
    ops.to_float(kh + page * g.kc_blk + off * g.kc_tok, w.k.data() + i * g.dpad, g.head_dim, g.dpad);
    ops.to_float(vh + page * g.vc_blk + off * g.vc_tok, w.v.data() + i * g.dpad, g.head_dim, g.dpad);
    w.vs[i] = vsh[page * g.vs_blk + off * g.vs_tok] * g.v_factor;
    if (!g.channel_keys) w.ks[i] = ksh[page * g.ks_blk + off * g.ks_in];
    if (++off == g.block_size) {
      off = 0;
      ++blk;
    }
  }
  w.seg_first[nseg] = n;
  return nseg;
}

// One work item: keys [t_begin, t_end) of sequence b for KV head kvh; leaves (acc, m, l) in w.
template <typename QT>
void attend(const QGeometry& g, const TileOps& ops, const QT* q, const uint8_t* kc,
            const uint8_t* vc, const float* ksc, const float* vsc, const int32_t* table,
            int64_t b, int64_t kvh, int64_t t_begin, int64_t t_end, QScratch& w) {
  const int64_t d = g.head_dim, dp = g.dpad;
  for (int64_t h = 0; h < g.group; ++h) {
    const QT* qr = q + b * g.q_stride_b + (kvh * g.group + h) * g.q_stride_h;
    float* qf = w.q.data() + h * dp;
    for (int64_t c = 0; c < d; ++c) qf[c] = to_f(qr[c]) * g.q_scale;
    std::fill(qf + d, qf + dp, 0.f);
    std::fill(w.acc.data() + h * dp, w.acc.data() + (h + 1) * dp, 0.f);
    w.m[h] = kNegInf;
    w.l[h] = 0.f;
  }
  const uint8_t* kh = kc + kvh * g.kc_h;
  const uint8_t* vh = vc + kvh * g.vc_h;
  const float* ksh = ksc + kvh * g.ks_h;
  const float* vsh = vsc + kvh * g.vs_h;
  prefetch_codes(g, kh, vh, table, t_begin, std::min(t_begin + kTile, t_end));
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    const int64_t n = std::min(kTile, t_end - t0);
    prefetch_codes(g, kh, vh, table, t0 + n, std::min(t0 + n + kTile, t_end));
    const int64_t nseg = load_tile(g, ops, kh, vh, ksh, vsh, table, t0, n, w);
    for (int64_t h = 0; h < g.group; ++h) {
      float* s = w.s.data() + h * kTile;
      float* acc = w.acc.data() + h * dp;
      const float* qf = w.q.data() + h * dp;
      if (g.channel_keys) {
        for (int64_t sg = 0; sg < nseg; ++sg) {  // q' = q (.) the block's channel scales
          const float* kscale = ksh + w.seg_page[sg] * g.ks_blk;
          for (int64_t c = 0; c < d; ++c) w.qb[c] = qf[c] * kscale[c * g.ks_in];
          const int64_t i0 = w.seg_first[sg];
          ops.scores(w.qb.data(), w.krow.data() + i0, w.seg_first[sg + 1] - i0, d, s + i0);
        }
      } else {
        ops.scores(qf, w.krow.data(), n, d, s);
        for (int64_t i = 0; i < n; ++i) s[i] *= w.ks[i];
      }
      ops.softmax(s, n, &w.m[h], &w.l[h], acc, dp);
      for (int64_t i = 0; i < n; ++i) w.p[i] = s[i] * w.vs[i];
      ops.pv(acc, w.p.data(), w.vrow.data(), n, d);
    }
  }
}

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
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = item_seq[it], local = it - item_start[b];
      const int64_t kvh = local / num_parts[b], p = first_part[b] + local % num_parts[b];
      int64_t t0 = 0, t1 = 0;
      partition_range(g, lens[b], p, &t0, &t1);
      attend<QT>(g, ops, qp, kp, vp, ksp, vsp, tp + b * g.max_blocks, b, kvh, t0, t1, w);
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
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  const at::Tensor lens_t = seq_lens.to(at::kLong).contiguous();
  std::vector<int64_t> lens(lens_t.data_ptr<int64_t>(), lens_t.data_ptr<int64_t>() + num_seqs);
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
