"""How much of a W1 step's weight stream the last-level cache serves: the default model's linears
run back to back (as a decode step runs them, one row of x each) with and without an eviction
pass between the passes, and the engine's one-row weight-stream probe (fitserve.engine.cpu_rates)
cycled over working sets of several sizes.

    .venv/bin/python benchmarks/bench_llc_residency.py [--threads 2] [--runs 15]

On a CPU whose cache keeps part of a model between tokens, W1 reads faster than the kernels
stream from DRAM, so "% of the bandwidth limit" overstates the kernels' DRAM efficiency and a
planner that prices every byte at the DRAM rate under-predicts W1. Wall clock, medians; passes
with and without eviction alternate, so a slow period of a shared host falls on both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EVICT_BYTES = 512 << 20


def timed_calls(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--sizes-mib", default="16,32,48,64,96,192",
                    help="working sets of the one-row probe (MiB of weights cycled)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from fitserve.config import EngineConfig
    from fitserve.engine import cpu_rates
    from fitserve.engine.core import Engine
    from fitserve.ledger.cpu_measure import cpu_model
    from fitserve.loading.pull import pull
    from fitserve.model.linear import PackedLinear

    engine = Engine(EngineConfig(model=str(pull("smollm2-135m", progress=False)),
                                 dtype="bfloat16", device="cpu", max_model_len=1024))
    mods = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
    xs = [torch.randn(1, m.in_features).bfloat16() for m in mods]
    held = sum(t.numel() * t.element_size() for m in mods
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)] if t.dim())
    junk = torch.ones(EVICT_BYTES, dtype=torch.uint8)

    def one_pass() -> float:
        t0 = time.perf_counter()
        for m, x in zip(mods, xs, strict=True):
            m(x)
        return time.perf_counter() - t0

    one_pass()
    kept, evicted = [], []
    for _ in range(args.runs):
        kept.append(one_pass())
        junk.add_(1)  # reads and writes 512 MiB: past the caches of every CPU seen here
        evicted.append(one_pass())
    print(f"CPU: {cpu_model()}; {args.threads} threads; default model's {len(mods)} packed "
          f"linears, {held / 1e6:.1f} MB of weights, one row of x each")
    for name, ts in (("back to back", kept), (f"after a {EVICT_BYTES >> 20} MiB pass", evicted)):
        sec = statistics.median(ts)
        print(f"  {name:24s} {sec * 1e3:7.2f} ms  {held / sec / 1e9:5.1f} GB/s")
    print("one-row int4 probe (cpu_rates' int8act GEMV, 2048 x 576, wall clock):")
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        fn = cpu_rates._gemv_calls(576, mib << 20)["int8act"]
        calls = max(1, (mib << 20) // (2048 * 576 // 2))

        timed_calls(fn, calls)
        sec = statistics.median(timed_calls(fn, calls) for _ in range(max(3, args.runs // 3)))
        print(f"  {mib:4d} MiB cycled  {calls * cpu_rates.gemv_weight_bytes('int8act', 576) / sec / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
