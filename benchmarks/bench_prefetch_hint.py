"""The streamed weight / KV rows' software prefetch into L2 (the default) or L1: both measured on
this CPU (fitserve/kernels/cpu/stream_prefetch.h reads FITSERVE_PREFETCH_HINT when an extension
loads, so each hint runs in its own worker process; the hints alternate for --rounds).

    .venv/bin/python benchmarks/bench_prefetch_hint.py [--rounds 3] [--threads 2]
        [--w1 q4_1,bf16,fp8] [--gguf FILE ...] [--no-kernels]

Kernels (one row of x, weights rotated through 256 MB so every call reads DRAM, median GB/s of
the passes): the held int8 / int4 GEMV (the default model's lm_head and MLP shapes, SmolLM2-1.7B's
gate_up), the bf16 and fp8 GEMVs. W1: decode tok/s of 128 greedy tokens after a 32-token prompt
(median of --runs), on the default model per --w1 config and on each --gguf file as stored.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

HINTS = ("l2", "l1")
HELD = (("int8 lm_head", 49152, 576, "int8"), ("int4 gate_up", 3072, 576, "int4"),
        ("int4 down", 576, 1536, "int4"), ("int4 1.7B gate_up", 8192, 2048, "int4"))
DENSE = (("bf16 gate_up", 3072, 576, "bf16"), ("bf16 lm_head", 49152, 576, "bf16"),
         ("fp8 gate_up", 3072, 576, "fp8"), ("fp8 lm_head", 49152, 576, "fp8"))
WEIGHTS = {"q4_1": "as-stored", "bf16": "bf16", "fp8": "fp8"}


def kernel_rates(passes: int) -> dict[str, float]:
    import torch

    from fitserve.kernels.cpu.dense_gemv import bf16_gemv_available
    from fitserve.kernels.cpu.fp8_gemv import fp8_gemv_available, fp8_linear
    from fitserve.kernels.cpu.qlinear import hold, qlinear_ops_available

    ops, out = torch.ops, {}
    for label, n, k, fmt in HELD + DENSE:
        g = k // 32
        per = {"int8": n * k, "int4": n * k // 2, "bf16": 2 * n * k, "fp8": n * k}[fmt]
        calls = []
        for _ in range(max(2, (256 << 20) // per)):
            if fmt == "int8" and qlinear_ops_available():
                q, s, _m = hold(torch.randint(-127, 127, (n, k), dtype=torch.int8),
                                (torch.rand(n, g) + 0.5).half(), None, 32)
                calls.append(lambda x, q=q, s=s: ops.fitserve.int8_linear(x, q, s, 32, True))
            elif fmt == "int4" and qlinear_ops_available():
                q, s, m = hold(torch.randint(0, 255, (n, k // 2), dtype=torch.uint8),
                               (torch.rand(n, g) + 0.5).half(), (torch.rand(n, g) - 0.5).half(), 32)
                calls.append(lambda x, q=q, s=s, m=m:
                             ops.fitserve.int4_linear(x, q, s, m, 32, True))
            elif fmt == "bf16" and bf16_gemv_available():
                w = torch.randn(n, k).bfloat16()
                calls.append(lambda x, w=w: ops.fitserve_dense.bf16_gemv(x, w, None))
            elif fmt == "fp8" and fp8_gemv_available():
                c = torch.randn(n, k).to(torch.float8_e4m3fn).view(torch.uint8)
                s = torch.rand(n) + 0.5
                calls.append(lambda x, c=c, s=s: fp8_linear(x, c, s, "e4m3", "channel", 0, None))
        if not calls:
            continue
        x = torch.randn(1, k).bfloat16()
        times = []
        for _ in range(passes):
            t = time.perf_counter()
            for f in calls:
                f(x)
            times.append(time.perf_counter() - t)
        out[label] = len(calls) * per / statistics.median(times) / 1e9
    return out


def w1_rate(model: str, weights: str, runs: int) -> float:
    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    engine = Engine(EngineConfig(model=model, dtype="bfloat16", weights=weights, device="cpu",
                                 max_model_len=1024))
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    prompt = list(range(100, 132))
    rates = []
    for i in range(runs + 1):
        engine.reset_prefix_cache()
        stamps = [time.perf_counter() for out in engine.stream(prompt, params)
                  for _ in out.delta_token_ids]
        if i:  # the first run warms up
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return statistics.median(rates)


def worker(spec: dict) -> dict[str, float]:
    import torch

    torch.set_num_threads(spec["threads"])
    out = kernel_rates(spec["passes"]) if spec["kernels"] else {}
    for cfg in spec["w1"]:
        out[f"W1 {cfg} (tok/s)"] = w1_rate(spec["default_gguf"], WEIGHTS[cfg], spec["runs"])
    for path in spec["gguf"]:
        out[f"W1 {Path(path).name} (tok/s)"] = w1_rate(path, "as-stored", spec["runs"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=7, help="kernel passes per worker")
    ap.add_argument("--runs", type=int, default=3, help="W1 runs per worker")
    ap.add_argument("--w1", default="q4_1,bf16,fp8", help="default-model configs ('' for none)")
    ap.add_argument("--gguf", nargs="*", default=[], help="more models for W1, as stored")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    from bench_engine import cpu_description

    from fitserve.loading.pull import pull

    spec = {"threads": args.threads, "passes": args.passes, "runs": args.runs,
            "kernels": not args.no_kernels, "w1": [c for c in args.w1.split(",") if c],
            "gguf": args.gguf, "default_gguf": str(pull("smollm2-135m", progress=False))}
    print(cpu_description(), f"; {args.threads} threads; {args.rounds} rounds, hints alternated",
          flush=True)
    results: dict[str, dict[str, list[float]]] = {h: {} for h in HINTS}
    for r in range(args.rounds):
        for hint in HINTS:
            env = {**os.environ, "FITSERVE_PREFETCH_HINT": hint}
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                  env=env, capture_output=True, text=True, check=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
            for key, v in json.loads(line).items():
                results[hint].setdefault(key, []).append(v)
            print(f"  round {r + 1} {hint} done", flush=True)
    print("| measure | L2 (prefetcht1, default) | L1 (prefetcht0) | L2 / L1 | per round L2 / L1 |")
    print("|---|---:|---:|---:|---|")
    for key, v2 in results["l2"].items():
        v1 = results["l1"][key]
        per = " ".join(f"{a / b:.2f}" for a, b in zip(v2, v1, strict=True))
        m2, m1 = statistics.median(v2), statistics.median(v1)
        unit = "" if "tok/s" in key else " GB/s"
        print(f"| {key} | {m2:.1f}{unit} | {m1:.1f}{unit} | {m2 / m1:.2f} | {per} |")


if __name__ == "__main__":
    main()
