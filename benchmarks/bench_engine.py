"""W1 (single stream) and W2 (offline batch) on the default model: fitserve and its peers.

    .venv/bin/python benchmarks/bench_engine.py                      # every config, every peer found
    .venv/bin/python benchmarks/bench_engine.py --configs q4_1 --peers llamacpp --runs 5 --json out.json
    .venv/bin/python benchmarks/bench_engine.py --configs q4_1 --peers llamacpp --rounds 5

--rounds N runs every engine's worker N times, round-robin (fitserve, then each peer, then
again), so the host's slow periods fall on all of them alike; medians pool every round's runs,
and each round's ratios to each peer are printed beside their median.

Each engine runs in its own process (so its peak RSS is its own; vLLM's is its process tree's,
sampled, as its engine core is a child process) on the same token ids, with the
same thread count, greedy decoding and EOS ignored, one warm-up run, then --runs timed runs;
the tables report medians. W1: 1 request, 32-token prompt, 128 new tokens (TTFT, decode tok/s,
decode as a fraction of the bandwidth limit of the bytes that config reads per token: the
planner's copy bandwidth measured again right before each fitserve worker starts, since a shared
host's bandwidth moves by +-20% within minutes; the planner's cached figure is printed too;
"of read": the same bytes over a plain parallel read's bandwidth measured beside it, the issue's
"measured read bandwidth": the two differ by up to ~20% either way on the CPUs seen here). W2: 32
requests x 128-token prompt x 128 new tokens (generated tok/s, wall clock incl. prefill).
Beside each fitserve config's W1 / W2: the planner's prediction (``fitserve plan --gpu cpu``'s
workload section at these shapes) on the copy bandwidth and the engine's matmul rates and step
overhead (fitserve.engine.cpu_rates) measured right before that worker, and measured/predicted.
--cpu-time (fitserve configs, no peers): one thread, W1 / W2 timed by that thread's CPU clock and
the prediction for one thread: the check that still means something on a loaded host (wall-clock
2-thread runs there wait for a core at every barrier: load 12 read W1 3 tok/s for ~250 quiet).

fitserve configs: q4_1 (the GGUF as stored: Q4_1 blocks, Q8_0 embedding/lm_head), bf16, fp32
(dequantized), fp8 (--weights fp8: dequantized, then e4m3 with per-channel scales); q4_1-compiled / bf16-compiled run decode steps under torch.compile (--compile),
each twice on one fresh compile cache, so their start-up is reported cold and warm. Peers: transformers (always; bf16 on the dequantized weights), llama.cpp
(llama-cpp-python, on the same GGUF) and vLLM's CPU build (bf16, on an HF folder written from
the dequantized GGUF) when their venvs exist (--llamacpp-python / --vllm-python, default
~/peers/<name>/bin/python, recipes in ../shared/PEERS.md); a missing peer is skipped and said so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# NOTE: the workers are this script run again: the checkout's own fitserve, not whatever the
# venv's editable install points at (a worktree's run measured main's code before)
sys.path.insert(0, str(HERE.parent))
TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines "
    "were programmed by rewiring panels; later, stored programs let a single machine perform many "
    "tasks. Compilers translated human-readable code into instructions, operating systems shared "
    "hardware among programs, and networks connected machines across the world. Each layer hid "
    "the complexity below it while exposing new possibilities above. Today, large language models "
    "are served by engines that batch thousands of requests, page their attention caches like "
    "virtual memory, and schedule work token by token to keep accelerators busy. "
) * 8
FITSERVE_CONFIGS = {  # name -> (EngineConfig.dtype, EngineConfig.weights, enforce_eager)
    "q4_1": ("bfloat16", "as-stored", True),
    "as-stored": ("bfloat16", "as-stored", True),  # any GGUF as stored (bench_formats.py)
    "bf16": ("bfloat16", "bf16", True),
    "fp32": ("float32", "float32", True),
    "fp8": ("bfloat16", "fp8", True),  # the GGUF dequantized, then e4m3 codes per channel (RTN)
    # decode steps under torch.compile; run twice on one fresh compile cache (cold, then warm)
    "q4_1-compiled": ("bfloat16", "as-stored", False),
    "bf16-compiled": ("bfloat16", "bf16", False),
}


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_description() -> str:
    from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa

    return f"{cpu_model_name()}; {os.cpu_count()} CPUs; ISA: {detect_isa().describe()}"


# -- workers (each runs in its own process) ---------------------------------------------------
def fitserve_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fitserve.config import CacheConfig, EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    # --cpu-time: one thread, timed by its own CPU clock (a loaded host's other processes do
    # not count); else the wall clock
    clock = time.thread_time if spec.get("cpu_time") else time.perf_counter
    dtype, weights, eager = FITSERVE_CONFIGS[spec["config"]]
    # NOTE: fitserve holds the KV of llama.cpp's context for the same workloads (unless
    # --kv-cache-memory): on the 1.7B shape the 1 GiB default pool held ~5.3k of the 8.7k tokens
    # llama.cpp's W2 context holds, so W2 preempted and recomputed prompts llama.cpp kept
    kv = ({"kv_cache_memory_bytes": spec["kv_cache_memory"]} if spec.get("kv_cache_memory")
          else {"num_kv_blocks": peer_context_blocks(spec, CacheConfig().block_size)})
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=spec["gguf"], dtype=dtype, weights=weights, device="cpu",
                                 max_model_len=1024, enforce_eager=eager, **kv))
    startup = time.perf_counter() - t0
    new = spec["new_tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)

    # NOTE: every timed run starts from an empty prefix cache: the runs repeat the same prompts,
    # and a hit would skip their prefill (the peers recompute theirs)
    def w1() -> tuple[float, float]:
        engine.reset_prefix_cache()
        start = clock()
        times = []
        for out in engine.stream(spec["w1_prompt"], params):
            times += [clock()] * len(out.delta_token_ids)
        assert len(times) == new
        return (times[0] - start) * 1e3, (new - 1) / (times[-1] - times[0])

    def w2() -> float:
        engine.reset_prefix_cache()
        start = clock()
        for p in spec["w2_batch"]:
            engine.add_request(p, params)
        total = 0
        while engine.has_unfinished_requests():
            total += sum(len(o.delta_token_ids) for o in engine.step())
        assert total == new * len(spec["w2_batch"])
        return total / (clock() - start)

    w1()
    r1 = [w1() for _ in range(spec["runs"])]
    r2 = []
    if "w2_batch" in spec:  # absent: W1 only (bench_formats.py without --w2)
        w2()
        r2 = [w2() for _ in range(spec["runs"])]
    model = engine.runner.model
    weight_bytes = sum(t.numel() * t.element_size() for t in
                       {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
                       if t.dim() >= 1 and t.numel() > 0)
    rope = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" in n)
    return {"engine": "fitserve", "config": spec["config"], "startup_s": startup,
            "W1": {"ttft_ms": statistics.median(r[0] for r in r1),
                   "tok_s": statistics.median(r[1] for r in r1), "runs": [r[1] for r in r1]},
            **({"W2": {"tok_s": statistics.median(r2), "runs": r2}} if r2 else {}),
            "weight_bytes_read": weight_bytes - rope, "peak_rss_mib": peak_rss_mib(),
            "kv_blocks": engine.pool.num_blocks,
            "preemptions": engine.scheduler.total_preemptions,  # over every run: 0 expected
            **ledger_kv_runtime(engine)}


def ledger_kv_runtime(engine: Any) -> dict[str, int]:
    """The ledger lines peak RSS is compared with, beside the file's size: the engine's KV pool,
    its step peak (activations, output staging, attention scratch, logits, sampler, allocator
    retention) and RoPE tables, and the runtime baseline (`fitserve plan`'s measured line: the
    engine's own plan does not measure it)."""
    from fitserve.ledger.runtime import runtime_baseline_bytes

    plan = engine.pool.memory_plan
    lines = {ln.name: ln.bytes for ln in plan.lines} if plan else {}
    runtime = lines.get("runtime baseline", 0) or runtime_baseline_bytes() or 0
    return {"ledger_kv_bytes": engine.pool.allocated_bytes, "ledger_runtime_bytes": runtime,
            "ledger_step_bytes": plan.step_bytes if plan else 0,
            "ledger_rope_bytes": lines.get("rope tables", 0),
            "ledger_staging_bytes": lines.get("output staging", 0)}


def transformers_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    path = Path(spec["gguf"])
    if "hf_dir" in spec:  # an HF folder (bench_families.py), in fitserve's dtype of the run
        dtype = torch.float32 if spec["config"] == "fp32" else torch.bfloat16
        hf = transformers.AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=dtype).eval()
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).to(torch.bfloat16).eval()
    new = spec["new_tokens"]

    class Clock:
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: object) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def w1() -> tuple[float, float]:
        clock = Clock()
        start = time.perf_counter()
        hf.generate(torch.tensor([spec["w1_prompt"]]), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, streamer=clock, pad_token_id=0)
        first, last = clock.times[1], clock.times[-1]  # times[0] is the prompt itself
        return (first - start) * 1e3, (new - 1) / (last - first)

    def w2() -> float:
        start = time.perf_counter()
        out = hf.generate(torch.tensor(spec["w2_batch"]), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0)
        assert out.shape[1] == len(spec["w2_batch"][0]) + new
        return len(spec["w2_batch"]) * new / (time.perf_counter() - start)

    with torch.inference_mode():
        w1()
        r1 = [w1() for _ in range(spec["runs"])]
        r2 = [w2() for _ in range(max(1, spec["runs"] - 1))] if "w2_batch" in spec else []
    return {"engine": "transformers", "version": transformers.__version__,
            "W1": {"ttft_ms": statistics.median(r[0] for r in r1),
                   "tok_s": statistics.median(r[1] for r in r1), "runs": [r[1] for r in r1]},
            **({"W2": {"tok_s": statistics.median(r2), "runs": r2}} if r2 else {}),
            "peak_rss_mib": peak_rss_mib()}


def write_hf_folder(gguf: str, out: Path) -> Path:
    """The dequantized GGUF as an HF folder (vLLM reads safetensors, not this Q4_1 file)."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    path = Path(gguf)
    src = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32)
    cfg = src.config
    if hasattr(cfg, "quantization_config"):  # loaded from GGUF: the saved folder is plain bf16
        del cfg.quantization_config
    fresh = transformers.LlamaForCausalLM(cfg)
    fresh.load_state_dict(src.state_dict())
    fresh.to(torch.bfloat16).save_pretrained(str(out))
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
    return out


# -- orchestration ------------------------------------------------------------------------------
def peer_context_blocks(spec: dict[str, Any], block_size: int) -> int:
    """KV blocks for the context llama.cpp's worker allocates for ``spec``'s workloads (W1: 1,024
    tokens; W2: each sequence its prompt + new tokens + 16, kv_unified off:
    peers/llamacpp_worker.py), so that fitserve never preempts where llama.cpp does not."""
    w1 = -(-1024 // block_size)
    batch = spec.get("w2_batch") or []
    w2 = sum(-(-(len(p) + spec["new_tokens"] + 16) // block_size) for p in batch)
    return max(w1, w2)


def workload_spec(threads: int, runs: int, w2_requests: int) -> dict[str, Any]:
    """The workers' common spec: the default model's path and the W1 / W2 token ids (W1: a
    32-token prompt, W2: ``w2_requests`` 128-token prompts; 128 new tokens each)."""
    from fitserve.loading import load_tokenizer
    from fitserve.loading.pull import pull

    gguf = str(pull("smollm2-135m", progress=False))
    ids = load_tokenizer(gguf).encode(TEXT, add_special_tokens=False)
    return {"gguf": gguf, "w1_prompt": ids[:32], "new_tokens": 128, "threads": threads,
            "runs": runs, "w2_batch": [ids[i * 7 : i * 7 + 128] for i in range(w2_requests)]}


# each fitserve config -> the planner's --weights for it (None: the file as stored)
PLAN_WEIGHTS: dict[str, str | None] = {
    "q4_1": None, "as-stored": None, "bf16": "bf16", "fp32": "float32", "fp8": "fp8",
    "q4_1-compiled": None, "bf16-compiled": "bf16"}


def planner_prediction(cfg: str, base: dict[str, Any], read_bw: float, rates: Any,
                       threads: int) -> dict[str, float]:
    """The planner's W1 / W2 for ``cfg`` at this script's own shapes (W1: its prompt, one
    request; W2: its batch), on the read bandwidth and engine rates measured right before the
    worker (``fitserve plan --gpu cpu``'s workload section, with those figures)."""
    from fitserve.ledger.hardware import measured_cpu
    from fitserve.tools.planner.report import PlanRequest, resolve
    from fitserve.tools.planner.sections_workload import run_workload

    hw = measured_cpu(mem_bytes_per_s=read_bw, engine=rates, threads=threads)

    def at(input_len: int, batch: int) -> Any:
        req = PlanRequest(model=base["gguf"], gpu="cpu", context=1024,
                          weights=PLAN_WEIGHTS[cfg], dtype=FITSERVE_CONFIGS[cfg][0],
                          input_len=input_len, output_len=base["new_tokens"], batch_size=batch)
        return run_workload(resolve(req, hw=hw), batch)

    out = {"W1": at(len(base["w1_prompt"]), 1).decode_tokens_per_s}
    if "w2_batch" in base:
        out["W2"] = at(len(base["w2_batch"][0]), len(base["w2_batch"])).tokens_per_s
    return out


def run_worker(cmd: list[str], spec: dict[str, Any], env: dict[str, str] | None = None,
               timeout: float = 1800) -> dict[str, Any] | None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    proc = subprocess.run([*cmd, f.name], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
                              **(env or {})})
    os.unlink(f.name)
    if proc.returncode != 0:
        print(f"  worker {' '.join(cmd[-3:])} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    # the last JSON line: peers (vLLM) also log to stdout
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        print(f"  worker {' '.join(cmd[-3:])} printed no result:\n{proc.stdout[-2000:]}",
              file=sys.stderr)
        return None
    return json.loads(lines[-1])


def fitserve_job(me: list[str], base: dict[str, Any], cfg: str) -> dict[str, Any] | None:
    if FITSERVE_CONFIGS[cfg][2]:
        return run_worker([*me, "--worker", "fitserve"], {**base, "config": cfg})
    # compiled: a cold start on an empty compile cache, then a warm one on it
    env = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="fitserve-compile-")}
    cold = run_worker([*me, "--worker", "fitserve"], {**base, "config": cfg}, env)
    r = run_worker([*me, "--worker", "fitserve"], {**base, "config": cfg}, env)
    if r and cold:
        r["startup_cold_s"] = cold["startup_s"]
    return r


def merge_rounds(rs: list[dict[str, Any] | None]) -> dict[str, Any]:
    """One engine's results of every round (None: that round's worker failed) as one: W1 / W2
    tok/s the median of all runs pooled, TTFT the median of the rounds' medians (the workers
    report no per-run TTFT), the highest peak RSS, the median start-up; ``rounds`` keeps each
    round's own result, None included, so that round i of two engines pairs up."""
    ok = [r for r in rs if r]
    out = dict(ok[0])
    if len(rs) == 1:
        return out
    for key in ("copy_bytes_per_s", "read_bytes_per_s"):
        if all(key in r for r in ok):
            out[key] = statistics.median(r[key] for r in ok)
    if all("predicted" in r for r in ok):
        out["predicted"] = {w: statistics.median(r["predicted"][w] for r in ok)
                            for w in ok[0]["predicted"]}
    for w in ("W1", "W2"):
        if all(w in r for r in ok):
            runs = [x for r in ok for x in r[w]["runs"]]
            out[w] = {**ok[0][w], "tok_s": statistics.median(runs), "runs": runs}
            if "ttft_ms" in ok[0][w]:
                out[w]["ttft_ms"] = statistics.median(r[w]["ttft_ms"] for r in ok)
    out["peak_rss_mib"] = max(r.get("peak_rss_mib", float("nan")) for r in ok)
    if all("preemptions" in r for r in ok):
        out["preemptions"] = sum(r["preemptions"] for r in ok)
    for key in ("startup_s", "startup_cold_s"):
        if all(key in r for r in ok):
            out[key] = statistics.median(r[key] for r in ok)
    out["rounds"] = rs
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="q4_1,bf16,fp32")
    ap.add_argument("--peers", default="transformers,llamacpp,vllm")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every engine's worker this many times, round-robin; medians pool "
                         "all runs, and the paired ratios of each round are printed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true",
                    help="fitserve only, on a loaded host: 1 thread, W1 / W2 timed by the "
                         "thread's CPU clock, the planner's prediction for 1 thread beside them")
    ap.add_argument("--w2-requests", type=int, default=32)
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    ap.add_argument("--vllm-python", default=str(Path.home() / "peers/vllm/bin/python"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--kv-cache-memory", default=None,
                    help="fitserve's KV pool (e.g. 256M: W2 needs ~180 MiB in bf16); default "
                         "the blocks of llama.cpp's context for the same workloads "
                         "(peer_context_blocks). Only the blocks a run touches are resident")
    ap.add_argument("--repredict", default=None, metavar="JSON",
                    help="no run: predict a saved --json's fitserve configs again with this "
                         "tree's planner, on the bandwidth and engine rates each round kept")
    ap.add_argument("--worker", choices=["fitserve", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repredict:
        return repredict(Path(args.repredict), args.w2_requests)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        fn = fitserve_worker if args.worker == "fitserve" else transformers_worker
        print(json.dumps(fn(spec)))
        return

    from fitserve.envs import fitserve_home
    from fitserve.ledger.cpu_measure import (
        measure_copy_bandwidth,
        measure_engine_rates,
        measure_read_bandwidth,
    )

    if args.cpu_time:
        args.threads = 1
    base = workload_spec(args.threads, args.runs, args.w2_requests)
    base["cpu_time"] = args.cpu_time
    if args.kv_cache_memory:
        from fitserve.engine.args import parse_bytes_arg

        base["kv_cache_memory"] = parse_bytes_arg(args.kv_cache_memory)
    gguf = base["gguf"]
    me = [sys.executable, str(Path(__file__).resolve())]
    jobs: list[tuple[str, Callable[[], dict[str, Any] | None]]] = []
    for cfg in filter(None, args.configs.split(",")):
        jobs.append((f"fitserve {cfg}", lambda cfg=cfg: fitserve_job(me, base, cfg)))
    peers = args.peers.split(",") if args.peers else []
    if "transformers" in peers:
        jobs.append(("transformers", lambda: run_worker([*me, "--worker", "transformers"], base)))
    if "llamacpp" in peers:
        if Path(args.llamacpp_python).exists():
            jobs.append(("llama.cpp", lambda: run_worker(
                [args.llamacpp_python, str(HERE / "peers/llamacpp_worker.py")], base)))
        else:
            print(f"llama.cpp skipped: no {args.llamacpp_python} (see ../shared/PEERS.md)")
    if "vllm" in peers:
        if Path(args.vllm_python).exists():
            hf_dir = write_hf_folder(gguf, fitserve_home() / "bench" / "smollm2-135m-hf-bf16")

            def vllm_job() -> dict[str, Any] | None:
                env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
                       "VLLM_CPU_KVCACHE_SPACE": "4",
                       "VLLM_CACHE_ROOT": tempfile.mkdtemp(prefix="vllm-cache-")}
                return run_worker([args.vllm_python, str(HERE / "peers/vllm_worker.py")],
                                  {**base, "hf_dir": str(hf_dir)}, env)

            jobs.append(("vllm-cpu", vllm_job))
        else:
            print(f"vLLM skipped: no {args.vllm_python} (see ../shared/PEERS.md)")
    # NOTE: round-robin, so a slow period of a shared host falls on every engine of a round
    # alike rather than on whichever engine happened to run then
    rounds: list[dict[str, dict[str, Any] | None]] = []
    for i in range(args.rounds):
        done: dict[str, dict[str, Any] | None] = {}
        for name, job in jobs:
            print(f"{name} ..." + (f" (round {i + 1} of {args.rounds})" if args.rounds > 1 else ""),
                  file=sys.stderr)
            ours = name.startswith("fitserve")
            bw = measure_copy_bandwidth(threads=args.threads) if ours else None
            rbw = measure_read_bandwidth(threads=args.threads) if ours else None
            # NOTE: the engine's rates are measured here too, each round (a few seconds): the
            # prediction then sees the load the worker's run sees
            rates = measure_engine_rates(args.threads) if ours else None
            done[name] = job()
            if bw is not None and done[name]:
                done[name]["copy_bytes_per_s"] = bw  # type: ignore[index]
                done[name]["read_bytes_per_s"] = rbw  # type: ignore[index]
                # the figures the prediction used, so a --json can be predicted again
                done[name]["engine_rates"] = dataclasses.asdict(rates)  # type: ignore[index,call-overload]
                done[name]["predicted"] = planner_prediction(  # type: ignore[index]
                    name.removeprefix("fitserve "), base, rbw, rates, args.threads)
        rounds.append(done)
    results = [merge_rounds([rd[name] for rd in rounds])
               for name, _ in jobs if any(rd[name] for rd in rounds)]
    report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_description(), "threads": args.threads, "results": results}, f,
                      indent=2)


def repredict(path: Path, w2_requests: int) -> None:
    """Each fitserve round of a saved --json: measured W1 / W2 beside the prediction it printed
    and this tree's planner on the same copy bandwidth and engine rates (kept in the JSON)."""
    from fitserve.ledger.cpu_measure import EngineRates

    saved = json.loads(path.read_text())
    base = workload_spec(saved["threads"], 1, w2_requests)
    print(f"{path}: {saved['cpu']}, {saved['threads']} thread(s)")
    for r in saved["results"]:
        for i, rd in enumerate(r.get("rounds") or [r]):
            if not rd or "engine_rates" not in rd:
                continue
            rates = EngineRates.from_json(json.dumps(rd["engine_rates"]))
            now = planner_prediction(r["config"], base,  # read: runs saved before 2026-12-07 had copy
                                     rd.get("read_bytes_per_s") or rd["copy_bytes_per_s"], rates,
                                     saved["threads"])
            parts = [f"{w} {rd[w]['tok_s']:.1f} tok/s: predicted then {rd['predicted'][w]:.1f} "
                     f"({rd[w]['tok_s'] / rd['predicted'][w]:.2f}), now {now[w]:.1f} "
                     f"({rd[w]['tok_s'] / now[w]:.2f})" for w in ("W1", "W2") if w in rd]
            print(f"  {_name(r)} round {i + 1}: " + "; ".join(parts))


def _name(r: dict[str, Any]) -> str:
    return f"fitserve {r['config']}" if r["engine"] == "fitserve" else r["engine"]


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from fitserve.ledger.hardware import cpu_hardware

    cached = cpu_hardware().mem_bytes_per_s  # the planner's read bandwidth
    pool = args.kv_cache_memory or "llama.cpp's context for these workloads"
    runs = (f"{args.runs * args.rounds} runs ({args.rounds} rounds of {args.runs}, engines "
            f"round-robin)" if args.rounds > 1 else f"{args.runs} runs")
    fresh = [x["copy_bytes_per_s"] for r in results for x in (r.get("rounds") or [r])
             if x and "copy_bytes_per_s" in x]
    bw = statistics.median(fresh) if fresh else cached
    measured = (f"copy bandwidth {bw / 1e9:.1f} GB/s (median of {len(fresh)} measured before the "
                f"fitserve workers, {min(fresh) / 1e9:.1f}-{max(fresh) / 1e9:.1f}; the planner's "
                f"cached read figure {cached / 1e9:.1f})" if fresh else
                f"the planner's read bandwidth {bw / 1e9:.1f} GB/s")
    clock = " (CPU time of the one thread)" if args.cpu_time else ""
    print(f"\nCPU: {cpu_description()}\nthreads={args.threads}{clock}, medians of {runs}; "
          f"{measured}; fitserve KV pool {pool}")
    by = {_name(r): r for r in results}
    peers = [p for p in ("llama.cpp", "vllm-cpu", "transformers") if p in by]
    head = (f"{'engine':<16}{'W1 TTFT ms':>11}{'W1 tok/s':>10}{'of limit':>9}{'of read':>8}"
            f"{'W2 tok/s':>10}{'peak RSS MiB':>13}")
    print(head + "".join(f"{'vs ' + p:>18}" for p in peers))
    for r in results:
        w1, w2 = r.get("W1", {}), r.get("W2", {})
        limit = (r.get("copy_bytes_per_s", bw) / r["weight_bytes_read"]
                 if r.get("weight_bytes_read") else None)
        frac = f"{w1['tok_s'] / limit:8.0%}" if limit and w1 else "        -"
        rfrac = (f"{w1['tok_s'] * r['weight_bytes_read'] / r['read_bytes_per_s']:8.0%}"
                 if w1 and r.get("weight_bytes_read") and r.get("read_bytes_per_s") else "       -")
        line = (f"{_name(r):<16}{w1.get('ttft_ms', float('nan')):11.1f}{w1.get('tok_s', float('nan')):10.1f}"
                f"{frac}{rfrac} {w2.get('tok_s', float('nan')):9.1f}{r.get('peak_rss_mib', float('nan')):13.0f}")
        for p in peers:
            q = by[p]
            if r is q:
                line += f"{'-':>18}"
                continue
            a = w1.get("tok_s", 0) / q["W1"]["tok_s"] if "W1" in q and w1 else float("nan")
            b = w2.get("tok_s", 0) / q["W2"]["tok_s"] if "W2" in q and w2 else float("nan")
            line += f"{f'W1 {a:.2f}x W2 {b:.2f}x':>18}"
        print(line)
    for r in results:
        if r.get("weight_bytes_read"):
            start = (f"start-up cold {r['startup_cold_s']:.1f} s, warm {r['startup_s']:.1f} s"
                     if "startup_cold_s" in r else f"start-up {r['startup_s']:.1f} s")
            print(f"  {_name(r)}: {r['weight_bytes_read'] / 1e6:.1f} MB of weights read per token -> "
                  f"W1 limit {r.get('copy_bytes_per_s', bw) / r['weight_bytes_read']:.0f} tok/s; "
                  f"{start}; KV {r.get('kv_blocks', '?')} blocks, "
                  f"{r.get('preemptions', '?')} preemptions")
    planner_vs_measured(results)
    if args.rounds > 1:
        paired_ratios(results, by, peers)
    q4, bf = by.get("fitserve q4_1"), by.get("fitserve bf16")
    if q4 and bf and q4.get("peak_rss_mib") and bf.get("peak_rss_mib"):
        print(f"  peak RSS, fitserve q4_1 / bf16 (W1 then W2, one process each): "
              f"{q4['peak_rss_mib'] / bf['peak_rss_mib']:.2f}x")


def planner_vs_measured(results: list[dict[str, Any]]) -> None:
    """Each fitserve config's W1 / W2 beside the planner's prediction on the figures measured
    right before its worker (median over rounds), and measured / predicted."""
    for r in results:
        p = r.get("predicted")
        if not p:
            continue
        parts = [f"{w} {r[w]['tok_s']:.1f} vs {p[w]:.1f} tok/s (measured / predicted "
                 f"{r[w]['tok_s'] / p[w]:.2f})" for w in ("W1", "W2") if w in r and w in p]
        print(f"  {_name(r)}, measured vs the planner's prediction: " + "; ".join(parts))


def paired_ratios(results: list[dict[str, Any]], by: dict[str, dict[str, Any]],
                  peers: list[str]) -> None:
    """Each fitserve config against each peer, round by round (the two ran minutes apart):
    the rounds' W1 and W2 ratios of medians, and their median (rounds where either failed are
    left out)."""
    for r in results:
        if r["engine"] != "fitserve":
            continue
        fracs = [x["W1"]["tok_s"] * x["weight_bytes_read"] / x["copy_bytes_per_s"]
                 for x in r["rounds"] if x and "W1" in x and "copy_bytes_per_s" in x]
        if fracs:
            print(f"  {_name(r)}, W1 of its limit per round (the bandwidth measured just before): "
                  + " ".join(f"{f:.0%}" for f in fracs) + f" (median {statistics.median(fracs):.0%})")
        for p in peers:
            print(f"  {_name(r)} / {p}, per round: " + round_ratios(r, by[p]))


def round_ratios(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Two engines' merged results (merge_rounds), round i against round i: each round's W1
    and W2 ratio of medians and their median (rounds where either worker failed left out)."""
    pairs = [(x, y) for x, y in zip(a["rounds"], b["rounds"], strict=True) if x and y]
    parts = []
    for w in ("W1", "W2"):
        ratios = [x[w]["tok_s"] / y[w]["tok_s"] for x, y in pairs if w in x and w in y]
        if ratios:
            each = " ".join(f"{v:.2f}" for v in ratios)
            parts.append(f"{w} {each} (median {statistics.median(ratios):.2f}x)")
    return "; ".join(parts)


if __name__ == "__main__":
    main()
