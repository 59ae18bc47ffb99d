"""G MAC/s of the integer weight kernels' M > 1 calls (a kernel A/B, no peers: run it in each
tree, alternated, and compare medians; docs/benchmarks.md's twelfth-session table).

    .venv/bin/python benchmarks/bench_m_rows.py --types IQ4_XS,Q4_K,int4,int8 \\
        --shapes 2048x2048,8192x2048,2048x8192 --ms 16,32,128,512 --threads 2

ggml types run ``ggml_matmul`` on random blocks (bench_ggml_blocks.random_blocks); ``int4`` /
``int8`` run ``int4_linear`` / ``int8_linear`` at group 32 on held panels (the default model's
layout). Each line: the median of calls totalling ~2 G MAC, one weight matrix (in cache).

With --interleave (types compared within one run), each (shape, M) times every type in turn,
7 rounds of calls totalling ~0.3 G MAC each, and prints one line of the types' medians: a noisy
host's slow periods fall on all of them alike."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def call_for(t: str, n: int, k: int, g: torch.Generator):
    if t in ("int4", "int8"):
        from fitserve.kernels.cpu.qlinear import hold, int4_linear, int8_linear
        s = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        if t == "int4":
            mins = (torch.rand(n, k // 32, generator=g) * -0.08).half()
            q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            held = hold(q, s, mins, 32)
            return lambda x: int4_linear(x, *held, 32, True)
        q8 = torch.randint(-127, 127, (n, k), dtype=torch.int8, generator=g)
        h8 = hold(q8, s, None, 32)
        return lambda x: int8_linear(x, h8[0], h8[1], 32, True)
    from bench_ggml_blocks import random_blocks

    from fitserve.kernels.cpu.ggml_blocks import ggml_matmul
    w = random_blocks(t, n, k, np.random.default_rng(0))
    return lambda x: ggml_matmul(x, w, t, n, k)


def interleaved(types: list[str], shapes: list[str], ms: list[int], g: torch.Generator,
                rounds: int = 7) -> None:
    for shape in shapes:
        n, k = (int(v) for v in shape.split("x"))
        fns = {t: call_for(t, n, k, g) for t in types}
        for m in ms:
            x = torch.randn(m, k, generator=g).bfloat16()
            rates: dict[str, list[float]] = {t: [] for t in types}
            reps = max(2, int(3e8 / (n * k * m)))
            for _ in range(rounds):
                for t in types:
                    fns[t](x)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fns[t](x)
                    rates[t].append(n * k * m * reps / (time.perf_counter() - t0) / 1e9)
            print(f"{shape} M={m} " + "  ".join(f"{t} {statistics.median(v):6.1f}"
                                               for t, v in rates.items()) + " G MAC/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="IQ4_XS,IQ4_NL,Q4_K,int4")
    ap.add_argument("--shapes", default="2048x2048,2048x8192", help="N x K, comma-separated")
    ap.add_argument("--ms", default="16,32,128,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--interleave", action="store_true",
                    help="alternate the types within each (shape, M); one line of medians each")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    if args.interleave:
        return interleaved(args.types.split(","), args.shapes.split(","),
                           [int(v) for v in args.ms.split(",")], g)
    for t in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            fn = call_for(t, n, k, g)
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, generator=g).bfloat16()
                fn(x)
                times = []
                for _ in range(max(3, int(2e9 / (n * k * m)))):
                    t0 = time.perf_counter()
                    fn(x)
                    times.append(time.perf_counter() - t0)
                print(f"{t} {n}x{k} M={m} {n * k * m / statistics.median(times) / 1e9:.1f} G MAC/s",
                      flush=True)


if __name__ == "__main__":
    main()
