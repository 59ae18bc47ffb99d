"""Where an engine step's time goes, for the README's "where the time goes" figures.

    .venv/bin/python benchmarks/profile_engine.py [--dtype bf16] [--threads 2] [--weights auto]
        [--model PATH]

First, what the loaded engine holds: its resident memory (/proc/self/status) beside the KV
pool and the weights the ledger counts. W1 shape: 1 request decoding (context ~40). W2 shape:
32 requests x 128-token prompts (prefill timed as the steps until every prompt is in the
cache, no prefix caching; the first step's op table), then batch-32 decode steps. Each decode
figure is the median of 20 steps after warm-up; the op table is torch.profiler's self CPU time
over 5 more steps, grouped by ATen op.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from timing import median_seconds  # the sibling module: scripts run from benchmarks/
from torch.profiler import profile

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.model.linear import PackedLinear
from fitserve.model.loader import held_weight_bytes
from fitserve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def resident_mib() -> dict[str, float]:
    """VmRSS, RssAnon, RssFile of this process, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) / 1024
    return out


def memory_line(engine: Engine) -> str:
    r = resident_mib()
    mib = 1 << 20
    return (f"after loading: RSS {r['VmRSS']:.0f} MiB (anonymous {r['RssAnon']:.0f}, file-backed "
            f"{r['RssFile']:.0f}); KV pool {engine.pool.allocated_bytes / mib:.0f} MiB reserved, "
            f"{engine.kv.stats().touched_blocks * engine.pool.block_bytes / mib:.0f} MiB of it "
            f"touched (resident); weights {held_weight_bytes(engine.runner.model) / mib:.0f} MiB")


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
    return table(prof, steps, top)


def table(prof: profile, steps: int, top: int = 6) -> str:
    """The profiled steps' ops by self CPU time per step, the top ones and all together."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    lines = [f"    {'op':<22}{'ms/step':>9}{'share':>8}"]
    for e in events[:top]:
        lines.append(f"    {e.key:<22}{e.self_cpu_time_total / 1e3 / steps:9.2f}{e.self_cpu_time_total / total:8.0%}")
    calls = sum(e.count for e in events) / steps
    lines.append(f"    {'(all ops)':<22}{total / 1e3 / steps:9.2f}    {calls:,.0f} ATen calls per step")
    return "\n".join(lines)


def median_ms(fn: Callable[[], object], runs: int = 30) -> float:
    return median_seconds(fn, runs) * 1e3


def linear_table(engine: Engine) -> str:
    """The batch-1 step's linears alone, back to back in model order, on their bound kernels:
    the projections, the lm_head, and both (when the sum of the first two is less than the
    third, the weights a token reads do not stay in the cache together)."""
    model = engine.runner.model
    dtype = next(model.parameters()).dtype
    calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = []
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            x = torch.randn(1, lin.in_features, dtype=dtype)
            calls.append((lin.bound_run(1, dtype) if isinstance(lin, PackedLinear) else lin, x))
    head = model.lm_head
    xh = torch.randn(1, model.spec.hidden_size, dtype=dtype)
    run_head = head.bound_run(1, dtype) if isinstance(head, PackedLinear) else head

    def layers() -> None:
        for fn, x in calls:
            fn(x)

    def both() -> None:
        layers()
        run_head(xh)

    a, b, c = median_ms(layers), median_ms(lambda: run_head(xh)), median_ms(both)
    return (f"    batch-1 linears, back to back: {len(calls)} projections {a:.2f} ms, lm_head "
            f"{b:.2f} ms, both {c:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="auto", help="EngineConfig.weights (auto: Q4_1 as stored)")
    ap.add_argument("--model", default=None,
                    help="a GGUF file or HF folder instead of the default model (e.g. a "
                         "bench_formats.py file)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = "bfloat16" if args.dtype == "bf16" else "float32"

    kw = {"model": args.model} if args.model else {}
    engine = Engine(EngineConfig(dtype=dtype, device="cpu", max_model_len=1024,
                                 weights=args.weights, **kw))
    print(memory_line(engine))
    engine.add_request("The capital of France is", GREEDY)
    step_ms(engine, 5)
    print(f"W1 decode step ({args.dtype}, {args.threads} threads): {step_ms(engine):.2f} ms median")
    print(op_table(engine))
    print(linear_table(engine))
    del engine

    # NOTE: no prefix caching: the text below tokenizes with a period of 7 tokens (8 distinct
    # prompts of the 32), so with it 24 were prefix hits and "the prefill" timed a quarter of the
    # work (bench_engine's W2 runs from an empty cache, and its prompts share no block)
    engine = Engine(EngineConfig(dtype=dtype, device="cpu", max_model_len=1024,
                                 weights=args.weights, enable_prefix_caching=False, **kw))
    ids = engine.tokenizer.encode("The history of computing is long. " * 40, add_special_tokens=False)
    for i in range(32):
        engine.add_request(ids[i : i + 128], GREEDY)
    t = time.perf_counter()
    with profile() as prof:  # the first step: a max_num_batched_tokens chunk of the prompts
        engine.step()
    first = time.perf_counter() - t
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) \
            or engine.scheduler.num_waiting:
        engine.step()
    print(f"W2 prefill of 32 x 128 tokens: {time.perf_counter() - t:.2f} s; its first step "
          f"{first:.2f} s:")
    print(table(prof, 1))
    step_ms(engine, 3)
    print(f"W2 decode step (batch 32): {step_ms(engine):.2f} ms median")
    print(op_table(engine))


if __name__ == "__main__":
    main()
