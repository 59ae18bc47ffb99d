"""The batch-1 int4 / int8 GEMV (fitserve::int4_linear / int8_linear, M = 1, act_quant) against
a plain read of the same bytes: how near the memory's speed each weight row streams.

For each shape and format, copies of one random weight fill --rotate-mb (> L3, so every call
reads its weights from DRAM the way a decode step does); the copies are views of one slab per
tensor (codes, scales, mins), read one after another. The plain read is torch's sum over the same
slabs (viewed as int64: no float special cases), so both read exactly the same bytes. Kernel and
plain read alternate --runs times in this one process; the best pass of each is kept.

One thread is timed by its CPU clock (time.thread_time: the other jobs of a loaded host do not
count); with more threads the clock is the wall's (say the load beside the figure).

    python benchmarks/bench_qgemv_stream.py [--threads 1,2] [--formats q4_1,q4_0,q8_0]
        [--shapes 135m,1.7b] [--rotate-mb 128] [--runs 5]

--vs-ggml instead runs, for each GGUF type (--ggml-types Q8_0,Q4_0,Q4_1) and shape, the SAME
random blocks held both ways the engine can hold them: the qlinear PackedWeight
(fitserve.quant.gguf_map, PackedLinear with its M > 1 panels, the kernel the table picks) and the
raw ggml blocks (GgmlLinear, fitserve::ggml_matmul), alternated with a plain read in one process,
at each M of --ms (1: a decode step; 8, 32: W2's tiles); one thread, CPU clock:

    python benchmarks/bench_qgemv_stream.py --vs-ggml [--shapes 1.7b] [--ms 1,8,32]

--vs-held compares the row-major weight with the same weight held as panels (qlinear_held.h,
what the engine holds by default), alternated with a plain read, at each M of --ms:

    python benchmarks/bench_qgemv_stream.py --vs-held --threads 1 [--ms 1,8,32]

Columns: GB/s of weight bytes (codes + scales + mins) per second, the kernel's fraction of the
plain read's rate, and the kernel's rate on one ~1 MB copy of the same shape read again and again
(in L2: no DRAM stream, so what is left is the kernel's own work; where it is not well above the
plain read, the kernel cannot stream at the memory's speed however it prefetches).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
from fitserve.kernels.cpu.qlinear import qlinear_ops_available, qlinear_tier
from fitserve.model.ggml_linear import GgmlLinear
from fitserve.model.linear import PackedLinear
from fitserve.quant.ggml_blocks import GgmlBlockWeight
from fitserve.quant.gguf_map import packed_from_gguf

# (label, N, K): the default model's (SmolLM2-135M) and SmolLM2-1.7B's decode projections
SHAPES: dict[str, list[tuple[str, int, int]]] = {
    "135m": [("o", 576, 576), ("k/v", 192, 576), ("gate/up", 1536, 576), ("down", 576, 1536),
             ("lm_head", 49152, 576)],
    "1.7b": [("q/o", 2048, 2048), ("k/v", 512, 2048), ("gate/up", 8192, 2048),
             ("down", 2048, 8192)],
}
FORMATS = ("q4_1", "q4_0", "q8_0")


class Slabs:
    """`copies` random weights [N, K] of one format, each a view of one slab per tensor."""

    def __init__(self, fmt: str, n: int, k: int, copies: int) -> None:
        gen = torch.Generator().manual_seed(n * 7 + k)
        g = k // 32
        self.fmt, self.n, self.copies = fmt, n, copies
        if fmt == "q8_0":
            self.q = torch.randint(-127, 128, (copies * n, k), generator=gen, dtype=torch.int8)
        else:
            self.q = torch.randint(0, 256, (copies * n, k // 2), generator=gen, dtype=torch.uint8)
        self.s = (torch.rand(copies * n, g, generator=gen) * 1e-2).half()
        self.m = (torch.rand(copies * n, g, generator=gen) * -0.08).half() if fmt == "q4_1" \
            else None

    def slabs(self) -> list[torch.Tensor]:
        return [t for t in (self.q, self.s, self.m) if t is not None]

    def bytes_per_copy(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slabs()) // self.copies

    def call(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        rows = slice(i * self.n, (i + 1) * self.n)
        ops = torch.ops.fitserve  # the op itself: no Python wrapper per call
        q, s = self.q[rows], self.s[rows]
        if self.fmt == "q8_0":
            return lambda x: ops.int8_linear(x, q, s, 32, True, False)
        m = self.m[rows] if self.m is not None else None
        return lambda x: ops.int4_linear(x, q, s, m, 32, True, False)


def plain_views(slabs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each slab's bytes as int64 (the tail that does not fill 8 bytes is left out)."""
    out = []
    for t in slabs:
        b = t.reshape(-1).view(torch.uint8)
        out.append(b[: b.numel() // 8 * 8].view(torch.int64))
    return out


def clock(threads: int) -> Callable[[], float]:
    return time.thread_time if threads == 1 else time.perf_counter


def measure(sl: Slabs, k: int, threads: int, runs: int) -> tuple[float, float]:
    """(kernel GB/s, plain read GB/s) over all copies: best of `runs` alternated passes."""
    x = torch.randn(1, k).bfloat16()
    calls = [sl.call(i) for i in range(sl.copies)]
    views = plain_views(sl.slabs())
    now = clock(threads)
    for f in calls[:4]:
        f(x)
    kern, read = [], []
    for _ in range(runs):
        t0 = now()
        for f in calls:
            f(x)
        kern.append(now() - t0)
        t0 = now()
        for v in views:
            v.sum()
        read.append(now() - t0)
    total = sl.copies * sl.bytes_per_copy()
    return total / min(kern) / 1e9, total / min(read) / 1e9


def in_l2(fmt: str, n: int, k: int, threads: int, runs: int) -> float:
    """Kernel GB/s on one copy of <= ~1 MB (n rows cut to fit), called again and again."""
    per_row = Slabs(fmt, 1, k, 1).bytes_per_copy()
    rows = max(16, min(n, (1 << 20) // per_row // 16 * 16))
    sl = Slabs(fmt, rows, k, 1)
    f, x, now = sl.call(0), torch.randn(1, k).bfloat16(), clock(threads)
    for _ in range(20):
        f(x)
    calls = max(10, int(2e7 // sl.bytes_per_copy()))
    best = float("inf")
    for _ in range(runs):
        t0 = now()
        for _ in range(calls):
            f(x)
        best = min(best, (now() - t0) / calls)
    return sl.bytes_per_copy() / best / 1e9


def random_ggml(t: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row bytes] of random type-t blocks whose fp16 d (and m) are small numbers."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t]]
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in (0, 2) if t == "Q4_1" else (0,):
        v = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        b[:, :, off:off + 2] = v.view(np.uint8).reshape(n, k // block, 2)
    return b.reshape(n, -1)


def vs_ggml(args: argparse.Namespace) -> None:
    """qlinear vs ggml rows on the same blocks (see the module docstring): per M, GB/s of the
    file's bytes for both, the plain read, and ggml's time over qlinear's (< 1: ggml faster)."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    ms = [int(v) for v in args.ms.split(",")]
    print("| shape | N x K | type | M | qlinear GB/s | ggml GB/s | plain read GB/s | "
          "qlinear / read | ggml / read | ggml time / qlinear time |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model in args.shapes.split(","):
        for label, n, k in SHAPES[model]:
            for t in args.ggml_types.split(","):
                nbytes = n * k // 32 * GGML_QUANT_SIZES[GGMLQuantizationType[t]][1]
                raws = [random_ggml(t, n, k, rng)
                        for _ in range(max(2, (args.rotate_mb << 20) // nbytes))]
                packed = [PackedLinear(packed_from_gguf(r, t, (n, k))) for r in raws]
                for p in packed:
                    p.prepack()
                ggml = [GgmlLinear(GgmlBlockWeight(t, n, k, torch.from_numpy(r))) for r in raws]
                views = plain_views([torch.from_numpy(r) for r in raws])
                for m in ms:
                    x = torch.randn(m, k).bfloat16()
                    times: dict[str, list[float]] = {"q": [], "g": [], "r": []}
                    for f in (*packed[:2], *ggml[:2]):
                        f(x)
                    for _ in range(args.runs):
                        for key, fns in (("q", packed), ("g", ggml)):
                            t0 = time.thread_time()
                            for f in fns:
                                f(x)
                            times[key].append(time.thread_time() - t0)
                        t0 = time.thread_time()
                        for v in views:
                            v.sum()
                        times["r"].append(time.thread_time() - t0)
                    gbs = {key: len(raws) * nbytes / min(v) / 1e9 for key, v in times.items()}
                    ratio = statistics.median(g / q for g, q in zip(times["g"], times["q"],
                                                                    strict=True))
                    print(f"| {model} {label} | {n}x{k} | {t} | {m} | {gbs['q']:.1f} | "
                          f"{gbs['g']:.1f} | {gbs['r']:.1f} | {gbs['q'] / gbs['r']:.2f} | "
                          f"{gbs['g'] / gbs['r']:.2f} | {ratio:.2f} |", flush=True)


def vs_held(args: argparse.Namespace) -> None:
    """Row-major vs held as panels (qlinear_held.h, the engine's layout): the same random weights
    both ways, alternated with a plain read in one process, at each M of --ms."""
    from fitserve.kernels.cpu.qlinear import hold

    ops = torch.ops.fitserve
    print("| threads | shape | N x K | format | M | row-major GB/s | held GB/s | plain read GB/s | "
          "row-major / read | held / read | held time / row-major time |")
    print("|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        now = clock(threads)
        for model in args.shapes.split(","):
            for label, n, k in SHAPES[model]:
                for fmt in args.formats.split(","):
                    copies = max(2, (args.rotate_mb << 20) // Slabs(fmt, n, k, 1).bytes_per_copy())
                    sl = Slabs(fmt, n, k, copies)
                    rows, held = [sl.call(i) for i in range(copies)], []
                    for i in range(copies):
                        r = slice(i * n, (i + 1) * n)
                        q, sc, mn = hold(sl.q[r], sl.s[r], None if sl.m is None else sl.m[r], 32)
                        held.append((lambda x, q=q, sc=sc: ops.int8_linear(x, q, sc, 32, True))
                                    if fmt == "q8_0" else
                                    (lambda x, q=q, sc=sc, mn=mn:
                                     ops.int4_linear(x, q, sc, mn, 32, True)))
                    views, total = plain_views(sl.slabs()), copies * sl.bytes_per_copy()
                    for m in (int(v) for v in args.ms.split(",")):
                        x = torch.randn(m, k).bfloat16()
                        if not torch.equal(rows[0](x), held[0](x)):
                            raise SystemExit(f"{fmt} {label} M={m}: held differs from row-major")
                        t: dict[str, list[float]] = {"rows": [], "held": [], "read": []}
                        for _ in range(args.runs):
                            for key, calls in (("rows", rows), ("held", held)):
                                t0 = now()
                                for f in calls:
                                    f(x)
                                t[key].append(now() - t0)
                            t0 = now()
                            for v in views:
                                v.sum()
                            t["read"].append(now() - t0)
                        r, h, rd = (total / min(t[key]) / 1e9 for key in ("rows", "held", "read"))
                        print(f"| {threads} | {model} {label} | {n}x{k} | {fmt} | {m} | {r:.1f} | "
                              f"{h:.1f} | {rd:.1f} | {r / rd:.2f} | {h / rd:.2f} | "
                              f"{min(t['held']) / min(t['rows']):.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default="135m,1.7b")
    ap.add_argument("--rotate-mb", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vs-ggml", action="store_true", help="qlinear vs ggml rows (see top)")
    ap.add_argument("--ggml-types", default="Q8_0,Q4_0,Q4_1", help="--vs-ggml: GGUF types")
    ap.add_argument("--ms", default="1,8,32", help="--vs-ggml / --vs-held: rows of x")
    ap.add_argument("--vs-held", action="store_true",
                    help="row-major vs held as panels (the engine's layout), at each of --ms")
    args = ap.parse_args()
    if not qlinear_ops_available():
        raise SystemExit("the qlinear extension did not build here: nothing to measure")
    print(f"# {cpu_model_name()} | {detect_isa().describe()} | kernels: {qlinear_tier()} | "
          f"torch {torch.__version__} | load {os.getloadavg()[0]:.1f}")
    if args.vs_ggml:
        print(f"# weights rotated through {args.rotate_mb} MB; 1 thread, CPU clock")
        vs_ggml(args)
        print(f"# load after: {os.getloadavg()[0]:.1f}")
        return
    if args.vs_held:
        print(f"# weights rotated through {args.rotate_mb} MB; 1 thread: CPU clock, more: wall")
        vs_held(args)
        print(f"# load after: {os.getloadavg()[0]:.1f}")
        return
    print(f"# weights rotated through {args.rotate_mb} MB; 1 thread: CPU clock, more: wall clock")
    print("| threads | shape | N x K | format | kernel GB/s | plain read GB/s | fraction | "
          "kernel in L2 GB/s |")
    print("|---:|---|---|---|---:|---:|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for model in args.shapes.split(","):
            for label, n, k in SHAPES[model]:
                for fmt in args.formats.split(","):
                    if label == "lm_head" and fmt != "q8_0":
                        continue  # the default model's lm_head is held int8
                    per_copy = Slabs(fmt, n, k, 1).bytes_per_copy()
                    copies = max(2, (args.rotate_mb << 20) // per_copy)
                    kern, read = measure(Slabs(fmt, n, k, copies), k, threads, args.runs)
                    l2 = in_l2(fmt, n, k, threads, args.runs)
                    print(f"| {threads} | {model} {label} | {n}x{k} | {fmt} | {kern:.1f} | "
                          f"{read:.1f} | {kern / read:.2f} | {l2:.1f} |", flush=True)
    print(f"# load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
