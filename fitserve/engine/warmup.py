"""Start-up warm-up and summary: run every path a served request takes once before the server
says it is ready, then log one line saying what start-up built and took.

A first request used to pay for what nothing had run yet: a C++ extension loaded at first use
(``decode_step`` built after /health was ok: 16.5 s on the first request), torch's first call of
each op, the sampler's top-k/top-p/min-p branch, detokenizing. :func:`warm_up` runs two short
requests through the engine itself (a batch of two, one greedy with logprobs and one sampled
with every filter and a penalty, then a lone greedy one for the batch-1 decode path), so each
extension the configuration uses is loaded and each path has run once, then forgets them: the
prefix cache is reset and the step log cleared, so neither a later request nor the metrics see
the warm-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from fitserve.engine.core import Engine
from fitserve.kernels.cpu.build import built_in_process, loaded_extensions
from fitserve.kernels.cpu.isa import build_tier, detect_isa
from fitserve.model.loader import held_weight_bytes
from fitserve.sampling import SamplingParams

log = logging.getLogger("fitserve.engine")

WARM_UP_PROMPT_TOKENS = 16
"""Prompt length of the warm-up requests: a multi-token prefill chunk, well under any limit."""


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    """What the warm-up ran: its seconds, engine steps and the extensions loaded after it."""

    seconds: float
    steps: int
    extensions: tuple[str, ...]


def warm_up(engine: Engine, max_tokens: int = 4) -> WarmUpReport:
    """Run the prefill, batched and batch-1 decode and sampler paths once (see the module note)."""
    t0 = time.perf_counter()
    log.info("warming up: prefill, batched and batch-1 decode, greedy and filtered sampling")
    ids = engine.tokenizer.encode("fitserve warm-up: the first request is as fast as any later one.")
    # a model may have fewer embeddings than its tokenizer's ids (a trimmed or test model)
    ids = [t % engine.spec.vocab_size for t in ids]
    ids = (ids * WARM_UP_PROMPT_TOKENS)[:WARM_UP_PROMPT_TOKENS] or [0] * WARM_UP_PROMPT_TOKENS
    ids = ids[: max(1, min(len(ids), engine.max_model_len - max_tokens - 1))]
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, top_k=40,
                             min_p=0.05, repetition_penalty=1.1, seed=0, ignore_eos=True)
    steps = 0
    # a batch of two where the engine may run two sequences at once (--max-num-seqs 1: apart)
    batches = ([[greedy, sampled], [greedy]] if engine.scheduler.config.max_num_seqs >= 2
               else [[greedy], [sampled]])
    for batch in batches:
        rids = engine.add_requests(ids, batch, [f"warm-up-{steps}-{i}" for i in range(len(batch))])
        try:
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        finally:
            for rid in rids:
                engine.abort(rid)
    engine.reset_prefix_cache()  # a later request with the same prompt computes it
    engine.step_log.clear()  # the warm-up is not the engine's work
    engine.num_steps = 0
    slo = engine.scheduler.slo
    if slo is not None:  # cold first steps are not the serving step time the slo policy learns
        slo.correction = 1.0
    return WarmUpReport(time.perf_counter() - t0, steps, tuple(loaded_extensions()))


def startup_summary(engine: Engine, seconds: float, warm: WarmUpReport | None) -> str:
    """One line: model, format, weights and KV bytes (the ledger's, checked at load), the
    kernels loaded (and which were compiled now), the seconds to ready."""
    loaded = engine.loaded
    built = built_in_process()
    kernels = ", ".join(loaded_extensions()) or "none (pure-torch paths)"
    mib = 1 << 20
    parts = [
        f"ready in {seconds:.1f} s",
        f"model {loaded.path.name} ({loaded.file_format} {loaded.weight_format}, held as "
        f"{engine.weights_choice}, {engine.dtype})".replace("torch.", ""),
        f"weights {held_weight_bytes(engine.runner.model) / mib:.1f} MiB",
        f"KV cache {engine.pool.allocated_bytes / mib:.1f} MiB ({engine.pool.num_blocks} blocks of "
        f"{engine.pool.block_size} tokens)",
        f"C++ kernels ({build_tier(detect_isa())}): {kernels}"
        + (f" [compiled now: {', '.join(built)}]" if built else ""),
    ]
    load_s = engine.startup_seconds.get("load")
    if load_s is not None:
        parts.append(f"load {load_s:.1f} s")
    if warm is not None:
        parts.append(f"warm-up {warm.seconds:.1f} s ({warm.steps} steps)")
    return "; ".join(parts)
