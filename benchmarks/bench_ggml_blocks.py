"""The GGUF block kernels (fitserve::ggml_matmul) vs the packed Q4_1 / Q8_0 kernels, same shape.

Random valid blocks of each type (finite fp16 scales), N x K weights, x float32 [M, K]; median
us per call over --runs runs after a warm-up, weights rotated through copies totalling
--rotate-mb so a GEMV reads them from where a decode step would (L3 / DRAM), not L2. Prints the
CPU model, ISA and tier, and for each type GB/s of weight bytes read.

    python benchmarks/bench_ggml_blocks.py [--threads 1] [--n 2048] [--k 2048] [--ms 1,4,16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from fitserve.kernels.cpu.ggml_blocks import GGML_KERNEL_TYPES, ggml_blocks_tier, ggml_matmul
from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
from fitserve.kernels.cpu.qlinear import int4_linear, int8_linear

F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2),
              "IQ4_NL": (0,), "IQ4_XS": (0,)}
SIZES = {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q5_0": (32, 22),
         "Q5_1": (32, 24), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136)}


def random_blocks(ggml_type: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [n, row bytes] of random blocks whose fp16 fields are small finite numbers."""
    block, size = SIZES[ggml_type]
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in F16_FIELDS[ggml_type]:
        v = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        b[:, :, off:off + 2] = v.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(b.reshape(n, -1))


def time_us(fn: Callable[[int], object], copies: int, runs: int) -> float:
    fn(0)
    reps = max(1, copies)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for i in range(reps):
            fn(i % copies)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--rotate-mb", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, k = args.n, args.k
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; tier {ggml_blocks_tier()}; "
          f"threads {args.threads}; W {n}x{k}")
    cands: dict[str, tuple[int, Callable[[torch.Tensor, int], torch.Tensor]]] = {}
    for t in GGML_KERNEL_TYPES:
        nbytes = n * (k // SIZES[t][0]) * SIZES[t][1]
        copies = max(1, (args.rotate_mb << 20) // nbytes)
        ws = [random_blocks(t, n, k, rng) for _ in range(copies)]
        cands[t] = (nbytes, lambda x, i, ws=ws, t=t: ggml_matmul(x, ws[i % len(ws)], t, n, k))
    q4_bytes = n * k // 2 + 2 * 2 * n * (k // 32)
    c4 = max(1, (args.rotate_mb << 20) // q4_bytes)
    q4 = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
           (torch.rand(n, k // 32) * 0.01).half(), (torch.rand(n, k // 32) * -0.08).half())
          for _ in range(c4)]
    cands["Q4_1 (packed)"] = (q4_bytes, lambda x, i: int4_linear(x, *q4[i % c4], 32, True))
    q8_bytes = n * k + 2 * n * (k // 32)
    c8 = max(1, (args.rotate_mb << 20) // q8_bytes)
    q8 = [(torch.randint(-128, 128, (n, k), dtype=torch.int8),
           (torch.rand(n, k // 32) * 0.01).half()) for _ in range(c8)]
    cands["Q8_0 (packed)"] = (q8_bytes, lambda x, i: int8_linear(x, *q8[i % c8], 32, True))
    for m in [int(v) for v in args.ms.split(",")]:
        x = torch.randn(m, k)
        print(f"M = {m}")
        for name, (nbytes, fn) in cands.items():
            copies = max(1, (args.rotate_mb << 20) // nbytes)
            us = time_us(lambda i, fn=fn, x=x: fn(x, i), copies, args.runs)
            print(f"  {name:14s} {us:9.1f} us  {nbytes / us / 1e3:6.1f} GB/s of weights")


if __name__ == "__main__":
    main()
