"""W1 (one sequence, greedy) on bench_moe.py's GGUF as CPU time per token: fitserve vs llama.cpp
on one thread each, for a loaded host where wall-clock rates mean nothing.

    .venv/bin/python benchmarks/bench_moe_cpu.py                         # small shape, Q4_K_M
    .venv/bin/python benchmarks/bench_moe_cpu.py --file PATH --rounds 3

With one thread every op of a step runs on the calling thread (torch intra-op with 1 thread;
ggml's graph with n_threads 1), so ``time.thread_time`` around a step is the CPU the token
costs, whatever else the host runs. fitserve: ``Engine.step()`` of a decode step (forward,
lm_head, greedy argmax, scheduler, as stored: ``--weights as-stored``, bf16); llama.cpp
(llama-cpp-python): ``Llama.eval([token])`` (forward and logits, no sampling). Both after a
32-token prompt and 4 warm-up tokens, medians over --tokens tokens; the engines alternate
--rounds times in fresh processes (each figure the median of the rounds' medians). Also prints
the fitserve worker's decode-loop counts (how many steps took the flat loop / decode_layers).
The file is bench_moe.py's (run it once first to write and quantize it).
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
PROMPT = list(range(100, 132))


def fitserve_worker(path: str, tokens: int) -> dict[str, float | int | None]:
    import torch

    torch.set_num_threads(1)
    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    engine = Engine(EngineConfig(model=path, dtype="bfloat16", weights="as-stored", device="cpu",
                                 max_model_len=1024))
    engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=tokens + 8,
                                              ignore_eos=True))
    cpu: list[float] = []
    for i in range(tokens + 5):  # the prompt step, 4 warm-up steps, then the timed ones
        c = time.thread_time()
        engine.step()
        if i >= 5:
            cpu.append(time.thread_time() - c)
    loop = engine.runner.decode_loop
    return {"cpu_ms": statistics.median(cpu) * 1e3, "loop_calls": loop and loop.calls,
            "native_calls": loop and loop.native_calls}


def llamacpp_worker(path: str, tokens: int) -> dict[str, float | int | None]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=1, n_threads_batch=1, n_ctx=1024, verbose=False)
    llm.eval(PROMPT)
    cpu: list[float] = []
    for i in range(tokens + 4):
        c = time.thread_time()
        llm.eval([7 + i])
        if i >= 4:
            cpu.append(time.thread_time() - c)
    return {"cpu_ms": statistics.median(cpu) * 1e3}


def run(python: str, engine: str, path: Path, tokens: int) -> dict[str, float] | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([python, __file__, "--worker", engine, "--file", str(path),
                           "--tokens", str(tokens)], capture_output=True, text=True, env=env,
                          timeout=1200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"{engine} worker failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def loadavg() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default=None, help="a GGUF (default: bench_moe's small Q4_K_M)")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    ap.add_argument("--worker", choices=["fitserve", "llama.cpp"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        work = fitserve_worker if args.worker == "fitserve" else llamacpp_worker
        print(json.dumps(work(args.file, args.tokens)))
        return
    from fitserve.envs import fitserve_home

    path = Path(args.file) if args.file else fitserve_home() / "bench/moe-small-q4_k_m.gguf"
    if not path.is_file():
        sys.exit(f"no {path}: run benchmarks/bench_moe.py (--shape small) first to write it")
    print(f"{path.name}: W1 CPU ms per token, one thread each; load average {loadavg()}")
    rows: dict[str, list[float]] = {"fitserve": [], "llama.cpp": []}
    for r in range(args.rounds):
        for engine, python in (("fitserve", sys.executable), ("llama.cpp", args.llamacpp_python)):
            res = run(python, engine, path, args.tokens)
            if res is None:
                continue
            rows[engine].append(res["cpu_ms"])
            extra = {k: v for k, v in res.items() if k != "cpu_ms"}
            print(f"  round {r + 1} {engine:<10} {res['cpu_ms']:6.2f} ms  {extra or ''}"
                  f"  (load {loadavg()})")
    fs, ll = (statistics.median(v) if v else float("nan") for v in rows.values())
    print(f"fitserve {fs:.2f} ms ({1e3 / fs:.0f} tok/s of CPU), llama.cpp {ll:.2f} ms "
          f"({1e3 / ll:.0f} tok/s of CPU): fitserve at {ll / fs:.2f}x llama.cpp's rate")


if __name__ == "__main__":
    main()
