"""The scheduler + KV manager's own cost per step (no model): W2's shape with a fake sampler,
for a full-attention model (one group) and a Gemma-3-shaped hybrid (full + windowed groups).

    python benchmarks/bench_sched_step.py [--repeats 5]

Prints the median microseconds per step of each after a warm-up run. Torch-free.
"""

from __future__ import annotations

import argparse
import statistics
import time

from fitserve.config import SchedulerConfig
from fitserve.kv.group import KVGroup
from fitserve.kv.manager import KVCacheManager
from fitserve.sched.request import SchedRequest
from fitserve.sched.scheduler import Scheduler


def one_run(kv: KVCacheManager, seqs: int = 32, prompt: int = 128, new: int = 128) -> float:
    """Microseconds per step of ``seqs`` requests of ``prompt`` + ``new`` tokens."""
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=seqs, max_model_len=1024)
    s = Scheduler(cfg, kv)
    for i in range(seqs):
        s.add_request(SchedRequest(f"r{i}", [i * 7 + j for j in range(prompt)], new))
    steps = 0
    t0 = time.perf_counter()
    while s.has_unfinished():
        out = s.schedule()
        sampled = {c.request_id: 5 for c in out.chunks if c.sample}
        s.update(out, sampled)
        for rid in sampled:
            r = s.get(rid)
            if r is not None and len(r.output_token_ids) >= r.max_tokens:
                s.finish(rid)
        steps += 1
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    makers = {
        "full (1 group)": lambda: KVCacheManager(4096, 16),
        "hybrid (full + window 64)": lambda: KVCacheManager.from_groups(
            [KVGroup("full", 4096, None), KVGroup("sliding", 4096, 64)], 16),
    }
    for name, make in makers.items():
        one_run(make())  # warm-up
        times = [one_run(make()) for _ in range(args.repeats)]
        print(f"{name:28s} {statistics.median(times):8.0f} us/step (median of {args.repeats})")


if __name__ == "__main__":
    main()
