"""Time every packed-linear candidate on the default model's shapes; print the table the
dispatch rule in fitserve/model/linear.py (RULES) is written from.

    python benchmarks/bench_linear.py                 # all shapes, M = 1 4 16 32 128 512
    python benchmarks/bench_linear.py --m 1 16 --threads 2 --runs 5

Shapes (N x K) of SmolLM2-135M: fused q/k/v 960x576, o_proj 576x576, fused gate/up 3072x576,
down 576x1536 (Q4_1 as stored: int4-g32-asym), the tied lm_head 49152x576 (Q8_0 as stored:
int8-g32); every shape also as per-channel int8 (--weights int8). Each candidate is timed as
the median of --runs runs after a warm-up, next to dense bf16 F.linear on the same shape; the
CPU model and ISA are printed first (only ratios measured in one run compare).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
from fitserve.model.linear import CANDIDATES, PackedLinear, isa_key, layout_key, shape_class
from fitserve.quant import quantize

SHAPES = [  # (name, N, K, format as held)
    ("qkv", 960, 576, "int4-g32-asym"),
    ("o_proj", 576, 576, "int4-g32-asym"),
    ("gate_up", 3072, 576, "int4-g32-asym"),
    ("down", 576, 1536, "int4-g32-asym"),
    ("lm_head", 49152, 576, "int8-g32"),
    ("qkv", 960, 576, "int8-ch"),
    ("gate_up", 3072, 576, "int8-ch"),
    ("down", 576, 1536, "int8-ch"),
    ("lm_head", 49152, 576, "int8-ch"),
]


def median_us(fn: object, runs: int) -> float:
    call = fn  # type: ignore[assignment]
    call()  # type: ignore[operator]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--only", nargs="*", default=None, help="shape names to run (default all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    isa = detect_isa()
    print(f"# {cpu_model_name()} | ISA {isa.describe()} | table key {isa_key()} | "
          f"{args.threads} threads | torch {torch.__version__} | x {args.dtype} | "
          f"{datetime.date.today().isoformat()} | median of {args.runs} after a warm-up")
    names = [n for n in CANDIDATES]
    print(f"{'shape':>8} {'format':>14} {'M':>4} {'bf16 us':>9} " +
          " ".join(f"{n:>10}" for n in names) + "   best (x bf16)")
    best_by_class: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    gen = torch.Generator().manual_seed(0)
    for name, n, k, fmt in SHAPES:
        if args.only and name not in args.only:
            continue
        w = torch.randn(n, k, generator=gen) * 0.05
        dense = w.to(dtype)
        layer = PackedLinear(quantize(w, fmt))
        pw = layer.packed
        for m in args.m:
            x = torch.randn(m, k, generator=gen).to(dtype)
            ref = median_us(lambda x=x, w=dense: F.linear(x, w), args.runs)
            row: dict[str, float] = {}
            for cand in CANDIDATES.values():
                if not cand.applies(pw, dtype):
                    continue
                layer.force = cand.name
                row[cand.name] = median_us(lambda x=x, f=layer: f(x), args.runs)
            best = min(row, key=row.__getitem__)
            cells = " ".join(f"{row[c]:10.0f}" if c in row else f"{'-':>10}" for c in names)
            print(f"{name:>8} {fmt:>14} {m:4d} {ref:9.0f} {cells}   {best} "
                  f"(x{ref / row[best]:.2f})")
            key = (layout_key(pw), shape_class(m))
            for c, us in row.items():
                best_by_class[key][c] += us
            best_by_class[key]["bf16-dense"] += ref
    print("\n# summed time per (layout, M class) -> fastest first (the RULES preference lists)")
    for (layout, mclass), totals in sorted(best_by_class.items()):
        order = sorted((c for c in totals if c != "bf16-dense"), key=totals.__getitem__)
        shown = ", ".join(f"{c} {totals[c] / 1e3:.2f} ms" for c in order)
        print(f"({layout!r:>16}, {mclass!r:>7}): {shown}  | dense bf16 "
              f"{totals['bf16-dense'] / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
