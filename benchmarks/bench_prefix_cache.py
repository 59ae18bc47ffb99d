"""Shared-system-prompt workload with automatic prefix caching on vs off, side by side.

    .venv/bin/python benchmarks/bench_prefix_cache.py [--requests 32] [--prefix 1000] [--new 64]

Each engine (the default model, Q4_1 as stored, its own process) serves --requests requests that
share a --prefix-token system prompt, each with its own 32-token question, --new greedy tokens
each (EOS ignored), all queued at once. One warm-up request with the same prefix runs first in
both engines (with caching on it fills the cache, as a server's first request would), then the
timed batch. Printed: wall time, output tok/s, TTFT p50 / p90 (arrival to first token, queueing
included), the prompt tokens the engine prefilled (the scheduler's chunks) and the cache hit
rate in tokens. Medians of --runs runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    engine = Engine(EngineConfig(device="cpu", max_model_len=2048,
                                 enable_prefix_caching=spec["caching"]))
    prefilled = [0]
    schedule = engine.scheduler.schedule

    def counting_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        prefilled[0] += sum(len(c.token_ids) for c in out.chunks if len(c.token_ids) > 1)
        return out

    engine.scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    prefix = [100 + (i * 7919) % 40000 for i in range(spec["prefix"])]
    params = SamplingParams(temperature=0.0, max_tokens=spec["new"], ignore_eos=True)

    def run(n: int, salt: int) -> dict[str, float]:
        ids = [engine.add_request(prefix + [200 + (salt * 131 + i * 977 + j * 31) % 40000
                                            for j in range(32)], params) for i in range(n)]
        before = engine.stats().kv
        prefilled[0] = 0
        t0 = time.perf_counter()
        ttft: dict[str, float] = {}
        tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += len(out.delta_token_ids)
                if out.request_id not in ttft and out.delta_token_ids:
                    ttft[out.request_id] = time.perf_counter() - t0
        wall = time.perf_counter() - t0
        kv = engine.stats().kv
        queries = kv.prefix_cache_queries - before.prefix_cache_queries
        hits = kv.prefix_cache_hits - before.prefix_cache_hits
        times = sorted(ttft[r] for r in ids)
        return {"wall_s": wall, "tok_s": tokens / wall, "ttft_p50_ms": 1e3 * times[len(times) // 2],
                "ttft_p90_ms": 1e3 * times[int(len(times) * 0.9)], "prefilled": prefilled[0],
                "hit_rate": hits / queries if queries else 0.0}

    runs = []
    for k in range(spec["runs"]):
        engine.reset_prefix_cache()
        run(1, 10_000 + k)  # warm-up: one request with the shared prefix
        runs.append(run(spec["requests"], k))
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    from fitserve.kernels.cpu.isa import detect_isa

    results = {}
    for caching in (True, False):
        spec = {"caching": caching, "requests": args.requests, "prefix": args.prefix,
                "new": args.new, "runs": args.runs, "threads": args.threads}
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                               json.dumps(spec)], capture_output=True, text=True, check=True)
        results[caching] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"# {detect_isa().describe()} | {args.threads} threads | {args.requests} requests x "
          f"({args.prefix} shared + 32 own) prompt tokens, {args.new} new each | median of {args.runs}")
    print(f"{'prefix caching':<16}{'wall s':>8}{'out tok/s':>11}{'TTFT p50 ms':>13}"
          f"{'TTFT p90 ms':>13}{'prefilled':>11}{'hit rate':>10}")
    for caching, r in results.items():
        print(f"{'on' if caching else 'off':<16}{r['wall_s']:8.2f}{r['tok_s']:11.1f}"
              f"{r['ttft_p50_ms']:13.0f}{r['ttft_p90_ms']:13.0f}{int(r['prefilled']):11d}"
              f"{r['hit_rate']:10.1%}")
    on, off = results[True], results[False]
    print(f"on vs off: throughput x{on['tok_s'] / off['tok_s']:.2f}, TTFT p50 "
          f"x{off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f} lower")


if __name__ == "__main__":
    main()
