"""The batch-1 bf16 and fp8 GEMVs (fitserve_dense::bf16_gemv, fitserve_fp8::fp8_linear at one row of
x) at the default model's shapes: GB/s of weight bytes, each layer's weight distinct (30 layers'
worth, so the rows come from DRAM as in a decode step; --l2 adds one weight read again and again).

    PYTHONPATH=$PWD python benchmarks/bench_dense_gemv_stream.py [--threads 2] [--reps 7]

Wall clock at --threads, median of --reps passes over the layers. The fp8 weight is e4m3 codes
with per-channel scales (what ``--weights fp8`` holds).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_engine import cpu_description  # noqa: E402

from fitserve.kernels.cpu.dense_gemv import bf16_gemv_available  # noqa: E402
from fitserve.kernels.cpu.fp8_gemv import fp8_gemv_available, fp8_linear  # noqa: E402

# SmolLM2-135M's linears (N, K) and how many distinct copies a pass reads
SHAPES = (("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30),
          ("down", 576, 1536, 30), ("lm_head", 49152, 576, 4))


def bf16_call(x: torch.Tensor):
    return lambda w: torch.ops.fitserve_dense.bf16_gemv(x, w, None)


def fp8_call(x: torch.Tensor):
    return lambda w: fp8_linear(x, w[0], w[1], "e4m3", "channel", 0, None)


def median_pass(call, weights: list, reps: int) -> float:
    for w in weights:
        call(w)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for w in weights:
            call(w)
        times.append((time.perf_counter() - t) / len(weights))
    return sorted(times)[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--l2", action="store_true", help="also one weight re-read (its own work)")
    args = ap.parse_args()
    print(f"CPU: {cpu_description()}; {args.threads} thread(s)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    for name, n, k, layers in SHAPES:
        x = torch.randn(1, k, generator=gen).bfloat16()
        row = f"{name:8s} {n:5d} x {k:4d}:"
        if bf16_gemv_available():
            ws = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for _ in range(layers)]
            dt = median_pass(bf16_call(x), ws, args.reps)
            row += f"  bf16 {dt * 1e6:8.1f} us {2 * n * k / dt / 1e9:5.1f} GB/s"
            if args.l2:
                dt = median_pass(bf16_call(x), ws[:1] * 30, args.reps)
                row += f" (one weight: {2 * n * k / dt / 1e9:5.1f})"
        if fp8_gemv_available():
            fs = [(torch.randint(0, 126, (n, k), generator=gen, dtype=torch.uint8),
                   torch.rand(n, generator=gen) * 0.01) for _ in range(layers)]
            dt = median_pass(fp8_call(x), fs, args.reps)
            row += f"  fp8 {dt * 1e6:8.1f} us {n * k / dt / 1e9:5.1f} GB/s"
            if args.l2:
                dt = median_pass(fp8_call(x), fs[:1] * 30, args.reps)
                row += f" (one weight: {n * k / dt / 1e9:5.1f})"
        print(row, flush=True)


if __name__ == "__main__":
    main()
