"""Constrained decoding's cost: a batch with half its requests under a JSON schema vs none.

    .venv/bin/python benchmarks/bench_structured.py [--batch 16] [--new 64] [--runs 3] [--threads N]
                                                    [--weights auto|float32|bf16|...]

The default model (Q4_1 as stored unless --weights says otherwise), greedy, one engine for both configurations, alternating
runs after a warm-up of each (prefix cache reset before every run, so every run computes its
prompts). "none": --batch requests, EOS ignored. "half": the same, but every other request is
under a JSON schema (a list of at least 5 people: longer than --new tokens, so the constrained
requests run as long as the others). Printed, medians of --runs:

- output tok/s of the batch, and the median wall time of a full decode step (every request
  decoding, no prefill in it): the like-for-like comparison;
- the grammar mask per step (llguidance's bitmask fill + setting -inf), in ms, and its share;
- the sampler alone on [batch, V] logits: with no constrained row (what unconstrained traffic
  pays) and with half the rows constrained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 5, "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}


def run_batch(engine: Any, prompts: list[str], params: list[Any]) -> dict[str, float]:
    """One batch to completion: wall seconds, output tokens, full-decode-step seconds, mask time."""
    masker = engine.runner.sampler.masker
    mask0, steps0 = masker.seconds, masker.steps
    engine.reset_prefix_cache()
    first = engine.num_steps
    t0 = time.perf_counter()
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(p, sp)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += out.num_output_tokens
    wall = time.perf_counter() - t0
    full = [r.seconds for r in engine.step_log
            if r.index > first and r.num_prefill_tokens == 0 and r.seqs == len(prompts)]
    steps = masker.steps - steps0
    return {"wall": wall, "tokens": tokens, "step": statistics.median(full) if full else float("nan"),
            "mask_ms": 1e3 * (masker.seconds - mask0) / steps if steps else 0.0}


def sampler_micro(engine: Any, batch: int, reps: int = 50) -> tuple[float, float]:
    """ms per Sampler call on [batch, V] greedy logits: no constrained row, half constrained."""
    import torch

    from fitserve.sampling import RequestSamplingState, SamplingParams
    from fitserve.structured.guided import GuidedDecoding

    vocab = engine.spec.vocab_size
    logits = torch.randn(batch, vocab)
    greedy = SamplingParams(temperature=0.0)
    compiled = engine.grammars.compile(GuidedDecoding("json_schema", json.dumps(SCHEMA)),
                                       engine.tokenizer, vocab)
    plain = [RequestSamplingState.create(greedy, [1], []) for _ in range(batch)]
    mixed = [RequestSamplingState.create(greedy, [1], []) for _ in range(batch)]
    first = engine.tokenizer.encode('{"people": [{"name": "')
    for s in mixed[::2]:
        s.guide = compiled.new_state()
        for t in first:  # inside a string: the widest mask (most tokens allowed)
            s.guide.advance(t)
    sampler = engine.runner.sampler
    out = []
    for states in (plain, mixed):
        sampler(logits, states)
        t0 = time.perf_counter()
        for _ in range(reps):
            sampler(logits, states)
        out.append(1e3 * (time.perf_counter() - t0) / reps)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--weights", default="auto", help="EngineConfig.weights (auto: as stored)")
    args = ap.parse_args()

    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
    from fitserve.sampling import SamplingParams
    from fitserve.structured.guided import GuidedDecoding

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; torch threads: {torch.get_num_threads()}")
    engine = Engine(EngineConfig(device="cpu", max_model_len=1024, max_num_seqs=max(args.batch, 1),
                                 weights=args.weights))
    print(f"weights: {engine.weights_choice}")
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content":
               f"List {5 + i % 3} people with their name, age and city, as JSON."}])
               for i in range(args.batch)]
    plain = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    guided = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True,
                            guided=GuidedDecoding("json_schema", json.dumps(SCHEMA)))
    configs = {"none": [plain] * args.batch,
               "half": [guided if i % 2 else plain for i in range(args.batch)]}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in configs}
    for params in configs.values():  # warm-up (and the grammar's compile) first
        run_batch(engine, prompts, params)
    for _ in range(args.runs):
        for name, params in configs.items():
            results[name].append(run_batch(engine, prompts, params))

    print(f"\n{args.batch} requests x {args.new} new tokens (greedy, EOS ignored), medians of {args.runs} runs")
    print(f"{'config':<8}{'tok/s':>9}{'full step ms':>14}{'mask ms/step':>14}{'mask share':>12}")
    med = {}
    for name, rs in results.items():
        m = {k: statistics.median(r[k] for r in rs) for k in ("wall", "tokens", "step", "mask_ms")}
        med[name] = m
        share = m["mask_ms"] / (1e3 * m["step"]) if m["step"] == m["step"] and m["step"] else 0.0
        print(f"{name:<8}{m['tokens'] / m['wall']:>9.1f}{1e3 * m['step']:>14.1f}{m['mask_ms']:>14.2f}"
              f"{100 * share:>11.1f}%")
    ratio = (med["half"]["tokens"] / med["half"]["wall"]) / (med["none"]["tokens"] / med["none"]["wall"])
    print(f"throughput half / none: {ratio:.3f}; full-step time half / none: "
          f"{med['half']['step'] / med['none']['step']:.3f}")
    none_ms, mixed_ms = sampler_micro(engine, args.batch)
    print(f"sampler alone, [{args.batch}, {engine.spec.vocab_size}] greedy: no constrained row "
          f"{none_ms:.2f} ms; {args.batch // 2} constrained {mixed_ms:.2f} ms "
          f"(+{mixed_ms - none_ms:.2f} ms, {1e3 * (mixed_ms - none_ms) / max(args.batch // 2, 1):.0f} us a row)")


if __name__ == "__main__":
    main()
