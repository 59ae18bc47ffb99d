"""Quantized linear kernels (fitserve::int4_linear / int8_linear) vs torch on this CPU.

For the default model's shapes (SmolLM2-135M: qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, tied lm_head 49152x576) and M = 1 ... 512 rows of bf16 x, each candidate's median
time over >= 5 runs after a warm-up. Weights are rotated through enough copies (~64 MB) that
decode-sized calls read them from L3 / DRAM the way a real step does, not from L2.

    python benchmarks/bench_qlinear.py [--threads 2] [--ms 1,4,16,32,128,512] [--runs 5]
                                       [--shapes qkv,o,gate_up,down,lm_head] [--stat median]

Columns (us per call):
  q4 aq / q4 f32   ours, int4 asym g32 (GGUF Q4_1), act_quant True / False
  q8 aq / q8 f32   ours, int8 g32 (GGUF Q8_0)
  q8c aq           ours, int8 per output channel (the layout of torch's int8pack)
  bf16 / bf16 nodnn  F.linear on bf16 weights, torch.backends.mkldnn on / off
  aten q8c         torch.ops.aten._weight_int8pack_mm (per-channel int8, bf16 x)
  aten q4          torch.ops.aten._weight_int4pack_mm_for_cpu (g32)
  deq+lin          the pure-torch path: dequantize int4 to bf16, then F.linear
At M = 1 it also prints GB/s of weight bytes read against the measured copy bandwidth (of
buffers the size of the rotation set: that is the memory level the weights come from).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
from fitserve.kernels.cpu.qlinear import qlinear_ops_available, qlinear_tier

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576)]
COLS = ["q4 aq", "q4 f32", "q8 aq", "q8 f32", "q8c aq", "bf16", "bf16 nodnn", "aten q8c",
        "aten q4", "deq+lin"]
ROTATE_BYTES = 64 << 20


def copy_bandwidth(nbytes: int, runs: int = 5) -> float:
    """STREAM-style copy GB/s (bytes read + bytes written) between two buffers of nbytes."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def time_us(fn: Callable[[int], object], copies: int, runs: int, stat: str = "median") -> float:
    """Median (or min) us per call of fn(i) over `runs` runs, cycling i through the copies."""
    fn(0)
    t0 = time.perf_counter()
    fn(1 % copies)
    est = max(time.perf_counter() - t0, 1e-6)
    calls = int(min(max(1, 0.01 / est), 4 * copies))
    times = []
    for r in range(runs):
        t0 = time.perf_counter()
        for i in range(calls):
            fn((r * calls + i) % copies)
        times.append((time.perf_counter() - t0) / calls)
    return (min(times) if stat == "min" else statistics.median(times)) * 1e6


def pack4(q: torch.Tensor, g: int) -> torch.Tensor:
    n, k = q.shape
    grp = q.to(torch.uint8).view(n, k // g, 2, g // 2)
    return (grp[:, :, 0] | (grp[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class Weights:
    """One random weight [N, K] in every format the candidates need; `bytes[col]` read/call."""

    def __init__(self, n: int, k: int, with_int4: bool) -> None:
        gen = torch.Generator().manual_seed(n + k)
        self.n, self.k = n, k
        self.nbytes: dict[str, int] = {}
        self.bf16 = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        self.nbytes["bf16"] = self.nbytes["bf16 nodnn"] = n * k * 2
        # int8 g32 and per channel
        self.q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        self.s8 = (torch.rand(n, k // 32, generator=gen) * 1e-3).half()
        self.s8c = (torch.rand(n, 1, generator=gen) * 1e-3).half()
        self.s8c_bf16 = self.s8c.view(n).to(torch.bfloat16)
        self.nbytes["q8 aq"] = self.nbytes["q8 f32"] = n * k + n * (k // 32) * 2
        self.nbytes["q8c aq"] = self.nbytes["aten q8c"] = n * k + n * 2
        if with_int4:
            q4 = torch.randint(0, 16, (n, k), generator=gen)
            self.q4 = pack4(q4, 32)
            self.s4 = (torch.rand(n, k // 32, generator=gen) * 1e-3).half()
            self.m4 = (-8 * self.s4.float()).half()
            self.nbytes["q4 aq"] = self.nbytes["q4 f32"] = n * k // 2 + 2 * n * (k // 32) * 2
            self.nbytes["deq+lin"] = self.nbytes["q4 aq"]
            # torch's int4pack: w = (q - 8) * scale + zero, zero = min + 8 * scale
            self.q4_aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q4.to(torch.int32), 2)
            zero = self.m4.float() + 8 * self.s4.float()
            self.sz4 = torch.stack([self.s4.float(), zero], -1).transpose(0, 1).contiguous()
            self.sz4 = self.sz4.to(torch.bfloat16)
            self.nbytes["aten q4"] = self.q4_aten.numel() + self.sz4.numel() * 2

    def total(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values()
                   if isinstance(t, torch.Tensor))


def dequant4_bf16(w: Weights) -> torch.Tensor:
    lo = (w.q4 & 0x0F).view(w.n, w.k // 32, 16)
    hi = (w.q4 >> 4).view(w.n, w.k // 32, 16)
    q = torch.cat([lo, hi], -1).float()
    return (q * w.s4.float()[..., None] + w.m4.float()[..., None]).view(w.n, w.k).bfloat16()


def candidates(w: Weights) -> dict[str, Callable[[torch.Tensor, Weights], torch.Tensor]]:
    ops = torch.ops.fitserve
    c: dict[str, Callable[[torch.Tensor, Weights], torch.Tensor]] = {
        "q8 aq": lambda x, w: ops.int8_linear(x, w.q8, w.s8, 32, True),
        "q8 f32": lambda x, w: ops.int8_linear(x, w.q8, w.s8, 32, False),
        "q8c aq": lambda x, w: ops.int8_linear(x, w.q8, w.s8c, w.k, True),
        "bf16": lambda x, w: F.linear(x, w.bf16),
        "bf16 nodnn": lambda x, w: F.linear(x, w.bf16),
        "aten q8c": lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w.q8, w.s8c_bf16),
    }
    if hasattr(w, "q4"):
        c.update({
            "q4 aq": lambda x, w: ops.int4_linear(x, w.q4, w.s4, w.m4, 32, True),
            "q4 f32": lambda x, w: ops.int4_linear(x, w.q4, w.s4, w.m4, 32, False),
            "aten q4": lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, w.q4_aten, 32, w.sz4),
            "deq+lin": lambda x, w: F.linear(x, dequant4_bf16(w)),
        })
    return c


def bind(fn: Callable[[torch.Tensor, Weights], torch.Tensor], x: torch.Tensor,
         ws: list[Weights]) -> Callable[[int], torch.Tensor]:
    return lambda i: fn(x, ws[i])


def check_aten_int4(w: Weights) -> None:
    """Make sure the int4pack comparator computes the same product (else its time is moot)."""
    x = torch.randn(2, w.k).bfloat16()
    ref = x.float() @ dequant4_bf16(w).float().T
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.q4_aten, 32, w.sz4).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    if err > 0.05:
        print(f"  WARNING: aten int4pack differs from the reference by {err:.2%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,4,16,32,128,512")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="min is steadier on a machine shared with other jobs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not qlinear_ops_available():
        raise SystemExit("the qlinear extension did not build here: nothing to measure")
    isa = detect_isa()
    bw_dram = copy_bandwidth(384 << 20)
    bw = copy_bandwidth(ROTATE_BYTES // 2)
    print(f"# {cpu_model_name()} | {isa.describe()} | kernels: {qlinear_tier()} | "
          f"torch {torch.__version__} | {args.threads} threads | {args.stat} of {args.runs} runs")
    print(f"# copy bandwidth (read + write): {bw_dram:.1f} GB/s with 384 MB buffers (DRAM), "
          f"{bw:.1f} GB/s with {ROTATE_BYTES >> 21} MB ones (the weights' rotation set)")
    ms = [int(m) for m in args.ms.split(",")]
    at_m1: dict[str, dict[str, float]] = {}
    print("\n| shape (N x K) | M | " + " | ".join(COLS) + " | best |")
    print("|---|---:|" + "---:|" * (len(COLS) + 1))
    for name, n, k in SHAPES:
        if name not in args.shapes.split(","):
            continue
        base = Weights(n, k, with_int4=name != "lm_head")
        copies = max(1, ROTATE_BYTES // base.total())
        ws = [base] + [Weights(n, k, name != "lm_head") for _ in range(min(copies, 48) - 1)]
        if hasattr(base, "q4"):
            check_aten_int4(base)
        cands = candidates(base)
        for m in ms:
            x = torch.randn(m, k).bfloat16()
            row: dict[str, float] = {}
            for col in COLS:
                if col not in cands:
                    continue
                call = bind(cands[col], x, ws)
                with torch.backends.mkldnn.flags(enabled=col != "bf16 nodnn"):
                    row[col] = time_us(call, len(ws), args.runs, args.stat)
            best = min(row, key=row.__getitem__)
            cells = [f"{row[c]:.0f}" if c in row else "-" for c in COLS]
            print(f"| {name} {n}x{k} | {m} | " + " | ".join(cells) + f" | {best} |", flush=True)
            if m == 1:
                at_m1[f"{name} {n}x{k}"] = {c: base.nbytes[c] / (row[c] * 1e3) for c in row}
    if at_m1:
        print(f"\nM = 1: GB/s of weight bytes read (fraction of the {bw:.1f} GB/s copy bandwidth at "
              f"the rotation set's size)")
        print("| shape | " + " | ".join(COLS) + " |")
        print("|---|" + "---:|" * len(COLS))
        for shape, gbs in at_m1.items():
            cells = [f"{gbs[c]:.1f} ({gbs[c] / bw:.2f})" if c in gbs else "-" for c in COLS]
            print(f"| {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
