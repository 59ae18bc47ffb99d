"""Where the planner's W2 prediction stands, step by step and part by part (issue 43.4).

Runs bench_engine's W2 (its 32 x 128-token prompts, 128 new tokens each, the default model)
on one thread timed by that thread's CPU clock (a loaded host's other processes do not count),
records every engine step's time, and sets each beside the planner's ``scheduled_step`` for
the same step of ``workload_schedule`` (its parts: weight kernels / GEMMs, decode attention,
element-wise and sampling, fixed overhead), on the engine rates measured in this run
(``fitserve.engine.cpu_rates`` at 1 thread, or ``--rates FILE`` with a saved JSON line).
Then the parts alone, each timed the same way at the model's own shapes: the model's
linears (its real packed weights, layer after layer as a step runs them) at the row counts of
W2's steps against the planner's FLOPs / rate, the tied lm_head, and the paged decode
attention of 32 sequences at the model's heads (blocks interleaved, as sequences decoding
together get them) against ``speed.decode_attention_seconds``.

    PYTHONPATH=$PWD python benchmarks/bench_w2_steps.py [--config q4_1] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_attention_stream import decode_inputs  # noqa: E402
from bench_engine import FITSERVE_CONFIGS, PLAN_WEIGHTS, workload_spec  # noqa: E402
from timing import median_seconds  # noqa: E402

from fitserve.ledger.cpu_measure import EngineRates, measure_read_bandwidth  # noqa: E402


def engine_for(gguf: str, config: str) -> Any:
    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine

    dtype, weights, eager = FITSERVE_CONFIGS[config]
    return Engine(EngineConfig(model=gguf, dtype=dtype, weights=weights, device="cpu",
                               max_model_len=1024, enforce_eager=eager))


def w2_step_times(engine: Any, base: dict[str, Any]) -> list[float]:
    """CPU seconds of this thread of every step of one W2 run."""
    from fitserve.sampling import SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=base["new_tokens"], ignore_eos=True)
    for p in base["w2_batch"]:
        engine.add_request(p, params)
    out = []
    while engine.has_unfinished_requests():
        t0 = time.thread_time()
        engine.step()
        out.append(time.thread_time() - t0)
    return out


def predicted_steps(base: dict[str, Any], config: str, hw: Any) -> tuple[Any, list[Any], list[Any]]:
    """(resolved plan, the schedule's steps, the planner's StepTime of each)."""
    from fitserve.ledger.speed import scheduled_step
    from fitserve.ledger.workload_schedule import workload_schedule
    from fitserve.tools.planner.report import PlanRequest, resolve, speed_weights

    n, length = len(base["w2_batch"]), len(base["w2_batch"][0])
    req = PlanRequest(model=base["gguf"], gpu="cpu", context=1024, weights=PLAN_WEIGHTS[config],
                      dtype=FITSERVE_CONFIGS[config][0], input_len=length,
                      output_len=base["new_tokens"], batch_size=n)
    r = resolve(req, hw=hw)
    wb = speed_weights(r)
    plan = workload_schedule(batch=n, input_len=length, output_len=base["new_tokens"],
                             max_num_batched_tokens=req.max_num_batched_tokens, max_num_seqs=64)
    return r, plan, [scheduled_step(r.entry.spec, hw, wb, s, kv_dtype=r.kv_dtype,
                                    weights_fmt=r.weights, act_dtype_bytes=r.act_bytes)
                     for s in plan]


def _cpu_median(fn: Any, reps: int = 5) -> float:
    return median_seconds(fn, reps, time.thread_time)


def linear_parts(engine: Any, rows: list[int]) -> dict[int, dict[str, float]]:
    """rows -> {linear name: CPU seconds of that linear over all layers} at the model's own
    packed weights (each layer's module in turn, as a step runs them)."""
    model = engine.runner.model
    by_name: dict[str, list[Any]] = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "in_features") and ".layers." in f".{name}":
            by_name.setdefault(name.split(".", 2)[-1], []).append(mod)
    out: dict[int, dict[str, float]] = {}
    for m in rows:
        out[m] = {}
        for name, mods in by_name.items():
            x = torch.randn(m, mods[0].in_features).bfloat16()
            out[m][name] = _cpu_median(lambda x=x, mods=mods: [f(x) for f in mods])
    return out


def decode_attention_part(spec: Any, batch: int, keys: int, layers: int) -> float:
    """CPU seconds of the paged decode attention of ``batch`` sequences of ``keys`` keys at
    the model's heads, over ``layers`` layers' caches."""
    from fitserve.kernels.cpu.paged_attention import paged_decode_attention

    d = spec.head_dim
    q, tables, lens, caches = decode_inputs(batch, keys, spec.num_heads, spec.num_kv_heads, d,
                                            layers)
    return _cpu_median(lambda: [paged_decode_attention(q, k, v, tables, lens, d ** -0.5)
                                for k, v in caches])


def report(plan: list[Any], pred: list[Any], runs: list[list[float]]) -> None:
    med = [statistics.median(r[i] for r in runs) for i in range(len(plan))]
    print(f"{'step':>5}{'seqs':>5}{'tokens':>7}{'ctx':>5}{'measured ms':>12}{'predicted':>10}"
          f"{'ratio':>6}{'gemm':>8}{'wkern':>8}{'attn':>7}{'tokens':>7}{'ovh':>6}")
    for i, (s, t, m) in enumerate(zip(plan, pred, med, strict=True)):
        if i < 4 or i % 16 == 0 or i == len(plan) - 1:
            print(f"{i:5d}{s.seqs:5d}{s.new_tokens:7d}{t.context:5d}{m * 1e3:12.2f}"
                  f"{t.seconds * 1e3:10.2f}{m / t.seconds:6.2f}{t.t_compute * 1e3:8.2f}"
                  f"{t.t_dequant * 1e3:8.2f}{t.t_attention * 1e3:7.2f}{t.t_tokens * 1e3:7.2f}"
                  f"{t.t_overhead * 1e3:6.2f}")
    pre = [i for i, s in enumerate(plan) if s.chunks]
    dec = [i for i, s in enumerate(plan) if not s.chunks]
    for name, idx in (("prefill steps", pre), ("decode steps", dec), ("all", pre + dec)):
        ms, ps = sum(med[i] for i in idx), sum(pred[i].seconds for i in idx)
        print(f"{name:<14} measured {ms * 1e3:9.1f} ms  predicted {ps * 1e3:9.1f} ms  "
              f"measured/predicted {ms / ps:.3f}")
    tokens = sum(s.sampled for s in plan)
    print(f"W2 tok/s: measured {tokens / sum(med):.1f}, predicted "
          f"{tokens / sum(t.seconds for t in pred):.1f}; predicted/measured time "
          f"{sum(t.seconds for t in pred) / sum(med):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="q4_1", choices=sorted(FITSERVE_CONFIGS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rates", default=None, help="a saved cpu_rates JSON line (else measured)")
    ap.add_argument("--no-parts", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from fitserve.engine import cpu_rates
    from fitserve.ledger.hardware import measured_cpu
    from fitserve.ledger.speed import decode_attention_seconds, elementwise_elements

    print(f"load average {os.getloadavg()}; 1 thread, CPU time of the thread")
    text = Path(args.rates).read_text() if args.rates else json.dumps(cpu_rates.measure(1))
    print("rates:", text.strip())
    rates = EngineRates.from_json(text)
    bw = measure_read_bandwidth(threads=1)  # the planner's memory bandwidth: reads
    hw = measured_cpu(mem_bytes_per_s=bw, engine=rates, threads=1)
    base = workload_spec(1, args.runs, 32)
    engine = engine_for(base["gguf"], args.config)
    r, plan, pred = predicted_steps(base, args.config, hw)
    w2_step_times(engine, base)  # warm-up
    runs = [w2_step_times(engine, base) for _ in range(args.runs)]
    assert all(len(x) == len(plan) for x in runs), (len(runs[0]), len(plan))
    report(plan, pred, runs)
    if args.no_parts:
        return
    spec = r.entry.spec
    print("\nlinears at the model's shapes, all layers (CPU ms) vs 2 M K N / peak_flops(M):")
    parts = linear_parts(engine, [1, 16, 32, 2048])
    for m, got in parts.items():
        flops = 2 * m * sum(mods for mods in (
            spec.hidden_size * (spec.q_size + 2 * spec.kv_size), spec.hidden_size * spec.q_size,
            spec.hidden_size * 2 * spec.intermediate_size,
            spec.intermediate_size * spec.hidden_size)) * spec.num_layers
        want = flops / hw.peak_flops(r.weights, m, spec.hidden_size)
        print(f"  M={m:5d} " + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in got.items())
              + f"  total {sum(got.values()) * 1e3:.2f} ms, predicted {want * 1e3:.2f} ms "
              f"({flops / sum(got.values()) / 1e9:.1f} GFLOP/s real vs "
              f"{hw.peak_flops(r.weights, m, spec.hidden_size) / 1e9:.1f} probe)")
    head = engine.runner.model.lm_head if hasattr(engine.runner.model, "lm_head") else None
    if head is not None:
        for m in (16, 32):
            x = torch.randn(m, spec.hidden_size).bfloat16()
            got = _cpu_median(lambda x=x: head(x))
            flops = 2 * m * spec.vocab_size * spec.hidden_size
            print(f"  lm_head M={m}: {got * 1e3:.2f} ms, predicted "
                  f"{flops / hw.peak_flops(r.weights, m, spec.hidden_size) * 1e3:.2f} ms")
    print("decode attention, 32 sequences, all layers (CPU ms) vs decode_attention_seconds:")
    from fitserve.ledger.flops import flops_per_token
    for keys in (130, 192, 255):
        got = decode_attention_part(spec, 32, keys, spec.num_layers)
        want = decode_attention_seconds(spec, hw, 32 * flops_per_token(spec, keys).attention, 32)
        print(f"  keys {keys}: {got * 1e3:.2f} ms, predicted {want * 1e3:.2f} ms")
    ew = elementwise_elements(spec) * spec.num_layers * hw.elementwise_s
    print(f"element-wise per token, all layers: predicted {ew * 1e6:.1f} us")


if __name__ == "__main__":
    main()
