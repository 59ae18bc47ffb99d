"""The calibration sweep: step shapes that pin down ``a``, ``b``, ``c`` and ``d`` separately.

    t_step = a + b * new_tokens + c * seqs + d * kv_tokens_read

Decode steps alone have ``new_tokens == seqs`` (b and c collinear) and, at one context, ``kv``
proportional to them too; so the sweep mixes five kinds of step:

    phase            new_tokens   seqs   kv_tokens_read     separates
    prompt chunk     n            1      n                  b (and a)
    short decodes    B            B      B x ~16            c (with the chunks)
    cached chunk     n            1      L + n              d vs b (after an L-token prefix)
    long decodes     B            B      B x ~L             d vs c
    mixed            B + n        B + 1  B x ctx + n        the SLO case: decodes + a chunk

NOTE: prompt tokens are the expensive part on a CPU (~1 ms each on the default model), so the
long contexts come from one shared L-token prefix that the prefix cache holds: it is computed
once, and each long request adds only its own 16-token suffix. Shared blocks read from a
warmer cache than distinct contexts would; measured on the default model the difference in a
decode step was ~3%. Without prefix caching the long phases shrink to small batches.

Every shape is clipped to the engine's limits (max_num_seqs, max_num_batched_tokens,
max_model_len, KV pool), so the sweep runs on any engine; shapes that cannot fit are dropped.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fitserve.ledger.step_time import StepSample, StepShape, StepTimeModel
from fitserve.types import StepRecord

if TYPE_CHECKING:
    import torch

    from fitserve.config import EngineConfig, ModelSpec
    from fitserve.engine.sizing import KVPoolSize
    from fitserve.sampling.params import SamplingParams
    from fitserve.sched.scheduler import Scheduler
    from fitserve.types import RequestOutput


class Engine(Protocol):
    """What calibration reads and drives of an engine (fitserve.engine.core.Engine is one).

    NOTE: a protocol, not an import of the core: the core loads its step model through this
    module, and an import back would be a cycle.
    """

    config: EngineConfig
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    weights_choice: object
    max_model_len: int
    pool: KVPoolSize
    scheduler: Scheduler
    step_log: Sequence[StepRecord]
    num_steps: int

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> str: ...
    def step(self) -> list[RequestOutput]: ...
    def abort(self, request_id: str) -> bool: ...
    def has_unfinished_requests(self) -> bool: ...
    def reset_prefix_cache(self) -> int: ...

SUFFIX_TOKENS = 16
"""Distinct tokens each long-context request adds after the shared prefix."""

FREE_STEPS = StepTimeModel(a=1e-12, b=0.0, c=0.0, d=0.0, source="calibration: no SLO rules")
"""What the ``slo`` policy sees while the sweep runs: every step free, so it neither caps a
chunk nor turns a request away (the sweep's shapes are the sweep's, not the policy's)."""


@dataclass(frozen=True, slots=True)
class SweepPlan:
    """The shapes one calibration times (before clipping to the engine)."""

    chunk_sizes: tuple[int, ...]
    chunk_repeats: int
    short_prompt: int
    short_batches: tuple[int, ...]
    decode_tokens: int  # max_tokens of each decode-batch request (steps timed per batch)
    long_context: int
    long_batches: tuple[int, ...]
    cached_chunks: tuple[int, ...]
    mixed_batch: int
    mixed_chunks: tuple[int, ...]


FULL_SWEEP = SweepPlan(chunk_sizes=(16, 48, 128, 320, 768), chunk_repeats=2, short_prompt=16,
                       short_batches=(1, 2, 4, 8, 16, 32), decode_tokens=9, long_context=1024,
                       long_batches=(1, 4, 16, 32), cached_chunks=(16, 64, 256), mixed_batch=8,
                       mixed_chunks=(64, 256))
QUICK_SWEEP = SweepPlan(chunk_sizes=(16, 128, 384), chunk_repeats=1, short_prompt=16,
                        short_batches=(1, 4, 16), decode_tokens=7, long_context=512,
                        long_batches=(1, 8), cached_chunks=(64,), mixed_batch=4, mixed_chunks=(128,))


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What bounds a step's shape on this engine."""

    max_seqs: int  # decodes one step can hold: min(max_num_seqs, max_num_batched_tokens)
    token_budget: int  # max_num_batched_tokens
    max_model_len: int
    num_blocks: int
    block_size: int
    prefix_caching: bool

    @classmethod
    def of(cls, engine: Engine) -> EngineLimits:
        sched, cache = engine.config.scheduler, engine.config.cache
        return cls(min(sched.max_num_seqs, sched.max_num_batched_tokens), sched.max_num_batched_tokens,
                   engine.max_model_len, engine.pool.num_blocks, cache.block_size,
                   cache.enable_prefix_caching)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class ClippedSweep:
    """The plan's shapes that fit the engine (empty tuples: that phase is skipped)."""

    chunk_sizes: tuple[int, ...]
    chunk_repeats: int
    short_prompt: int
    short_batches: tuple[int, ...]
    decode_tokens: int
    long_context: int  # 0: no long-context phases
    long_batches: tuple[int, ...]
    cached_chunks: tuple[int, ...]
    mixed_batch: int
    mixed_chunks: tuple[int, ...]


def _uniq(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted({v for v in values if v >= 1}))


def clip_sweep(plan: SweepPlan, lim: EngineLimits) -> ClippedSweep:
    """Clip every shape of ``plan`` to ``lim`` (pure: tested with exact numbers)."""
    # a request of p prompt tokens generating k needs p + k <= max_model_len
    max_prompt = min(lim.max_model_len - 1, (lim.num_blocks - 1) * lim.block_size)
    chunks = _uniq([min(n, lim.token_budget, max_prompt) for n in plan.chunk_sizes])
    k = max(2, min(plan.decode_tokens, lim.max_model_len // 2))
    short = max(1, min(plan.short_prompt, lim.max_model_len - k))
    per_short = lim.blocks(short + k)
    short_batches = _uniq([min(b, lim.max_seqs, lim.num_blocks // per_short) for b in plan.short_batches])
    # the long prefix: whole blocks (so the cache holds all of it), room for a suffix + k tokens
    # (at most 3/4 of max_model_len: the cached chunks after it need room too)
    room = min(lim.max_model_len - SUFFIX_TOKENS - k, lim.max_model_len * 3 // 4)
    long_ctx = min(plan.long_context, room, lim.num_blocks * lim.block_size // 4)
    long_ctx -= long_ctx % lim.block_size
    if long_ctx < 4 * short:
        long_ctx = 0
    per_long = lim.blocks(SUFFIX_TOKENS + k) + 1
    if lim.prefix_caching:
        fit = (lim.num_blocks - lim.blocks(long_ctx) - 1) // per_long
    else:  # every request computes its whole context: keep the batches small
        per_long = lim.blocks(long_ctx + SUFFIX_TOKENS + k)
        fit = min(4, lim.num_blocks // per_long)
    long_batches = _uniq([min(b, lim.max_seqs, fit) for b in plan.long_batches]) if long_ctx else ()
    cached = (_uniq([min(n, lim.token_budget, lim.max_model_len - 1 - long_ctx) for n in plan.cached_chunks])
              if long_ctx and lim.prefix_caching else ())
    # mixed: a decode batch (long context when there is one) plus one fresh prompt chunk
    if long_ctx:
        mixed_batch = min(plan.mixed_batch, lim.max_seqs - 1, fit)
        shared = lim.blocks(long_ctx) if lim.prefix_caching else 0
        free = lim.num_blocks - shared - max(mixed_batch, 0) * per_long
    else:
        mixed_batch = min(plan.mixed_batch, lim.max_seqs - 1, lim.num_blocks // per_short - 1)
        free = lim.num_blocks - max(mixed_batch, 0) * per_short
    mixed_chunks = (_uniq([min(n, lim.token_budget - mixed_batch, max_prompt, (free - 1) * lim.block_size)
                           for n in plan.mixed_chunks]) if mixed_batch >= 1 else ())
    return ClippedSweep(chunks, plan.chunk_repeats, short, short_batches, k, long_ctx, long_batches,
                        cached, max(mixed_batch, 0), mixed_chunks)


class SweepRunner:
    """Drives an idle engine through the sweep's phases and collects the step records."""

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        from fitserve.sampling import SamplingParams

        self.engine = engine
        self.rng = random.Random(seed)
        self._params = SamplingParams
        self.ids: list[str] = []

    def prompt(self, n: int) -> list[int]:
        """``n`` random token ids (fresh ones: no prefix cache hit)."""
        vocab = self.engine.spec.vocab_size
        low = min(4, vocab - 1)  # NOTE: skip the first ids (pad/bos/eos in most vocabularies)
        return [self.rng.randrange(low, vocab) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        rid = self.engine.add_request(prompt, params)
        self.ids.append(rid)
        return rid

    def drain(self, on_step: int | None = None, later: list[list[int]] | None = None) -> None:
        """Step until the engine is idle; ``later`` prompts (max_tokens=1) are added once
        ``on_step`` steps have run, so that they join a running decode batch (mixed steps)."""
        steps = 0
        while self.engine.has_unfinished_requests():
            if later and steps == on_step:
                for p in later:
                    self.add(p, 1)
            for out in self.engine.step():
                if out.error is not None:
                    raise RuntimeError(f"calibration request {out.request_id} failed: {out.error}")
            steps += 1

    def finish(self) -> None:
        """Leave the engine idle: every request aborted, the prefix cache empty."""
        for rid in self.ids:
            self.engine.abort(rid)
        self.ids.clear()
        self.engine.reset_prefix_cache()


@contextmanager
def slo_rules_off(engine: Engine) -> Iterator[None]:
    """With the ``slo`` policy, swap in :data:`FREE_STEPS` for the scheduler's step-time model
    (None while the engine starts and calibrates) and put the old one back after."""
    sched = engine.scheduler
    if getattr(sched, "slo", None) is None:
        yield
        return
    saved = sched.step_model
    sched.step_model = FREE_STEPS
    try:
        yield
    finally:
        sched.step_model = saved


def run_sweep(engine: Engine, sweep: ClippedSweep, seed: int = 0) -> list[StepRecord]:
    """Run every phase of ``sweep`` on ``engine`` (idle on return); the steps they ran."""
    with slo_rules_off(engine):
        return _run_phases(SweepRunner(engine, seed), sweep)


def _run_phases(run: SweepRunner, sweep: ClippedSweep) -> list[StepRecord]:
    engine = run.engine
    try:
        run.engine.reset_prefix_cache()
        run.add(run.prompt(sweep.short_prompt), sweep.decode_tokens)  # warm-up, not recorded
        run.add(run.prompt(sweep.short_prompt), sweep.decode_tokens)
        run.drain()
        first = engine.num_steps
        for _ in range(sweep.chunk_repeats):
            for n in sweep.chunk_sizes:
                run.add(run.prompt(n), 1)
                run.drain()
        for b in sweep.short_batches:
            for _ in range(b):
                run.add(run.prompt(sweep.short_prompt), sweep.decode_tokens)
            run.drain()
        if sweep.long_context:
            _long_phases(run, sweep)
        elif sweep.mixed_chunks:
            for n in sweep.mixed_chunks:
                for _ in range(sweep.mixed_batch):
                    run.add(run.prompt(sweep.short_prompt), sweep.decode_tokens)
                run.drain(on_step=1, later=[run.prompt(n)])
        return [r for r in engine.step_log if r.index > first]
    finally:
        run.finish()


def _long_phases(run: SweepRunner, sweep: ClippedSweep) -> None:
    """Cached chunks, long decodes and mixed steps over one shared ``long_context`` prefix."""
    prefix = run.prompt(sweep.long_context)
    run.add(prefix + run.prompt(SUFFIX_TOKENS), 1)  # computes the prefix once; the cache keeps it
    run.drain()
    for n in sweep.cached_chunks:
        run.add(prefix + run.prompt(n), 1)
        run.drain()
    for b in sweep.long_batches:
        for _ in range(b):
            run.add(prefix + run.prompt(SUFFIX_TOKENS), sweep.decode_tokens)
        run.drain()
    for n in sweep.mixed_chunks:
        for _ in range(sweep.mixed_batch):
            run.add(prefix + run.prompt(SUFFIX_TOKENS), sweep.decode_tokens)
        run.drain(on_step=1, later=[run.prompt(n)])


def samples_of(records: Sequence[StepRecord]) -> list[StepSample]:
    """The step-time model's view of the records: shape and whole-step wall time."""
    return [StepSample(StepShape(r.new_tokens, r.seqs, r.kv_tokens_read), r.seconds) for r in records]
