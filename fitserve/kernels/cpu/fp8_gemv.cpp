// fitserve_fp8::fp8_linear: y = x @ W^T (+ bias) for a few rows of x and an fp8 weight W whose
// codes (e4m3fn or e5m2, one byte each) are read once and converted in registers.
//
//   x [M, K] float32 / bfloat16 / float16    codes [N, K] uint8    y [M, N] in x's dtype
//   granularity "tensor": scales [1]; "channel": scales [N]; "block": scales [ceil(N/B), ceil(K/B)]
//
// Conversion, exact for every code (subnormals and zero included): a code becomes the float16
// with the same sign/exponent/mantissa bits (e5m2 is float16's top byte; e4m3 sits in float16's
// layout with a 2^-8 offset from the bias difference 15 - 7, folded into the scale), then
// VCVTPH2PS (F16C) widens 16 (AVX-512) or 8 (AVX2) of them to fp32; the scalar tier reads a
// 256-entry table of the same values. e4m3fn's NaN codes (0x7F, 0xFF) decode to NaN, as
// torch's float8_e4m3fn cast does, so a NaN code makes its output channel NaN; e5m2's inf/NaN
// codes are float16's own.
//
// With bf16 x on a CPU with AVX512-BF16 and VBMI, whole 64-column blocks instead take the
// lookup path of fp8_gemv_lookup.h (codes -> bf16 by two byte permutes, VDPBF16PS).
// Sums are fp32 (exact products: 4 or 3 significant bits times x's 24 or 8), the scale applied
// once per output (per segment of B columns for block scales), the bias added in fp32, one
// rounding to x's dtype. Each converted weight vector is reused
// across up to 8 rows of x; N is split over torch's threads (each output is one thread's).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "fp8_gemv_lookup.h"
#include "fp8_gemv_simd.h"
#include "row_runs.h"
#include "stream_prefetch.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace fp8_gemv;

struct Problem {
  const float* x;       // [M, K] fp32
  const uint16_t* xp;   // [M, K] bf16 bits in the lookup path's order, or nullptr
  const uint8_t* w;     // [N, K]
  const float* scales;  // as granularity says
  const float* bias;    // [N] fp32 or nullptr
  void* y;              // [M, N] in y_type
  at::ScalarType y_type;
  int64_t M, N, K;
  int gran;             // 0 tensor, 1 channel, 2 block
  int64_t block;
};

inline void store(const Problem& p, int64_t i, float v) {  // one rounding, nearest even
  if (p.y_type == at::kFloat) static_cast<float*>(p.y)[i] = v;
  else if (p.y_type == at::kBFloat16) static_cast<c10::BFloat16*>(p.y)[i] = c10::BFloat16(v);
  else static_cast<c10::Half*>(p.y)[i] = c10::Half(v);
}

// sums[m] = the dot of rows m0..m0+MB of x with W's row w over [k0, k1)
template <int MB, bool E5M2>
inline void segment_dot(const Problem& p, const uint8_t* w, int64_t m0, int64_t k0, int64_t k1,
                        float* sums) {
  int64_t kl = k0;
#if defined(FP8_GEMV_LOOKUP)
  if (p.xp) {
    static const LookupTables tables = make_lookup_tables(table(E5M2), kFactor[E5M2]);
    kl = k0 + (k1 - k0) / 64 * 64;
    for (int m = 0; m < MB; ++m) sums[m] = 0.f;
    if (kl > k0) rows_dot_lookup<MB>(w, p.xp + m0 * p.K, p.K, k0, kl, tables, sums);
    if (kl == k1) return;
  }
#endif
  float rest[MB];
  rows_dot<MB, E5M2>(w, p.x + m0 * p.K, p.K, kl, k1, rest);
  for (int m = 0; m < MB; ++m) sums[m] = kl > k0 ? sums[m] + rest[m] : rest[m];
}

// Output n for rows m0..m0+MB of x (every path of an output runs this: its bits never depend
// on M, the tile or the thread split).
template <int MB, bool E5M2>
inline void run_row(const Problem& p, int64_t m0, int64_t n) {
  const int64_t seg = p.gran == 2 ? p.block : p.K;
  const int64_t kb = p.gran == 2 ? (p.K + p.block - 1) / p.block : 1;
  float sums[MB], tot[MB];
  const uint8_t* w = p.w + n * p.K;
  for (int m = 0; m < MB; ++m) tot[m] = 0.f;
  for (int64_t b = 0; b < kb; ++b) {
    segment_dot<MB, E5M2>(p, w, m0, b * seg, std::min(p.K, (b + 1) * seg), sums);
    const float s = p.gran == 0   ? p.scales[0]
                    : p.gran == 1 ? p.scales[n]
                                  : p.scales[(n / p.block) * kb + b];
    for (int m = 0; m < MB; ++m) tot[m] += s * sums[m];
  }
  const float bn = p.bias ? p.bias[n] : 0.f;
  for (int m = 0; m < MB; ++m) store(p, (m0 + m) * p.N + n, tot[m] + bn);
}

// Every code of W's row n requested from memory ahead of its use (one hint per 64 B line).
inline void prefetch_row(const Problem& p, int64_t n) {
  const uint8_t* r = p.w + n * p.K;
  for (int64_t o = 0; o < p.K; o += 64) fitserve::prefetch_stream(r + o);
}

template <int MB, bool E5M2>
void run_rows(const Problem& p, int64_t m0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) run_row<MB, E5M2>(p, m0, n);
}

// NOTE: the few-rows case streams W from DRAM once per call, a thread's rows in runs taken in
// turn (row_runs.h), each row requested `ahead` rows (>= 4 KB) before its turn (software
// prefetch of the whole row). Single thread, 2048 x 2048 codes rotated through 256 MiB, Zen 5:
// 17 GB/s with no hint, 30 with the next-but-one row prefetched, 37 with two runs (a plain
// read: 41); benchmarks/bench_dequant_cost.py --stream.
constexpr int64_t kStreamedRowMax = 4096;  // bytes of a row for run_rows_streamed

#if defined(FP8_GEMV_LOOKUP)
// Whether run_row<1> of four rows can go through rows_dot_lookup4: one row of x on the lookup
// path, whole 64-code steps and one scale per row (the block-scaled rows keep run_row).
inline bool four_rows_apply(const Problem& p) { return p.xp && p.gran != 2 && p.K % 64 == 0; }

// run_row<1>(p, 0, n) of the rows ns[0..3], with its bits (the same sum, scale, bias, store).
template <bool E5M2>
FP8_VBMI void run_row4(const Problem& p, const int64_t* ns) {
  static const LookupTables tables = make_lookup_tables(table(E5M2), kFactor[E5M2]);
  const uint8_t* w[4] = {p.w + ns[0] * p.K, p.w + ns[1] * p.K, p.w + ns[2] * p.K,
                         p.w + ns[3] * p.K};
  float sums[4];
  rows_dot_lookup4(w, p.xp, 0, p.K, tables, sums);
  for (int r = 0; r < 4; ++r) {
    const float s = p.gran == 0 ? p.scales[0] : p.scales[ns[r]];
    const float tot = 0.f + s * sums[r];
    store(p, ns[r], tot + (p.bias ? p.bias[ns[r]] : 0.f));
  }
}
#endif

template <int MB, bool E5M2>
void run_rows_streamed(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t ahead = std::clamp<int64_t>(4096 / std::max<int64_t>(1, p.K), 2, 16);
  const auto prefetch = [&](int64_t n) { prefetch_row(p, n); };
  const auto row = [&](int64_t n) { run_row<MB, E5M2>(p, 0, n); };
#if defined(FP8_GEMV_LOOKUP)
  if (MB == 1 && four_rows_apply(p)) {
    fitserve::rows_in_runs(n0, n1, ahead, prefetch, row,
                           [&](const int64_t* ns) { run_row4<E5M2>(p, ns); });
    return;
  }
#endif
  fitserve::rows_in_runs(n0, n1, ahead, prefetch, row);
}

template <bool E5M2>
void run_group(const Problem& p, int64_t m0, int64_t rows, int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: return run_rows<1, E5M2>(p, m0, n0, n1);
    case 2: return run_rows<2, E5M2>(p, m0, n0, n1);
    case 3: return run_rows<3, E5M2>(p, m0, n0, n1);
    case 4: return run_rows<4, E5M2>(p, m0, n0, n1);
    case 5: return run_rows<5, E5M2>(p, m0, n0, n1);
    case 6: return run_rows<6, E5M2>(p, m0, n0, n1);
    case 7: return run_rows<7, E5M2>(p, m0, n0, n1);
    default: return run_rows<8, E5M2>(p, m0, n0, n1);
  }
}

template <bool E5M2>
void run_streamed(const Problem& p, int64_t rows, int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: return run_rows_streamed<1, E5M2>(p, n0, n1);
    case 2: return run_rows_streamed<2, E5M2>(p, n0, n1);
    case 3: return run_rows_streamed<3, E5M2>(p, n0, n1);
    case 4: return run_rows_streamed<4, E5M2>(p, n0, n1);
    case 5: return run_rows_streamed<5, E5M2>(p, n0, n1);
    case 6: return run_rows_streamed<6, E5M2>(p, n0, n1);
    case 7: return run_rows_streamed<7, E5M2>(p, n0, n1);
    default: return run_rows_streamed<8, E5M2>(p, n0, n1);
  }
}

int granularity_code(const std::string& g) {
  if (g == "tensor") return 0;
  if (g == "channel") return 1;
  if (g == "block") return 2;
  TORCH_CHECK(false, "fp8_linear: granularity must be tensor, channel or block, got ", g);
}

// x (any float dtype) -> a thread-local fp32 [M, K] copy
const float* x_as_float(const at::Tensor& xc, std::vector<float>& buf) {
  const int64_t n = xc.numel();
  buf.resize(n);
  if (xc.scalar_type() == at::kFloat) {
    std::memcpy(buf.data(), xc.data_ptr<float>(), n * sizeof(float));
  } else if (xc.scalar_type() == at::kBFloat16) {
    const auto* s = xc.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(s[i]);
  } else {
    const auto* s = xc.data_ptr<c10::Half>();
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(s[i]);
  }
  return buf.data();
}

void check_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                int gran, int64_t block) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
              "fp8_linear: CPU tensors only");
  const auto xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf,
              "fp8_linear: x must be float32, bfloat16 or float16, got ", xt);
  TORCH_CHECK(x.dim() == 2, "fp8_linear: x must be [M, K]");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == x.size(1),
              "fp8_linear: codes must be a contiguous uint8 [N, K] with x's K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "fp8_linear: scales must be contiguous float32");
  const int64_t N = codes.size(0), K = codes.size(1);
  if (gran == 0) TORCH_CHECK(scales.numel() == 1, "fp8_linear: tensor scales must be [1]");
  if (gran == 1) TORCH_CHECK(scales.numel() == N, "fp8_linear: channel scales must be [N]");
  if (gran == 2) {
    TORCH_CHECK(block > 0, "fp8_linear: block must be positive, got ", block);
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == (N + block - 1) / block &&
                    scales.size(1) == (K + block - 1) / block,
                "fp8_linear: block scales must be [ceil(N / block), ceil(K / block)]");
  }
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const std::string& fmt, const std::string& granularity, int64_t block,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(fmt == "e4m3" || fmt == "e5m2", "fp8_linear: fmt must be e4m3 or e5m2, got ", fmt);
  const bool e5m2 = fmt == "e5m2";
  const int gran = granularity_code(granularity);
  check_args(x, codes, scales, gran, block);
  const int64_t M = x.size(0), N = codes.size(0), K = codes.size(1);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "fp8_linear: bias must have N elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  static thread_local std::vector<float> xbuf;
  static thread_local std::vector<uint16_t> xpbuf;
  at::Tensor out = at::empty({M, N}, x.options());
  const at::Tensor xc = x.contiguous();
  Problem p{x_as_float(xc, xbuf), nullptr, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
            bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, out.data_ptr(),
            x.scalar_type(), M, N, K, gran, block};
#if defined(FP8_GEMV_LOOKUP)
  // NOTE: bf16 x only (its products with bf16 codes are exact); block scales need whole
  // 64-column blocks per scale segment.
  if (xc.scalar_type() == at::kBFloat16 && lookup_supported() && K >= 64 &&
      (gran != 2 || block % 64 == 0)) {
    xpbuf.resize(M * K);
    permute_x(reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()), xpbuf.data(), M,
              K);
    p.xp = xpbuf.data();
  }
#endif
  // a tile of W rows (~16 KB) is converted once per group of <= 8 x rows while it sits in L1
  const int64_t tile = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, K));
  at::parallel_for(0, N, tile, [&](int64_t n0, int64_t n1) {
    // one group of x rows and rows of <= 4 KB: W streamed once (run_rows_streamed). NOTE:
    // 8 KB rows (K = 8192) streamed worse so (14 vs 16 GB/s: a 128-line burst per row)
    if (M <= kMaxRows && K <= kStreamedRowMax) {
      if (e5m2) run_streamed<true>(p, M, n0, n1);
      else run_streamed<false>(p, M, n0, n1);
      return;
    }
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
        if (e5m2) run_group<true>(p, m0, rows, t0, t1);
        else run_group<false>(p, m0, rows, t0, t1);
      }
    }
  });
  return out;
}

// whether bf16 x takes the lookup path (AVX512-BF16 built in, VBMI on this CPU)
bool lookup_path() {
#if defined(FP8_GEMV_LOOKUP)
  return lookup_supported();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(fitserve_fp8, m) {
  m.def("fp8_linear(Tensor x, Tensor codes, Tensor scales, str fmt, str granularity, int block, "
        "Tensor? bias) -> Tensor");
  m.def("lookup_path() -> bool", &lookup_path);
}

TORCH_LIBRARY_IMPL(fitserve_fp8, CPU, m) { m.impl("fp8_linear", &fp8_linear); }
