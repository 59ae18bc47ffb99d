"""The GGUF block kernels (fitserve::ggml_matmul) vs the packed Q4_1 / Q8_0 kernels, same shape.

Random valid blocks of each type (finite fp16 scales), N x K weights, x float32 [M, K]; median
us per call over --runs runs after a warm-up, weights rotated through copies totalling
--rotate-mb so a GEMV reads them from where a decode step would (L3 / DRAM), not L2. Prints the
CPU model, ISA and tier, and for each type GB/s of weight bytes read.

    python benchmarks/bench_ggml_blocks.py [--threads 1] [--n 2048] [--k 2048] [--ms 1,4,16]

--vs-read instead sets each GGUF block kernel (K-quants, Q5, IQ4, MXFP4) beside a plain read of the same bytes, in one
process, on the 1.7B model's shapes (N x K: 2048x2048 q/o, 512x2048 k/v at 8 kv heads,
8192x2048 gate/up, 2048x8192 down) and the lm_heads (49152x576, 49152x2048): per shape, type
and thread count, copies of the weight fill --rotate-mb (so every call reads them from DRAM,
the cache evicted), then kernel passes and plain-read passes (torch's sum over the same buffers
viewed as float32) alternate --runs times. GB/s of weight bytes: one thread by its CPU clock
(time.thread_time: the host's other load does not count), more threads by the wall clock;
medians, and the median of the per-pass ratios kernel / read. --ms 1,8 adds the M > 1 rows
(per call: the weights read once per tile, so GB/s x M is the per-row cost).

    python benchmarks/bench_ggml_blocks.py --vs-read [--threads-list 1,2] [--types Q6_K,Q5_0]

--hot times the kernels' own work with the weights in cache (one copy, called again and again),
one thread by its CPU clock, on the MoE benchmark's expert shapes (256x1024 gate/up rows: 4
super-blocks; 1024x256 down rows: one) and 2048x2048: ns per weight row and per super-block
and GB/s of weight bytes. The per-row cost is the marginal one, (t(N rows) - t(8 rows)) /
(N - 8) with the two calls alternated --runs times, so the call's fixed cost (dispatch, x's
quantization, the output) is not counted.

    python benchmarks/bench_ggml_blocks.py --hot [--types Q4_K,Q6_K] [--ms 1,4]

--msweep times the K-quants' M > 1 calls (the batched decode of W2, the prefill) on one thread
by its CPU clock, weights in cache (compute-bound at these M), at the 1.7B shapes 2048x2048,
8192x2048, 2048x8192 and M = 2, 4, 8, 16, 32, 128: median us per call, ns per (weight row, x
row, super-block) and us per row of x. Where the K-quants' AMX tiles are on
(ggml_blocks.amx_active), each call is also timed with them off, the two alternated run by run,
and the AMX / VNNI time printed (the same bits either way). For an A/B of two trees, run it in
both one after the other.

    python benchmarks/bench_ggml_blocks.py --msweep [--types Q4_K] [--ms 8,32,128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from fitserve.kernels.cpu.ggml_blocks import (
    amx_active,
    ggml_blocks_tier,
    ggml_matmul,
    set_amx,
)
from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
from fitserve.kernels.cpu.qlinear import int4_linear, int8_linear

F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2),
              "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": ()}
SIZES = {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q5_0": (32, 22),
         "Q5_1": (32, 24), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "MXFP4": (32, 17)}


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


SHAPES_17B = "2048x2048,512x2048,8192x2048,2048x8192,49152x576,49152x2048"


def pass_time(fn: Callable[[], object], cpu_clock: bool) -> float:
    """Seconds one call of ``fn`` took: this thread's CPU time or the wall clock."""
    clock = time.thread_time if cpu_clock else time.perf_counter
    t0 = clock()
    fn()
    return clock() - t0


def kernel_vs_read(t: str, n: int, k: int, m: int, ws: list[torch.Tensor], runs: int,
                   cpu_clock: bool) -> tuple[float, float, float, float]:
    """(kernel GB/s, read GB/s, median ratio of the alternated passes, us per call) of type t
    over the weight copies ``ws`` at M = m."""
    nbytes = ws[0].numel()
    plain = [w.reshape(-1)[: nbytes // 4 * 4].view(torch.float32) for w in ws]
    x = torch.randn(m, k).bfloat16()
    kern_t, read_t = [], []
    for _ in range(runs):
        kern_t.append(pass_time(lambda: [ggml_matmul(x, w, t, n, k) for w in ws], cpu_clock))
        read_t.append(pass_time(lambda: [b.sum() for b in plain], cpu_clock))
    total = len(ws) * nbytes / 1e9
    ratio = statistics.median(r / c for c, r in zip(kern_t, read_t, strict=True))
    return (total / statistics.median(kern_t), total / statistics.median(read_t), ratio,
            statistics.median(kern_t) / len(ws) * 1e6)


def vs_read(args: argparse.Namespace) -> None:
    """Each type's kernel beside a plain read of its bytes (see the module docstring)."""
    rng = np.random.default_rng(0)
    ms = [int(v) for v in args.ms.split(",")]
    print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; tier {ggml_blocks_tier()}; "
          f"weights in copies filling {args.rotate_mb} MiB; load average {os.getloadavg()}")
    print(f"{'threads':>7} {'N x K':>11} {'type':>5} {'M':>3} {'clock':>5} {'kernel GB/s':>12} "
          f"{'read GB/s':>10} {'ratio':>6} {'us/call':>9}")
    for threads in [int(v) for v in args.threads_list.split(",")]:
        torch.set_num_threads(threads)
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            for t in args.types.split(","):
                if k % SIZES[t][0]:  # NOTE: llama.cpp stores such a tensor in another type
                    print(f"{threads:>7} {shape:>11} {t:>5}   K not a multiple of "
                          f"{SIZES[t][0]}: a file holds it as Q5_0 / Q5_1 / Q8_0")
                    continue
                nbytes = n * (k // SIZES[t][0]) * SIZES[t][1]
                ws = [random_blocks(t, n, k, rng)
                      for _ in range(max(2, (args.rotate_mb << 20) // nbytes))]
                for m in ms:
                    kern, read, ratio, us = kernel_vs_read(t, n, k, m, ws, args.runs,
                                                           threads == 1)
                    print(f"{threads:>7} {shape:>11} {t:>5} {m:>3} "
                          f"{'cpu' if threads == 1 else 'wall':>5} {kern:12.1f} {read:10.1f} "
                          f"{ratio:6.2f} {us:9.1f}", flush=True)


SHAPES_HOT = "256x1024,1024x256,2048x2048"
SHAPES_SWEEP = "2048x2048,8192x2048,2048x8192"


def calls_time(x: torch.Tensor, w: torch.Tensor, t: str, n: int, k: int, reps: int) -> float:
    """This thread's CPU seconds per call of ggml_matmul(x, w), over ``reps`` calls."""
    return pass_time(lambda: [ggml_matmul(x, w, t, n, k) for _ in range(reps)], True) / reps


def hot(args: argparse.Namespace) -> None:
    """Each K-quant kernel's own work, weights in cache (see the module docstring)."""
    rng = np.random.default_rng(0)
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; tier {ggml_blocks_tier()}; "
          f"one thread, CPU clock, weights in cache; load average {os.getloadavg()}")
    print(f"{'N x K':>11} {'type':>5} {'M':>3} {'ns/row':>8} {'ns/sb':>7} {'GB/s':>6} "
          f"{'us/call':>8}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for t in args.types.split(","):
            block, size = SIZES[t]
            row_bytes = k // block * size
            w, w8 = random_blocks(t, n, k, rng), random_blocks(t, 8, k, rng)
            reps = max(20, (8 << 20) // (n * row_bytes))
            for m in [int(v) for v in args.ms.split(",")]:
                x = torch.randn(m, k).bfloat16()
                big, small = [], []
                for _ in range(args.runs):
                    big.append(calls_time(x, w, t, n, k, reps))
                    small.append(calls_time(x, w8, t, 8, k, reps))
                per_row = (statistics.median(big) - statistics.median(small)) / (n - 8)
                print(f"{shape:>11} {t:>5} {m:>3} {per_row * 1e9:8.2f} "
                      f"{per_row * 1e9 * block / k:7.2f} {row_bytes / per_row / 1e9:6.1f} "
                      f"{statistics.median(big) * 1e6:8.1f}", flush=True)


def msweep(args: argparse.Namespace) -> None:
    """The K-quants' M > 1 cost at the 1.7B shapes (see the module docstring)."""
    rng = np.random.default_rng(0)
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; tier {ggml_blocks_tier()}; "
          f"one thread, CPU clock; load average {os.getloadavg()}")
    amx = amx_active()
    print(f"{'N x K':>11} {'type':>5} {'M':>4} {'us/call':>9} {'ns/row/sb':>10} {'us/x row':>9}"
          + (f" {'AMX / VNNI':>10}" if amx else ""))
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for t in args.types.split(","):
            w = random_blocks(t, n, k, rng)
            for m in [int(v) for v in args.ms.split(",")]:
                x = torch.randn(m, k).bfloat16()
                reps = max(2, int(2e8 // (n * k * m)))
                on, off = [], []
                for _ in range(args.runs):
                    on.append(calls_time(x, w, t, n, k, reps))
                    if amx:
                        set_amx(False)
                        off.append(calls_time(x, w, t, n, k, reps))
                        set_amx(True)
                per_call = statistics.median(on)
                ratio = f" {per_call / statistics.median(off):10.2f}" if amx else ""
                print(f"{shape:>11} {t:>5} {m:>4} {per_call * 1e6:9.1f} "
                      f"{per_call * 1e9 * 256 / (n * k * m):10.3f} {per_call * 1e6 / m:9.2f}"
                      + ratio, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vs-read", action="store_true", help="kernels vs a plain read (see top)")
    ap.add_argument("--hot", action="store_true", help="K-quant own work in cache (see top)")
    ap.add_argument("--msweep", action="store_true", help="K-quant M > 1 cost (see top)")
    ap.add_argument("--shapes", default=None, help="--vs-read / --hot: N x K list")
    ap.add_argument("--types", default=None, help="--vs-read / --hot: types")
    ap.add_argument("--threads-list", default="1,2", help="--vs-read: thread counts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--ms", default=None, help="rows of x (1,4,16; --vs-read 1)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--rotate-mb", type=int, default=None, help="weight copies (64; --vs-read 256)")
    args = ap.parse_args()
    args.rotate_mb = args.rotate_mb or (256 if args.vs_read else 64)
    args.ms = args.ms or ("1" if args.vs_read or args.hot else
                          "2,4,8,16,32,128" if args.msweep else "1,4,16")
    args.shapes = args.shapes or (SHAPES_HOT if args.hot else
                                  SHAPES_SWEEP if args.msweep else SHAPES_17B)
    args.types = args.types or ("Q4_K,Q5_K,Q6_K" if args.hot or args.msweep else
                                "Q4_K,Q5_K,Q6_K,Q5_0,Q5_1,IQ4_NL,IQ4_XS,MXFP4")
    if args.hot:
        return hot(args)
    if args.msweep:
        return msweep(args)
    if args.vs_read:
        return vs_read(args)
    torch.set_num_threads(args.threads)
    n, k = args.n, args.k
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; tier {ggml_blocks_tier()}; "
          f"threads {args.threads}; W {n}x{k}")
    cands: dict[str, tuple[int, Callable[[torch.Tensor, int], torch.Tensor]]] = {}
    for t in (v for v in args.types.split(",") if v in SIZES):  # the types random_blocks makes
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
