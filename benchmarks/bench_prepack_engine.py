"""The engine with and without the M > 1 layout made at load (FITSERVE_PREPACK_PANELS=1 / 0).

Default model (SmolLM2-135M Q4_1 as stored, bf16), one thread, process CPU time (a loaded
host's waits do not count), the two settings alternating in fresh processes, min over rounds:

- TTFT of a 2,048-token prompt (bench_prefill.py's text), min of 3 per process;
- W2-like: 32 requests of 32 random tokens, 64 new tokens each, CPU ms per generated token.

    python benchmarks/bench_prepack_engine.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def worker() -> dict[str, float]:
    import torch

    from benchmarks.bench_prefill import TEXT
    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.loading import load_tokenizer
    from fitserve.loading.pull import pull
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(1)
    gguf = str(pull("smollm2-135m", progress=False))
    ids = load_tokenizer(gguf).encode(TEXT * 4, add_special_tokens=False)[:2048]
    engine = Engine(EngineConfig(model=gguf, dtype="bfloat16", weights="as-stored",
                                 device="cpu", max_model_len=2048 + 64, enforce_eager=True))

    def ttft() -> float:
        engine.reset_prefix_cache()
        c0 = time.process_time()
        for _ in engine.stream(ids, SamplingParams(temperature=0.0, max_tokens=1,
                                                   ignore_eos=True)):
            pass
        return time.process_time() - c0

    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(100, 40000, (32,), generator=gen).tolist() for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    def w2() -> float:
        engine.reset_prefix_cache()
        for p in batch:
            engine.add_request(p, params)
        c0, total = time.process_time(), 0
        while engine.has_unfinished_requests():
            total += sum(len(o.delta_token_ids) for o in engine.step())
        return (time.process_time() - c0) / total

    ttft(), w2()
    return {"ttft_s": min(ttft() for _ in range(3)), "w2_s_per_token": min(w2() for _ in range(3))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    print(f"load average {os.getloadavg()}; one thread, process CPU time")
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for setting in ("1", "0"):
            env = {**os.environ, "FITSERVE_PREPACK_PANELS": setting,
                   "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            out = subprocess.run([sys.executable, __file__, "--worker"], env=env, cwd=HERE,
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            b = best.setdefault(setting, r)
            for k, v in r.items():
                b[k] = min(b[k], v)
    for setting, name in (("1", "prepacked at load"), ("0", "packed per call")):
        b = best[setting]
        print(f"{name:<18} TTFT 2048 tokens {b['ttft_s']:.2f} CPU s   W2-like "
              f"{1 / b['w2_s_per_token']:.0f} tokens per CPU s")
    print(f"prepacked / per call: TTFT {best['0']['ttft_s'] / best['1']['ttft_s']:.2f}x faster, "
          f"W2-like {best['0']['w2_s_per_token'] / best['1']['w2_s_per_token']:.2f}x; "
          f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
