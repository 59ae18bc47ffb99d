"""The compute cost per weight of each held format's batch-1 kernel: what the step-time model's
dequant term reads (fitserve/ledger/dequant.py, DEQUANT_NS_PER_WEIGHT).

Each kernel runs on one thread with its weights in L2 (no DRAM stream: what is left is the
decode, the dot products and the per-call work), x bf16 [M, K]. Per call, CPU time of this
thread (time.thread_time: a loaded host's other processes do not count) at two weight sizes
N1 < N2 rows; the slope (t(N2) - t(N1)) / ((N2 - N1) K) is the cost per weight, the intercept
the per-call cost (activation quantization, dispatch). bf16 (F.linear, the peer in this run:
torch's own kernel) and fp8 are measured the same way. Prints a table and the dict to paste.

--stream instead measures each kernel's DRAM read rate at M = 1 on one thread: copies of one
weight (--n x --k) filling --rotate-mb, read one after another so each call streams its weights
from DRAM, GB/s of weight bytes per CPU second, beside a plain read of the same buffers
(torch's sum over them viewed as float32: the rate this thread's loads alone reach).

    python benchmarks/bench_dequant_cost.py [--ms 1,8] [--reps 400] [--k 512]
    python benchmarks/bench_dequant_cost.py --stream [--n 2048] [--k 2048] [--rotate-mb 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_ggml_blocks import SIZES, random_blocks  # noqa: E402  (same random valid blocks)

from fitserve.kernels.cpu.fp8_gemv import fp8_gemv_available, fp8_linear  # noqa: E402
from fitserve.kernels.cpu.ggml_blocks import GGML_KERNEL_TYPES, ggml_blocks_tier, ggml_matmul  # noqa: E402
from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa  # noqa: E402
from fitserve.kernels.cpu.qlinear import int4_linear, int8_linear  # noqa: E402

Call = Callable[[torch.Tensor], torch.Tensor]
# ledger format name -> (how the engine holds it: the kernel it runs, built for n rows of k)
Maker = Callable[[int, int, np.random.Generator], Call]


def _q4(asym: bool) -> Maker:
    def make(n: int, k: int, rng: np.random.Generator) -> Call:
        q = torch.from_numpy(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
        s = (torch.rand(n, k // 32) * 0.01).half()
        m = (torch.rand(n, k // 32) * -0.08).half() if asym else None
        return lambda x: int4_linear(x, q, s, m, 32, True)
    return make


def _q8(n: int, k: int, rng: np.random.Generator) -> Call:
    q = torch.from_numpy(rng.integers(-128, 128, (n, k), dtype=np.int8))
    s = (torch.rand(n, k // 32) * 0.01).half()
    return lambda x: int8_linear(x, q, s, 32, True)


def _ggml(t: str) -> Maker:
    def make(n: int, k: int, rng: np.random.Generator) -> Call:
        w = random_blocks(t, n, k, rng)
        return lambda x: ggml_matmul(x, w, t, n, k)
    return make


def _fp8(n: int, k: int, rng: np.random.Generator) -> Call:
    codes = torch.from_numpy(rng.integers(0, 256, (n, k), dtype=np.uint8))
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    s = torch.rand(n) * 0.01
    return lambda x: fp8_linear(x, codes, s, "e4m3", "channel", 0)


def _bf16(n: int, k: int, rng: np.random.Generator) -> Call:
    w = torch.randn(n, k).bfloat16()
    return lambda x: F.linear(x, w)


def makers() -> dict[str, Maker]:
    out: dict[str, Maker] = {"bf16": _bf16, "int4-g32-sym (Q4_0)": _q4(False),
                             "int4-g32-asym (Q4_1)": _q4(True), "int8-g32 (Q8_0)": _q8}
    # NOTE: MXFP4 runs only inside the MoE expert kernel (bench_moe), not as a held linear
    out.update({t: _ggml(t) for t in GGML_KERNEL_TYPES if t in SIZES})
    if fp8_gemv_available():
        out["fp8-ch"] = _fp8
    return out


def cpu_us(fn: Call, x: torch.Tensor, reps: int) -> float:
    """Median CPU microseconds per call of this thread over 5 batches of ``reps`` calls."""
    fn(x)
    times = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(reps):
            fn(x)
        times.append((time.thread_time() - t0) / reps)
    return statistics.median(times) * 1e6


def held_tensors(fn: Call) -> list[torch.Tensor]:
    """The weight tensors (codes, scales, ...) a maker's call closes over: what it reads."""
    cells = getattr(fn, "__closure__", None) or ()
    return [c.cell_contents for c in cells if isinstance(c.cell_contents, torch.Tensor)]


def stream(args: argparse.Namespace) -> None:
    """Per format: GB/s of weight bytes at M = 1 (min CPU time of --runs passes over copies
    filling --rotate-mb), and a plain read's GB/s over the same buffers, alternated."""
    n, k = args.n, args.k
    rng = np.random.default_rng(0)
    x = torch.randn(1, k).bfloat16()
    print(f"{'format':<22}{'kernel GB/s':>12}{'plain read GB/s':>17}{'ratio':>7}")
    for name, make in makers().items():
        if args.formats and name.split(" ")[0] not in args.formats.split(","):
            continue
        one = make(n, k, rng)
        nbytes = sum(t.numel() * t.element_size() for t in held_tensors(one))
        copies = max(2, (args.rotate_mb << 20) // max(1, nbytes))
        calls = [one] + [make(n, k, rng) for _ in range(copies - 1)]
        bufs = [t.reshape(-1).view(torch.uint8) for f in calls for t in held_tensors(f)]
        plain = [b[: b.numel() // 4 * 4].view(torch.float32) for b in bufs]
        kern_t, read_t = [], []
        for _ in range(args.runs):
            t0 = time.thread_time()
            for f in calls:
                f(x)
            kern_t.append(time.thread_time() - t0)
            t0 = time.thread_time()
            for b in plain:
                b.sum()
            read_t.append(time.thread_time() - t0)
        kern = copies * nbytes / min(kern_t) / 1e9
        read = copies * nbytes / min(read_t) / 1e9
        print(f"{name:<22}{kern:12.1f}{read:17.1f}{kern / read:7.2f}")
        del calls, bufs, plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--k", type=int, default=None, help="columns (512; --stream 2048)")
    ap.add_argument("--n1", type=int, default=128)
    ap.add_argument("--n2", type=int, default=512)
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--stream", action="store_true", help="DRAM read rate at M = 1 instead")
    ap.add_argument("--n", type=int, default=2048, help="--stream: weight rows")
    ap.add_argument("--rotate-mb", type=int, default=256, help="--stream: bytes of copies")
    ap.add_argument("--runs", type=int, default=3, help="--stream: passes (min taken)")
    ap.add_argument("--formats", default="", help="these formats only (a,b,...)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.k = args.k or (2048 if args.stream else 512)
    if args.stream:
        print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; 1 thread, "
              f"{args.n} x {args.k} weights in copies filling {args.rotate_mb} MiB (DRAM), "
              f"CPU time of the thread; load average {os.getloadavg()}")
        return stream(args)
    k, n1, n2 = args.k, args.n1, args.n2
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; tier {ggml_blocks_tier()}; "
          f"1 thread, K={k}, N {n1} -> {n2}, weights in L2, CPU time of the thread")
    ms = [int(v) for v in args.ms.split(",")]
    print(f"{'format':<22}" + "".join(f"{f'ns/w M={m}':>11}{f'us/call M={m}':>14}" for m in ms))
    table: dict[str, float] = {}
    for name, make in makers().items():
        if args.formats and name.split(" ")[0] not in args.formats.split(","):
            continue
        small, big = make(n1, k, rng), make(n2, k, rng)
        row = f"{name:<22}"
        for m in ms:
            x = torch.randn(m, k).bfloat16()
            t1, t2 = cpu_us(small, x, args.reps), cpu_us(big, x, args.reps)
            ns = max(0.0, (t2 - t1) * 1e3 / ((n2 - n1) * k))
            row += f"{ns:11.4f}{t1 - ns * n1 * k / 1e3:14.2f}"
            if m == 1:
                table[name.split(" ")[0]] = ns
        print(row)
    print("\nDEQUANT_NS_PER_WEIGHT (M = 1):")
    print("{" + ", ".join(f'"{k_}": {v:.4f}' for k_, v in table.items()) + "}")


if __name__ == "__main__":
    main()
