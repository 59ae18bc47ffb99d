"""Where an engine step's time goes, for the README's "where the time goes" figures.

    .venv/bin/python benchmarks/profile_engine.py [--dtype bf16] [--threads 2]

W1 shape: 1 request decoding (context ~40). W2 shape: 32 requests x 128-token prompts (prefill
timed as the steps until every prompt is in the cache), then batch-32 decode steps. Each decode
figure is the median of 20 steps after warm-up; the op table is torch.profiler's self CPU time
over 5 more steps, grouped by ATen op.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import profile

from fitserve.config import EngineConfig
from fitserve.engine import Engine
from fitserve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def step_ms(engine: Engine, steps: int = 20) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def op_table(engine: Engine, steps: int = 5, top: int = 6) -> str:
    with profile() as prof:
        for _ in range(steps):
            engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    lines = [f"    {'op':<22}{'ms/step':>9}{'share':>8}"]
    for e in events[:top]:
        lines.append(f"    {e.key:<22}{e.self_cpu_time_total / 1e3 / steps:9.2f}{e.self_cpu_time_total / total:8.0%}")
    lines.append(f"    {'(all ops)':<22}{total / 1e3 / steps:9.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = "bfloat16" if args.dtype == "bf16" else "float32"

    engine = Engine(EngineConfig(dtype=dtype, device="cpu", max_model_len=1024))
    engine.add_request("The capital of France is", GREEDY)
    step_ms(engine, 5)
    print(f"W1 decode step ({args.dtype}, {args.threads} threads): {step_ms(engine):.2f} ms median")
    print(op_table(engine))
    del engine

    engine = Engine(EngineConfig(dtype=dtype, device="cpu", max_model_len=1024))
    ids = engine.tokenizer.encode("The history of computing is long. " * 40, add_special_tokens=False)
    for i in range(32):
        engine.add_request(ids[i : i + 128], GREEDY)
    t = time.perf_counter()
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) \
            or engine.scheduler.num_waiting:
        engine.step()
    print(f"W2 prefill of 32 x 128 tokens: {time.perf_counter() - t:.2f} s")
    step_ms(engine, 3)
    print(f"W2 decode step (batch 32): {step_ms(engine):.2f} ms median")
    print(op_table(engine))


if __name__ == "__main__":
    main()
