"""`plan explain rope-fusion | bf16-sum | kv-quant-roads`: bytes a fusion saves and where
low-precision numbers lose accuracy.

rope-fusion: RoPE as eager ops (HF's ``q * cos + rotate_half(q) * sin``) moves, per element of
q or k (b bytes each) and per token-position of the cos/sin tables (c bytes):
    q * cos            read x + cos, write                          2 b (+ c per (t, i))
    rotate_half(x)     neg reads / writes half, cat reads / writes  3 b
    * sin              read + sin, write                            2 b (+ c per (t, i))
    add                read 2, write 1                              3 b
  = 10 b per element + 2 c per (token, dim); the fused kernel (``labs.counters.rope_counts``)
  reads x and an int32 position per token and writes x: 2 b per element + 4 B per token.
  Fusing the KV-cache write as well (fitserve's ``rope_write_kv_``) saves writing rotated k
  and reading it back for the cache copy: 2 b per k element more.

bf16-sum: a running sum held in bf16 (8 significant bits, unit roundoff u = 2^-8) rounds each
partial sum to 8 bits; once the sum S dwarfs the addends a, each add loses up to ulp(S) / 2 =
S x 2^-8, so the relative error grows ~ n x 2^-8 x a / S and the sum stalls when a < ulp(S) / 2.

kv-quant-roads: keys have a few outlier channels (fixed channels, large in every token): a
per-token scale is set by them and every other channel of that token is quantized with the
outliers' step; values have no such channels and vary by token. Hence keys per channel, values
per token (KIVI, KVQuant) - and per-channel key scales are per block per channel in a paged
cache, fixed only once the block is full.
"""

from __future__ import annotations

import argparse
import math
import random
import struct

from fitserve.ledger.units import fmt_bytes
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.sheets.explain_common import (
    line,
    model,
    model_name,
    opt_float,
    opt_int,
    opt_tokens,
    pct,
)
from fitserve.tools.sheets.sheet import Sheet

ROPE_FLAGS = ("model", "context")
SUM_FLAGS = ("threshold",)
ROADS_FLAGS = ("model", "kv_bits", "outlier_ratio", "block_size")
ACT = 2
TABLE = 4  # fitserve's cos/sin tables are fp32
POS = 4  # int32 position per token
SUM_MAX_N = 1 << 16
SCALE_BYTES = 2  # fp16 scale and fp16 zero point


def rope_eager_bytes(tokens: int, heads: int, d: int) -> int:
    """10 b per element of x + 2 table reads of c per (token, dim)."""
    return 10 * tokens * heads * d * ACT + 2 * tokens * d * TABLE


def rope_fused_bytes(tokens: int, heads: int, d: int) -> int:
    """As ``labs.counters.rope_counts``: read and write x (b each), an int32 per token."""
    return 2 * tokens * heads * d * ACT + tokens * POS


def build_rope(args: argparse.Namespace) -> Sheet:
    spec = model(args).spec
    t = opt_tokens(args, "context", 2048)
    d, h, hkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    rows: list[Line] = []
    total_e = total_f = 0
    for name, heads in (("q", h), ("k", hkv)):
        e, f = rope_eager_bytes(t, heads, d), rope_fused_bytes(t, heads, d)
        total_e, total_f = total_e + e, total_f + f
        rows += [
            line(f"{name}: eager bytes", "10 b T H d + 2 c T d", e, fmt_bytes(e),
                 f"10 x 2 x {t:,} x {heads} x {d} + 2 x 4 x {t:,} x {d} = {e:,} B"),
            line(f"{name}: fused bytes", "2 b T H d + 4 T", f, fmt_bytes(f),
                 f"2 x 2 x {t:,} x {heads} x {d} + 4 x {t:,} = {f:,} B"),
        ]
    kv_write = 2 * t * hkv * d * ACT
    layer = (total_e - total_f) + kv_write
    rows += [
        line("saved per layer by fused RoPE", "eager - fused (q and k)", total_e - total_f,
             f"{fmt_bytes(total_e - total_f)} ({total_e / total_f:.2f}x less traffic)",
             f"{total_e:,} - {total_f:,} = {total_e - total_f:,} B"),
        line("+ fusing the KV-cache write", "2 b T H_kv d", kv_write, fmt_bytes(kv_write),
             f"rotated k not written and read back: 2 x 2 x {t:,} x {hkv} x {d} = {kv_write:,} B"),
        line("saved per forward (all layers)", "layers x (RoPE saving + KV-write saving)",
             spec.num_layers * layer, fmt_bytes(spec.num_layers * layer),
             f"{spec.num_layers} x {layer:,} = {spec.num_layers * layer:,} B"),
    ]
    return Sheet(f"RoPE fusion: {model_name(model(args))}, {t:,} tokens",
                 (Section("Bytes per layer, eager vs fused", tuple(rows)),),
                 verdict=f"fused RoPE moves {total_e / total_f:.2f}x fewer bytes; "
                         f"{fmt_bytes(spec.num_layers * layer)} saved per {t:,}-token forward",
                 data={"eager": total_e, "fused": total_f, "saved_forward":
                       spec.num_layers * layer})


def to_bf16(x: float) -> float:
    """Round to bf16 (round to nearest, ties to even) through the fp32 bit pattern."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


def to_fp32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def sum_errors(n_max: int, seed: int = 0) -> tuple[list[float], list[float]]:
    """Relative errors after n = 1..n_max adds of bf16 values in U[0.5, 1.5): (bf16 running
    sum, fp32 running sum), each against the exact sum of the same bf16 values."""
    rng = random.Random(seed)
    s16 = s32 = exact = 0.0
    e16, e32 = [], []
    for _ in range(n_max):
        a = to_bf16(rng.uniform(0.5, 1.5))
        s16, s32, exact = to_bf16(s16 + a), to_fp32(s32 + a), exact + a
        e16.append(abs(s16 - exact) / exact)
        e32.append(abs(s32 - exact) / exact)
    return e16, e32


def bisect_crossing(err: list[float], tol: float) -> tuple[int | None, list[int]]:
    """The procedure: double n until err(n) > tol, then bisect (n/2, n]; returns the n found
    and the n it evaluated."""
    probes: list[int] = []
    lo, hi = 0, 1
    while True:
        probes.append(hi)
        if err[hi - 1] > tol:
            break
        if hi >= len(err):
            return None, probes
        lo, hi = hi, min(2 * hi, len(err))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probes.append(mid)
        lo, hi = (lo, mid) if err[mid - 1] > tol else (mid, hi)
    return hi, probes


def build_sum(args: argparse.Namespace) -> Sheet:
    tol = opt_float(args, "threshold", 0.01, max_value=1.0)
    e16, e32 = sum_errors(SUM_MAX_N)
    rows = [line(f"n = {n:,}", "|bf16 sum - exact| / exact (fp32 beside)", e16[n - 1],
                 f"bf16 {pct(e16[n - 1])}, fp32 {e32[n - 1]:.1e}",
                 f"n x 2^-8 = {n / 256:.3g}; bf16 ulp at S ~ {n:,} is "
                 f"{2.0 ** (math.floor(math.log2(n)) - 7):g}")
            for n in (2 ** k for k in range(4, 17))]
    found, probes = bisect_crossing(e16, tol)
    rows.append(line(f"first n with error > {tol:g} (bisection)", "double, then bisect",
                     found if found else "none", f"n = {found:,}" if found else "none",
                     f"evaluated n = {', '.join(f'{p:,}' for p in probes)}"))
    scan = next((i + 1 for i, e in enumerate(e16) if e > tol), None)
    rows.append(line(f"first n with error > {tol:g} (full scan)", "min n: err(n) > tol",
                     scan if scan else "none", f"n = {scan:,}" if scan else "none",
                     "the error is not monotone while S is small (rounding can cancel), so "
                     "the bisection finds a crossing, the scan the first one"))
    stall = 2 ** (8 + 1)  # ulp(S) / 2 = 2 > any addend < 1.5 once S >= 512
    rows.append(line("bf16 sum stalls at", "a < ulp(S) / 2 = S x 2^-8", stall, f"S = {stall:,}",
                     "addends < 1.5; at S in [512, 1024) ulp = 4, half = 2: every add rounds "
                     "back to S"))
    return Sheet("bf16 running sum vs fp32 accumulator: addends U[0.5, 1.5), seed 0",
                 (Section("Relative error of the running sum", tuple(rows)),),
                 verdict=f"bf16 accumulator crosses {tol:g} at n = {found}; accumulate in fp32",
                 data={"crossing": found, "probes": probes, "first_crossing": scan})


def build_roads(args: argparse.Namespace) -> Sheet:
    spec = model(args).spec
    bits = opt_int(args, "kv_bits", 4, lo=2, hi=8)
    r = opt_float(args, "outlier_ratio", 10.0)
    b = opt_int(args, "block_size", 16, hi=4096)
    d, hkv = spec.head_dim, spec.num_kv_heads
    qmax = 2 ** (bits - 1) - 1
    rel_tok = r / (qmax * math.sqrt(12))
    rel_ch = 1 / (qmax * math.sqrt(12))
    data = b * d * bits / 8
    tok_scales = b * 2 * SCALE_BYTES
    ch_scales = d * 2 * SCALE_BYTES
    resid = spec.num_layers * hkv * (b - 1) * d * ACT
    rows = (
        line("K per-token: error of a normal channel", "r / (qmax sqrt 12)", rel_tok,
             pct(rel_tok), f"step = r a / qmax, RMS step / sqrt 12: {r:g} / ({qmax} x 3.464) "
                           f"= {rel_tok:.4f} of the channel's range a"),
        line("K per-channel: error of a normal channel", "1 / (qmax sqrt 12)", rel_ch,
             pct(rel_ch), f"own scale a / qmax: 1 / ({qmax} x 3.464) = {rel_ch:.4f} "
                          f"({r:g}x less)"),
        line("V per-token: error", "1 / (qmax sqrt 12)", rel_ch, pct(rel_ch),
             "no outlier channels; a token's values share one range. V errors are averaged "
             "by the attention weights; K errors enter the logits and go through exp"),
        line("block data per KV head", "b x d x bits / 8", data, fmt_bytes(data),
             f"{b} x {d} x {bits} / 8 = {data:,.0f} B"),
        line("per-token scales (V) per block", "b x (scale + zero) x 2 B", tok_scales,
             f"{tok_scales:,} B = {pct(tok_scales / data)}",
             f"{b} x 2 x 2 = {tok_scales} B / {data:,.0f} B"),
        line("per-channel scales (K) per block", "d x (scale + zero) x 2 B", ch_scales,
             f"{ch_scales:,} B = {pct(ch_scales / data)}",
             f"{d} x 2 x 2 = {ch_scales} B / {data:,.0f} B: one set per block per KV head"),
        line("K scale group at V's overhead", "tokens per channel-scale group = d", d,
             f"{d} tokens", f"per-channel {d} x 4 / (g x {d} x {bits} / 8) = per-token "
                            f"g x 4 / (g x {d} x {bits} / 8) when g = d = {d}: scales "
                            f"shared by {max(1, d // b)} blocks of {b}"),
        line("full-precision tail per sequence (K)", "layers x H_kv x (b - 1) x d x 2 B", resid,
             fmt_bytes(resid), f"a block's channel scales are fixed when it fills: up to "
                               f"{b - 1} tokens stay bf16: {spec.num_layers} x {hkv} x "
                               f"{b - 1} x {d} x 2 = {resid:,} B"),
    )
    return Sheet(f"K vs V quantization roads: {model_name(model(args))}, int{bits}, block {b}",
                 (Section(f"Outlier ratio r = {r:g} (ASSUMED: key outlier channels / the rest)",
                          rows),),
                 verdict=f"keys per channel ({r:g}x less error than per token, scales "
                         f"{pct(ch_scales / data)} of a block), values per token "
                         f"({pct(tok_scales / data)})",
                 data={"per_token_k": rel_tok, "per_channel_k": rel_ch})
