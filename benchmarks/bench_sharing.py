"""KV sharing in the engine: n=4 on one prefill vs four separate requests, and 4 beams over one
prompt with shared copy-on-write blocks vs a cache per beam, beside what the planner prints.

    .venv/bin/python benchmarks/bench_sharing.py [--prompt 1000] [--new 64] [--k 4] [--runs 3]

The default model (Q4_1 as stored), each configuration in its own process, one warm-up request
first. Part 1 runs one prompt of --prompt tokens with --k samples (temperature 0.8, seeded,
--new tokens each, EOS ignored) as one request with n=k, and as k separate requests queued at
once, with prefix caching on (the default: a later request may still hit the blocks an earlier
one registered) and off. Printed: prompt tokens the engine computed (the scheduler's chunks),
wall time (median of --runs) and the most KV blocks held at once. Part 2 runs a beam search of
width --k and, for comparison, k separate sequences of the same lengths with caching off (each
keeping its own cache, the unshared algorithm), and prints their peak blocks and bytes beside
``fitserve plan --share k --prompt-tokens P --new-tokens T``'s two lines.
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
    from fitserve.sampling.beam_search import BeamSearchParams

    torch.set_num_threads(spec["threads"])
    engine = Engine(EngineConfig(device="cpu", max_model_len=2048, enable_prefix_caching=spec["caching"]))
    stats = {"prompt": 0, "peak": 0}
    schedule = engine.scheduler.schedule
    P, T, k = spec["prompt"], spec["new"], spec["k"]

    def counting_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        stats["prompt"] += sum(max(0, min(c.start_pos + len(c.token_ids), P) - c.start_pos) for c in out.chunks)
        return out

    engine.scheduler.schedule = counting_schedule  # type: ignore[method-assign]

    def run(salt: int) -> dict[str, float]:
        prompt = [100 + (salt * 7919 + i * 104729) % 40000 for i in range(P)]
        sample = [SamplingParams(temperature=0.8, seed=salt + j, max_tokens=T, ignore_eos=True) for j in range(k)]
        if spec["mode"] == "n":
            engine.add_requests(prompt, sample)
        elif spec["mode"] == "separate":
            for p in sample:
                engine.add_request(prompt, p)
        elif spec["mode"] == "beams":
            engine.add_beam_search(prompt, BeamSearchParams(beam_width=k, max_tokens=T, ignore_eos=True))
        stats["prompt"] = stats["peak"] = 0
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            stats["peak"] = max(stats["peak"], engine.kv.stats().used_blocks)
        return {"wall_s": time.perf_counter() - t0, "prompt_tokens": stats["prompt"], "peak_blocks": stats["peak"]}

    run(10_000)  # warm-up (a different prompt: nothing of it is cached for the timed runs)
    runs = []
    for r in range(spec["runs"]):
        engine.reset_prefix_cache()
        runs.append(run(r))
    out = {key: statistics.median(x[key] for x in runs) for key in runs[0]}
    out["block_bytes"] = engine.pool.block_bytes
    out["block_size"] = engine.config.cache.block_size
    return out


def planner(k: int, prompt: int, new: int) -> dict[str, int]:
    cmd = [sys.executable, "-m", "fitserve.cli", "plan", "smollm2-135m", "--share", str(k),
           "--prompt-tokens", str(prompt), "--new-tokens", str(new), "--json"]
    plan = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    section = next(s for s in plan["sections"] if s["title"].startswith("KV sharing"))
    return {line["name"]: line["value"] for line in section["lines"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fitserve.kernels.cpu.isa import cpu_model_name

    base = {"prompt": args.prompt, "new": args.new, "k": args.k, "runs": args.runs, "threads": args.threads}
    configs = [(f"n={args.k}, one request", "n", True), (f"{args.k} separate, caching on", "separate", True),
               (f"{args.k} separate, caching off", "separate", False),
               (f"beam search, width {args.k}", "beams", True)]
    results = {}
    for name, mode, caching in configs:
        spec = {**base, "mode": mode, "caching": caching}
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"CPU: {cpu_model_name()}, {args.threads} threads; SmolLM2-135M Q4_1 as stored; "
          f"prompt {args.prompt} tokens, {args.new} new each, medians of {args.runs}\n")
    print("## n samples on one prefill\n")
    print("| run | prompt tokens computed | wall s | peak KV blocks |\n|---|---|---|---|")
    for name, _, _ in configs[:3]:
        r = results[name]
        print(f"| {name} | {r['prompt_tokens']:,} | {r['wall_s']:.2f} | {r['peak_blocks']:,} |")
    one, sep = results[configs[0][0]], results[configs[2][0]]
    print(f"\nn={args.k}: x{sep['wall_s'] / one['wall_s']:.2f} faster than {args.k} separate requests "
          f"(caching off), x{sep['prompt_tokens'] / one['prompt_tokens']:.2f} fewer prompt tokens\n")
    plan = planner(args.k, args.prompt, args.new)
    beams, dense = results[configs[3][0]], results[configs[2][0]]  # k own caches: same lengths
    bb = beams["block_bytes"]
    mib = 1024 * 1024
    print(f"## {args.k} beams over one {args.prompt}-token prompt: KV held (block = {beams['block_size']} "
          f"tokens, {bb:,} B)\n")
    print("| | engine blocks | engine MiB | planner blocks | planner MiB |\n|---|---|---|---|---|")
    print(f"| shared (beam search, copy-on-write) | {beams['peak_blocks']:,} | {beams['peak_blocks'] * bb / mib:.2f} "
          f"| {plan['blocks, shared']:,} | {plan['KV bytes, shared'] / mib:.2f} |")
    print(f"| unshared ({args.k} own caches) | {dense['peak_blocks']:,} | {dense['peak_blocks'] * bb / mib:.2f} "
          f"| {plan['blocks, unshared']:,} | {plan['KV bytes, unshared'] / mib:.2f} |")
    print(f"\nbeam search wall {beams['wall_s']:.2f} s")


if __name__ == "__main__":
    main()
