"""The GGUF block kernels (fitserve::ggml_matmul) vs the packed Q4_1 / Q8_0 kernels, same shape.

Random valid blocks of each type (finite fp16 scales), N x K weights, x float32 [M, K]; median
us per call over --runs runs after a warm-up, weights rotated through copies totalling
--rotate-mb so a GEMV reads them from where a decode step would (L3 / DRAM), not L2. Prints the
CPU model, ISA and tier, and for each type GB/s of weight bytes read.

    python benchmarks/bench_ggml_blocks.py [--threads 1] [--n 2048] [--k 2048] [--ms 1,4,16]

--stream: the decode GEMV (M = 1) of the 32-column types on SmolLM2-1.7B's weight shapes
(--shapes, N x K), weights evicted between calls (copies filling --rotate-mb read in turn),
beside a plain read (torch sum) of the same buffers, alternated in one process, on 1 and 2
threads. One thread: bytes per CPU second of the thread (time.thread_time, fair on a loaded
host); two: bytes per wall second (min over --runs passes). Prints GB/s and the kernel's
fraction of the plain read.

    python benchmarks/bench_ggml_blocks.py --stream [--types Q5_0,IQ4_XS] [--threads-list 1,2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from fitserve.kernels.cpu.ggml_blocks import GGML_KERNEL_TYPES, ggml_blocks_tier, ggml_matmul
from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
from fitserve.kernels.cpu.qlinear import int4_linear, int8_linear

F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2),
              "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": ()}
SIZES = {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q5_0": (32, 22),
         "Q5_1": (32, 24), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "MXFP4": (32, 17)}
# SmolLM2-1.7B's linear weights, N x K: q/k/v/o, a 4x-narrower k/v, gate/up, down
SHAPES_17B = "2048x2048,512x2048,8192x2048,2048x8192"


def random_blocks(ggml_type: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [n, row bytes] of random blocks whose fp16 fields are small finite numbers."""
    block, size = SIZES[ggml_type]
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in F16_FIELDS[ggml_type]:
        v = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        b[:, :, off:off + 2] = v.view(np.uint8).reshape(n, k // block, 2)
    if ggml_type == "MXFP4":  # e8m0 exponents near 2^-7 (finite products)
        b[:, :, 0] = rng.integers(118, 124, (n, k // block), dtype=np.uint8)
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


def _pass_s(fn: Callable[[], object], threads: int) -> float:
    """Seconds of one pass: the thread's CPU time on one thread, wall time on more."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    t0 = clock()
    fn()
    return clock() - t0


def _stream_shape(t: str, n: int, k: int, args: argparse.Namespace,
                  rng: np.random.Generator) -> str:
    """One type and shape: per thread count, kernel GB/s, plain-read GB/s and their ratio."""
    row = (k // SIZES[t][0]) * SIZES[t][1]
    copies = max(2, (args.rotate_mb << 20) // (n * row))
    ws = [random_blocks(t, n, k, rng) for _ in range(copies)]
    flat = [w.view(-1)[: w.numel() // 4 * 4].view(torch.float32) for w in ws]
    x = torch.randn(1, k)
    line = f"{t:<8}{f'{n}x{k}':>11}{row:>7}"
    for th in (int(v) for v in args.threads_list.split(",")):
        torch.set_num_threads(th)
        kern, read = [], []
        for _ in range(args.runs):
            kern.append(_pass_s(lambda: [ggml_matmul(x, w, t, n, k) for w in ws], th))
            read.append(_pass_s(lambda: [f.sum() for f in flat], th))
        gk, gr = copies * n * row / min(kern) / 1e9, copies * n * row / min(read) / 1e9
        line += f"{gk:10.1f}{gr:9.1f}{gk / gr:6.2f}"
    return line


def stream(args: argparse.Namespace) -> None:
    """Per type and shape, M = 1 from DRAM: kernel and plain-read GB/s, alternated."""
    rng = np.random.default_rng(0)
    threads = [int(v) for v in args.threads_list.split(",")]
    print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; tier {ggml_blocks_tier()}; "
          f"M = 1, copies filling {args.rotate_mb} MiB; load average {os.getloadavg()}")
    print(f"{'type':<8}{'N x K':>11}{'row B':>7}" + "".join(
        f"{f'kernel {t}T':>10}{f'read {t}T':>9}{'frac':>6}" for t in threads))
    for t in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            print(_stream_shape(t, n, k, args, rng), flush=True)
    print(f"load average after: {os.getloadavg()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stream", action="store_true", help="M = 1 from DRAM vs a plain read")
    ap.add_argument("--types", default="Q5_0,Q5_1,IQ4_NL,IQ4_XS,MXFP4", help="--stream: types")
    ap.add_argument("--shapes", default=SHAPES_17B, help="--stream: N x K list")
    ap.add_argument("--threads-list", default="1,2", help="--stream: thread counts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--runs", type=int, default=7, help="passes (--stream: the min is taken)")
    ap.add_argument("--rotate-mb", type=int, default=64)
    args = ap.parse_args()
    if args.stream:
        args.rotate_mb = max(args.rotate_mb, 256)
        return stream(args)
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
