"""The decoder layer's fused C++ ops (fitserve/kernels/cpu/fused_ops.cpp) at the default
model's shapes: rms_norm, add_rms_norm_ and silu_and_mul at a W2 prefill chunk (2,048 rows), a
batch-32 decode step and one row.

    PYTHONPATH=$PWD python benchmarks/bench_fused_ops.py [--threads 2]

Wall clock at --threads, the median of 7 passes of n calls. Run it in two trees (PYTHONPATH)
one after the other to compare them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_engine import cpu_description  # noqa: E402

from fitserve.kernels.cpu import fused  # noqa: E402

HIDDEN, INTER = 576, 1536  # SmolLM2-135M


def median_us(call, n: int) -> float:
    call()
    times = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            call()
        times.append((time.perf_counter() - t) / n)
    return sorted(times)[3] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}; {args.threads} thread(s); "
          f"fused ops {'built' if fused.fused_ops_available() else 'NOT built (torch path)'}")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(HIDDEN, generator=gen).bfloat16()
    for rows, n in ((2048, 50), (32, 2000), (1, 5000)):
        x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
        res = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
        gu = torch.randn(rows, 2 * INTER, generator=gen).bfloat16()
        norm = median_us(lambda x=x: fused.rms_norm(x, w, 1e-5), n)
        add_norm = median_us(lambda x=x, res=res: fused.add_rms_norm_(res, x, w, 1e-5), n)
        silu = median_us(lambda gu=gu: fused.silu_and_mul(gu), n)
        print(f"{rows:5d} rows: rms_norm {norm:8.1f} us  add_rms_norm_ {add_norm:8.1f} us  "
              f"silu_and_mul [{rows}, {2 * INTER}] {silu:8.1f} us", flush=True)

if __name__ == "__main__":
    main()
