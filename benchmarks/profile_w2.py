"""Where a W2 run's time goes on a GGUF file as stored: prefill steps against decode steps, and
the ops that take it (torch.profiler, self CPU time summed over one whole W2 run).

    .venv/bin/python benchmarks/profile_w2.py ~/.cache/fitserve/bench/formats-1.7b-iq4_xs.gguf
    .venv/bin/python benchmarks/profile_w2.py MODEL --threads 2 --rows 12

W2 as bench_engine.py / bench_formats.py run it: its 32 x 128-token prompts (the same token ids),
128 new tokens each, greedy, EOS ignored, the KV pool llama.cpp's context for them
(``peer_context_blocks``: no preemption). One warm-up run, then one timed run (each
``engine.step()`` by the wall clock: a step with prompt tokens in its ``step_log`` record counts
as prefill), then
one run under the profiler. Prints the run's tok/s, the prefill and decode steps' totals and the
median decode step, and the top ``--rows`` ops by self CPU time. A profile, not a speed figure:
the profiled run is slower than the timed one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine as be  # noqa: E402  (the W2 token ids and the peer's KV context)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF file (held as stored)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=12, help="ops printed")
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from fitserve.config import CacheConfig, EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    spec = be.workload_spec(args.threads, 1, 32)
    blocks = be.peer_context_blocks(spec, CacheConfig().block_size)
    engine = Engine(EngineConfig(model=args.model, dtype="bfloat16", weights="auto",
                                 device="cpu", max_model_len=1024, num_kv_blocks=blocks))
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)

    def run() -> tuple[float, list[tuple[bool, float]], int]:
        engine.reset_prefix_cache()
        for p in spec["w2_batch"]:
            engine.add_request(p, params)
        steps: list[tuple[bool, float]] = []
        tokens = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            steps.append((engine.step_log[-1].num_prefill_tokens > 0, time.perf_counter() - t0))
            tokens += sum(len(o.delta_token_ids) for o in outs)
        return time.perf_counter() - start, steps, tokens

    run()
    total, steps, tokens = run()
    pre = [t for p, t in steps if p]
    dec = [t for p, t in steps if not p]
    print(f"{args.model}: W2 {tokens / total:.1f} tok/s ({tokens} tokens in {total:.1f} s, "
          f"{args.threads} threads); prefill steps {len(pre)} {sum(pre):.1f} s "
          f"({sum(pre) / total:.0%}), decode steps {len(dec)} {sum(dec):.1f} s "
          f"(median {statistics.median(dec) * 1e3 if dec else float('nan'):.0f} ms); "
          f"KV {blocks} blocks")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    whole = sum(e.self_cpu_time_total for e in events)
    print(f"{'op':<40}{'self s':>9}{'share':>7}{'calls':>8}")
    for e in events[:args.rows]:
        print(f"{e.key[:39]:<40}{e.self_cpu_time_total / 1e6:9.2f}"
              f"{e.self_cpu_time_total / whole:7.0%}{e.count:8d}")


if __name__ == "__main__":
    main()
