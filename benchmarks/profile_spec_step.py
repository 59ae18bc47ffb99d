"""Target step time by chunk shape with speculative decoding: a plain decode step vs a
verification step of k + 1 tokens, at batch 1 on the default model (the cost the planner's
roofline does not see: it prices verification rows as free while the step is memory-bound).

    .venv/bin/python benchmarks/profile_spec_step.py [--k 4] [--repeats 3] [--threads 2]

Greedy n-gram speculation on a prompt that repeats itself verbatim (every draft is accepted,
so most steps verify k drafts) and on free text (most steps decode one token); each model step
is timed inside the runner (forward, logits, sampling / verification), grouped by the token
count of its one chunk, medians printed with their ratio to the 1-token step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.kernels.cpu.isa import cpu_model_name
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(device="cpu", max_model_len=1024,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": args.k}))
    tok = engine.tokenizer
    times: dict[int, list[float]] = {}
    execute = engine.runner.execute

    def timed(plan, states):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        result = execute(plan, states)
        if len(plan.chunks) == 1:
            times.setdefault(len(plan.chunks[0].token_ids), []).append(time.perf_counter() - t0)
        return result

    engine.runner.execute = timed  # type: ignore[method-assign]
    prompts = [tok.encode(" the cat sat on the mat.", add_special_tokens=False) * 12,
               tok.encode("Tell me a story about a dragon.")]
    for _ in range(args.repeats):
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"CPU: {cpu_model_name()} ({isa}), {args.threads} threads; SmolLM2-135M Q4_1 as stored, batch 1\n")
    print("| chunk tokens | steps | median ms | x 1-token step |\n|---|---|---|---|")
    one = statistics.median(times[1])
    for n in sorted(times):
        if n <= args.k + 1 and len(times[n]) >= 3:
            med = statistics.median(times[n])
            print(f"| {n} | {len(times[n])} | {1e3 * med:.2f} | x{med / one:.2f} |")


if __name__ == "__main__":
    main()
