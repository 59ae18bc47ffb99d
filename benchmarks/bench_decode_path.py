"""One batch-1 decode step on each of its three paths, same engine, alternating in one process:

    module         CausalLM.forward (every linear through its nn.Module)
    python-loop    fitserve.runner.decode_loop.DecodeLoop with native = False
    decode_layers  the same loop in C++ (torch.ops.fitserve_step.decode_layers), where its plan
                   binds every linear of the shape class (else the Python loop runs again)

Per path, CPU time of this thread per step (time.thread_time, torch on ONE thread: a loaded
host's other processes do not count, and no 2-thread barrier waits on a descheduled thread),
medians of --rounds rounds of --steps steps each, the paths interleaved round by round. The
three are the same ops in the same order (tests/numerics/test_decode_loop.py checks the bits);
what differs is the Python around them. The peer is the module path in the same run.

    python benchmarks/bench_decode_path.py MODEL[@WEIGHTS] ...   (default: the default model's
        Q4_1 file as stored, @fp8 and @bf16)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fitserve.config import EngineConfig  # noqa: E402
from fitserve.engine.core import Engine  # noqa: E402
from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa  # noqa: E402
from fitserve.runner.model_runner import decode_rows_first  # noqa: E402
from fitserve.types import ScheduledChunk  # noqa: E402

PATHS = ("module", "python-loop", "decode_layers")


def step_times(model: str, weights: str, rounds: int, steps: int) -> tuple[dict[str, float], int]:
    """Median ms of CPU per decode step on each path, and how many steps decode_layers ran."""
    eng = Engine(EngineConfig(model=model, dtype="bfloat16", device="cpu", weights=weights,  # type: ignore[arg-type]
                              max_model_len=256, num_kv_blocks=64, block_size=16))
    r = eng.runner
    loop = r.decode_loop
    if loop is None:
        raise SystemExit(f"{model}@{weights}: the engine runs no decode loop")
    prompt, table = list(range(5, 37)), list(range(1, 17))
    r.forward_chunks([ScheduledChunk("a", prompt, 0, table, sample=False)])
    chunks = decode_rows_first([ScheduledChunk("a", [9], len(prompt), table, sample=False)])
    ids, pos, batch = r._prepare(chunks)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    with torch.inference_mode():
        for it in range(rounds + 2):  # two warm-up rounds
            for path in PATHS:
                loop.native = path == "decode_layers"
                t0 = time.thread_time()
                for _ in range(steps):  # the same position each time: the same work
                    if path == "module":
                        r.model(ids, pos, batch, r.kv_caches)
                    else:
                        loop(ids, pos, batch, r.kv_caches)
                if it >= 2:
                    times[path].append((time.thread_time() - t0) / steps * 1e3)
    return {p: statistics.median(v) for p, v in times.items()}, loop.native_calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", help="GGUF path, optionally @weights (fp8, bf16, ...)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = args.models
    if not models:
        from fitserve.loading.pull import pull

        gguf = str(pull("smollm2-135m", progress=False))
        models = [gguf, f"{gguf}@fp8", f"{gguf}@bf16"]
    print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; load average "
          f"{os.getloadavg()[0]:.1f} at the start; 1 thread, ms of CPU per batch-1 decode step, "
          f"medians of {args.rounds} rounds x {args.steps} steps")
    print(f"{'model':<40}" + "".join(f"{p:>15}" for p in PATHS) + f"{'module/native':>15}"
          + f"{'native steps':>13}")
    for spec in models:
        model, _, weights = spec.partition("@")
        med, native = step_times(model, weights or "auto", args.rounds, args.steps)
        name = f"{Path(model).name}@{weights or 'as-stored'}"
        print(f"{name[-40:]:<40}" + "".join(f"{med[p]:15.2f}" for p in PATHS)
              + f"{med['module'] / med['decode_layers']:14.2f}x{native:13d}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
