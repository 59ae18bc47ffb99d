"""Engine: add_request / step / abort, with streaming outputs. The one loop everything uses.

Each step: the scheduler picks which tokens of which requests run and which blocks they write;
the runner computes them and samples; the scheduler records the new tokens; the engine then
detokenizes, checks stop conditions and frees finished requests' blocks at once.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from fitserve.config import EngineConfig
from fitserve.dist.comm import CollectiveError
from fitserve.engine.beams import BeamSearches
from fitserve.engine.builder import build_engine_parts
from fitserve.engine.guides import guide_states
from fitserve.engine.outputs import Tracked, advance_output, can_speculate, failed_output
from fitserve.kv.manager import KVStats
from fitserve.ledger.step_time import StepShape
from fitserve.loading import IncrementalDetokenizer, LoadedModel
from fitserve.runner.placement import check_max_model_len, release_freed_host_memory
from fitserve.sampling import RequestSamplingState, SamplingParams
from fitserve.sampling.beam_search import BeamSearchParams
from fitserve.sampling.token_masks import build_token_masks
from fitserve.sched.request import SchedRequest
from fitserve.sched.slo import step_shape
from fitserve.spec_decode.stats import SpecDecodeStats
from fitserve.structured.compiler import GrammarCompiler
from fitserve.structured.guided import GuidedDecoding
from fitserve.types import (
    FinishReason,
    RequestOutput,
    RequestStatus,
    RunnerOutput,
    SchedulerOutput,
    StepRecord,
)

log = logging.getLogger("fitserve.engine")

FaultHook = Callable[[Sequence[str]], None]
"""Called with the request ids of each (sub-)step before it runs; raising fails it (tests
inject faults through it)."""

BUSY_GAP_S = 0.05
"""A pause between two steps longer than this is idle time, not part of the earlier step."""

STEP_LOG_LEN = 1 << 14
"""Steps :attr:`Engine.step_log` keeps (the newest)."""

@dataclass(slots=True)
class EngineStats:
    """A snapshot for metrics and the dashboard."""

    num_running: int
    num_waiting: int
    total_preemptions: int
    kv: KVStats
    block_owners: dict[int, list[str]] = field(default_factory=dict)
    evictable_blocks: list[int] = field(default_factory=list)
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters (None: off)
    num_steps: int = 0  # model steps run since start
    slo_rejected: int = 0  # requests the slo policy turned away (predicted TTFT too long)
    slo_deprioritized: int = 0  # ... or queued behind the on-time ones
    slo_step_time_correction: float | None = None  # measured / predicted step time (slo policy)
    kv_block_bytes: int = 0  # bytes of one KV block, all layers (kv.touched_blocks x this: resident)


class Engine:
    """A step-level inference engine over a paged KV cache with continuous batching."""

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None) -> None:
        parts = build_engine_parts(config or EngineConfig(), loaded)
        self.config = cfg = parts.config
        self.device, self.dtype = parts.device, parts.dtype
        self.loaded, self.weights_choice = parts.loaded, parts.weights_choice
        self.spec, self.tokenizer, self.max_model_len = parts.spec, parts.tokenizer, parts.max_model_len
        self.tp_group = parts.tp_group
        if self.tp_group is not None:
            weakref.finalize(self, self.tp_group.shutdown)
        self.pool, self.kv, self.scheduler = parts.pool, parts.kv, parts.scheduler
        self.runner = parts.runner
        self.spec_decode = parts.spec_decode
        self.speculative_config = cfg.speculative
        self.spec_stats = None if self.spec_decode is None else self.spec_decode.stats
        self.startup_seconds: dict[str, float] = dict(parts.startup_seconds)
        self._trim_after_prefill = self.device.type == "cpu"
        self._requests: dict[str, Tracked] = {}
        # structured output: compiled grammars, cached (its LLTokenizer is built on first use)
        self.grammars = GrammarCompiler()
        self._beams = BeamSearches(self.scheduler, self.tokenizer, str(self.device))
        self.num_steps = 0  # model steps run (for tokens per target step)
        # every step's shape and wall time, newest last (the profiler and the step-time model)
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG_LEN)
        self._ids = itertools.count()
        # NOTE: fault injection for tests (they set it): None in normal use, so a step costs
        # one attribute check.
        self.fault_hook: FaultHook | None = None
        if cfg.scheduler.scheduling_policy == "slo":
            self._load_step_model()
        torch.manual_seed(cfg.seed)

    def _load_step_model(self) -> None:
        """The slo policy's step-time model: the saved one of this setup, else measured now by
        running calibration steps on this engine (fitserve.engine.calibrate)."""
        from fitserve.engine.calibrate import resolve_step_model

        t0 = time.perf_counter()
        model = resolve_step_model(self)
        self.scheduler.step_model = model
        self.startup_seconds["step_model"] = time.perf_counter() - t0
        self.step_log.clear()  # calibration steps are not the engine's work
        self.num_steps = 0
        log.info("slo scheduling with %s (%s)", model.describe(), model.source or "no source")

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
    ) -> str:
        """Queue a request; raises ValueError (and changes nothing) if it is invalid, and
        :class:`fitserve.sched.slo.AdmissionRejected` if the slo policy turns it away."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("Engine.add_request takes n=1; use add_requests (one prompt, n samples)")
        return self.add_requests(prompt, [params], [request_id] if request_id is not None else None,
                                 priority=priority, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)[0]

    def add_requests(
        self,
        prompt: str | Sequence[int],
        params: Sequence[SamplingParams],
        request_ids: Sequence[str] | None = None,
        *,
        priority: int = 0,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
    ) -> list[str]:
        """Queue ``len(params)`` requests on one prompt (OpenAI's ``n``), each with its own
        parameters (``n=1`` each; seeds are the caller's: vLLM gives child j ``seed + j``).

        ``priority`` (lower first) needs the ``priority`` policy; ``slo_ttft_ms`` /
        ``slo_tpot_ms`` override the slo policy's targets for these requests.

        The prompt is computed once: the first request computes it, every request samples its
        first token from those logits, then the others fork its block table (copy-on-write; see
        :mod:`fitserve.sched.scheduler`). All are queued or, on a ValueError, none.

        A request with ``guided`` set gets its own grammar state (:mod:`fitserve.structured`):
        an invalid schema / regex / grammar, or a ``logit_bias`` id outside the vocabulary, is a
        ValueError here. Its outputs then always match the grammar; it finishes with
        ``finish_reason`` stop once the grammar is complete (EOS is allowed only where it is).
        """
        if not params:
            raise ValueError("add_requests needs at least one SamplingParams")
        if any(p.n != 1 for p in params):
            raise ValueError("each request of add_requests takes n=1")
        if request_ids is None:
            request_ids = [f"req-{next(self._ids)}" for _ in params]
        if len(request_ids) != len(params) or len(set(request_ids)) != len(request_ids):
            raise ValueError(f"{len(params)} requests need as many distinct request ids, got {list(request_ids)}")
        for rid in request_ids:
            if rid in self._requests or rid in self._beams:
                raise ValueError(f"request id {rid!r} is already in use")
        prompt_ids = self._checked_prompt(prompt)
        prompt_top = _prompt_logprobs_top(params, tp=self.tp_group is not None)
        room = self.max_model_len - len(prompt_ids)
        overrides = _slo_overrides(slo_ttft_ms, slo_tpot_ms)
        guides = guide_states(self.grammars, params, self.tokenizer, self.spec.vocab_size)
        masks = [build_token_masks(p, self.tokenizer, self.spec.vocab_size, self.tokenizer.eos_token_ids)
                 for p in params]  # allowed_token_ids / bad_words / min_tokens (ValueError: none queued)
        scheds = [SchedRequest(request_id=rid, prompt_token_ids=prompt_ids,
                               max_tokens=room if p.max_tokens is None else min(p.max_tokens, room),
                               priority=priority, slo_ttft_s=overrides[0], slo_tpot_s=overrides[1])
                  for rid, p in zip(request_ids, params, strict=True)]
        scheds[0].fork_children = scheds[1:]
        # NOTE: prompt logprobs need the logits of every prompt position, so the request that
        # computes the prompt takes no prefix-cache hit (as vLLM: it recomputes the cached
        # part); the blocks it fills are still cached for later requests.
        scheds[0].skip_prefix_hits = prompt_top is not None
        # the group's one prompt-logprobs list, filled by the first request's prefill
        shared_prompt_lps = None if prompt_top is None else [None] * len(prompt_ids)
        self.scheduler.add_request(scheds[0])  # validates against the pool before anything is kept
        now = time.monotonic()
        for sched, p, guide, mask in zip(scheds, params, guides, masks, strict=True):
            sampling = RequestSamplingState.create(p, prompt_ids, sched.output_token_ids, device=str(self.device))
            sampling.guide = guide
            sampling.token_masks = mask
            sampling.num_prompt_logprobs = prompt_top if sched is scheds[0] else None
            self._requests[sched.request_id] = Tracked(
                sched=sched,
                params=p,
                sampling=sampling,
                detok=IncrementalDetokenizer(self.tokenizer, prompt_ids, p.skip_special_tokens),
                max_tokens=sched.max_tokens,
                arrival_time=now,
                logprobs=[] if p.logprobs is not None else None,
                prompt_logprobs=shared_prompt_lps if p.prompt_logprobs is not None else None,
                speculates=self.speculative_config is not None and can_speculate(p),
            )
        return list(request_ids)

    def add_beam_search(
        self, prompt: str | Sequence[int], params: BeamSearchParams, request_id: str | None = None,
        *, guided: GuidedDecoding | None = None,
    ) -> str:
        """Queue a beam search (vLLM's ``LLM.beam_search`` for one prompt): ``beam_width``
        beams over shared, copy-on-write block tables, advancing in the same steps as every
        other request. Its one output comes at the end: ``RequestOutput.beams``, best first.

        ``guided`` is refused (ValueError): beams are ranked by the model's own logprobs, which
        a grammar mask on some beams' candidates would make meaningless.
        """
        if guided is not None:
            raise ValueError("guided decoding (structured output) is not supported with beam search")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests or rid in self._beams:
            raise ValueError(f"request id {rid!r} is already in use")
        prompt_ids = self._checked_prompt(prompt)
        if 2 * params.beam_width > self.spec.vocab_size:
            raise ValueError(f"beam_width={params.beam_width} needs 2 x {params.beam_width} candidate "
                             f"tokens, more than the vocabulary's {self.spec.vocab_size}")
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        eos = frozenset() if params.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        self._beams.add(rid, prompt_ids, params, max_tokens, eos)
        return rid

    def _checked_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, but max_model_len={self.max_model_len} leaves "
                "no room to generate"
            )
        return prompt_ids

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.spec.vocab_size}): {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def abort(self, request_id: str) -> bool:
        """Stop a request now and return every block it held. False if it was unknown."""
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return self._beams.abort(request_id)
        self.scheduler.finish(request_id)
        return True

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without --tp); idempotent."""
        if self.tp_group is not None:
            self.tp_group.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(len(self._beams))

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests) + len(self._beams)

    def is_queued(self, request_id: str) -> bool:
        """True while a request waits for its first step (added, never scheduled yet).

        A preempted request waits again but is not "queued": it was admitted before.
        """
        if request_id in self._beams:
            return self._beams.is_queued(request_id)
        req = self.scheduler.get(request_id)
        return req is not None and req.status == RequestStatus.WAITING

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return an output for every request that got a new token.

        A request whose part of the step fails is isolated (see :meth:`_execute`): it alone
        finishes with ``finish_reason=ERROR`` and the exception in ``error``, its blocks are
        freed, and the others carry on. Only a failure outside the model step (scheduling,
        bookkeeping) still raises.
        """
        t_start = time.perf_counter()
        drafts = {} if self.spec_decode is None else self.spec_decode.propose(self.scheduler, self._requests)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        if self.spec_decode is not None:
            plan.spec_decode = self.spec_decode.step_inputs(plan, drafts)
        self.num_steps += 1
        beams = self._beams
        # NOTE: every chunk's request, not only the sampling ones: the runner reads prompt
        # lengths from them (LongRoPE's long factors, fitserve.runner.rope_rows)
        states = {rid: beams.state(rid) if beams.is_beam(rid) else self._requests[rid].sampling
                  for c in plan.chunks for rid in (c.request_id, *(c.fanout if c.sample else ()))}
        t_forward = time.perf_counter()
        result, failed = self._execute(plan, states, top=True)
        t_forward = time.perf_counter() - t_forward
        if self.spec_decode is not None:
            self.spec_decode.after_step(plan, result, set(failed))
        if self._trim_after_prefill and any(len(c.token_ids) > 1 for c in plan.chunks):
            # NOTE: glibc keeps a prefill step's freed transients (K/V copies, SDPA tiles,
            # q/k/v and MLP rows: 0.1-16 MiB each) in a fragmented heap, and raises its mmap
            # threshold after each, so the resident set creeps step by step past the ledger
            # (x1.17 at 8 x 4k-token prompts, tests/numerics/test_plan_consistency.py).
            # Trimming after the steps that make them returns those pages; decode-only steps
            # (small, reused allocations) skip it.
            release_freed_host_memory()
        now = time.monotonic()
        outputs = []
        for rid, exc in failed.items():
            if rid in self._requests:
                outputs.append(self._fail(rid, self._requests[rid], exc, now))
            elif beams.is_beam(rid):  # one beam failing ends its whole search
                outputs.append(beams.fail(rid, exc, now))
        beam_ids = [rid for rid in result.sampled if beams.is_beam(rid)]
        sampled = {rid: t for rid, t in result.sampled.items() if rid in self._requests}
        self.scheduler.update(plan, sampled, result.emitted)  # skips the failed ones: they are finished
        for rid in beam_ids:  # beams choose their tokens as a group, once all have reported
            if beams.is_beam(rid):
                done = beams.on_sampled(rid, result.logprobs[rid], now)
                if done is not None:
                    outputs.append(done)
        self._store_prompt_logprobs(result)
        num_drafts = {c.request_id: c.num_draft for c in plan.chunks if c.num_draft}
        for rid, token in sampled.items():
            tracked = self._requests[rid]
            tokens = result.emitted.get(rid)
            if tokens is not None and self.spec_decode is not None:  # a verified chunk
                self.spec_decode.observe(num_drafts[rid], tokens, tracked)
            try:
                if tracked.logprobs is not None and rid in result.logprobs:
                    tracked.logprobs.append(result.logprobs[rid])
                outputs.append(self._advance(rid, tracked, tokens or [token], now))
            except Exception as exc:  # noqa: BLE001 - detokenizing one request must not end all
                outputs.append(self._fail(rid, tracked, exc, now))
        self._record_step(plan, t_start, t_forward)
        return outputs

    def _store_prompt_logprobs(self, result: RunnerOutput) -> None:
        """File this step's prompt logprobs by prompt index (a recompute rewrites the same)."""
        for rid, (first, entries) in result.prompt_logprobs.items():
            tracked = self._requests.get(rid)
            if tracked is not None and tracked.prompt_logprobs is not None:
                tracked.prompt_logprobs[first: first + len(entries)] = entries

    def _record_step(self, plan: SchedulerOutput, t_start: float, forward_s: float) -> None:
        slo = self.scheduler.slo
        if slo is not None and self.step_log:
            # the previous step's time as a client sees it: start to this start, when the
            # engine went straight on (a longer gap was idle time, not the step's)
            prev = self.step_log[-1]
            gap = t_start - (prev.start + prev.seconds)
            took = t_start - prev.start if gap < BUSY_GAP_S else prev.seconds
            slo.observe(StepShape(prev.new_tokens, prev.seqs, prev.kv_tokens_read), took)
        shape = step_shape(plan)
        prefill = sum(len(c.token_ids) for c in plan.chunks if len(c.token_ids) > 1 and not c.num_draft)
        decodes = sum(1 for c in plan.chunks if len(c.token_ids) == 1 or c.num_draft)
        self.step_log.append(StepRecord(
            index=self.num_steps, start=t_start, seconds=time.perf_counter() - t_start,
            forward_seconds=forward_s, new_tokens=shape.new_tokens, seqs=shape.seqs,
            kv_tokens_read=shape.kv_tokens_read, num_prefill_tokens=prefill, num_decodes=decodes,
            prefill_cap=plan.prefill_cap))

    def _execute(
        self, plan: SchedulerOutput, states: dict[str, RequestSamplingState], top: bool = False
    ) -> tuple[RunnerOutput, dict[str, Exception]]:
        """Run ``plan``; if it raises, rerun its chunks in halves until the failing ones are found.

        Returns the merged result of the parts that ran and the exception of each request that
        failed alone. A fault that is not any one request's (every half fails) fails them all,
        one by one: about 2n runs for n requests, only on the error path.

        NOTE: rerunning is safe because a chunk writes its K/V to fixed slots (rerunning writes
        the same slots again) and the scheduler advances nothing until ``update``. Sampling
        state that a failed run already consumed (a seeded generator) is not rewound.
        """
        try:
            if self.fault_hook is not None:
                self.fault_hook([c.request_id for c in plan.chunks])
            return self.runner.execute(plan, states), {}
        except CollectiveError:
            raise  # the tensor-parallel group is broken: every request's, not one request's
        except Exception as exc:  # noqa: BLE001 - isolated below, reported per request
            if len(plan.chunks) == 1:
                return RunnerOutput(sampled={}), {plan.chunks[0].request_id: exc}
            if top:
                log.warning("a step of %d requests failed (%s: %s); rerunning them in halves to "
                            "isolate the failing one", len(plan.chunks), type(exc).__name__, exc)
        merged = RunnerOutput(sampled={})
        failed: dict[str, Exception] = {}
        mid = len(plan.chunks) // 2
        for part in (plan.chunks[:mid], plan.chunks[mid:]):
            # the copies run again with each half: harmless, they rewrite the same blocks
            sub = SchedulerOutput(chunks=part, num_batched_tokens=sum(len(c.token_ids) for c in part),
                                  block_copies=plan.block_copies, spec_decode=plan.spec_decode)
            result, bad = self._execute(sub, states)
            merged.update(result)
            failed.update(bad)
        return merged, failed

    def _fail(self, rid: str, t: Tracked, exc: Exception, now: float) -> RequestOutput:
        """Finish a request that failed: free its blocks now and report the error."""
        self._requests.pop(rid, None)
        self.scheduler.finish(rid)
        return failed_output(rid, t, exc, now)

    def _advance(self, rid: str, t: Tracked, tokens: list[int], now: float) -> RequestOutput:
        out = advance_output(rid, t, tokens, now, max_model_len=self.max_model_len,
                             eos_token_ids=self.tokenizer.eos_token_ids)
        if out.finished:
            self._requests.pop(rid, None)
            self.scheduler.finish(rid)
        return out

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Run one request to completion on this engine, yielding its outputs as they come.

        It drives step() itself, so it needs the engine to itself: other requests' outputs
        would be lost. With others in flight, use add_request/step instead.
        """
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"Engine.stream needs an idle engine; {self.num_unfinished_requests} other request(s) are "
                "in flight (use add_request/step)"
            )
        rid = self.add_request(prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        if out.error is not None:
                            raise out.error
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no request holds (vLLM's ``reset_prefix_cache``), e.g. so
        each timed run of a benchmark computes its prompts; returns how many blocks it dropped."""
        return self.kv.reset_prefix_cache()

    def stats(self, with_owners: bool = False) -> EngineStats:
        """Queue and pool counts; ``with_owners`` adds who holds each block and which free
        blocks still hold a cached prefix (for the dashboard)."""
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            total_preemptions=self.scheduler.total_preemptions,
            kv=self.kv.stats(),
            block_owners=self.kv.block_owners() if with_owners else {},
            evictable_blocks=self.kv.pool.evictable_block_ids() if with_owners else [],
            spec_decode=copy.deepcopy(self.spec_stats),
            num_steps=self.num_steps,
            slo_rejected=0 if self.scheduler.slo is None else self.scheduler.slo.num_rejected,
            slo_deprioritized=0 if self.scheduler.slo is None else self.scheduler.slo.num_deprioritized,
            slo_step_time_correction=None if self.scheduler.slo is None else self.scheduler.slo.correction,
            kv_block_bytes=self.pool.block_bytes,
        )

    def request_of(self, scheduler_id: str) -> str:
        """The request a scheduler entry belongs to: a beam's search, else itself."""
        return self._beams.group_of(scheduler_id) or scheduler_id


def _prompt_logprobs_top(params: Sequence[SamplingParams], tp: bool) -> int | None:
    """Alternatives per prompt token the group's prefill keeps: the largest ``prompt_logprobs``
    of ``params`` (None: no request asks)."""
    asked = [p.prompt_logprobs for p in params if p.prompt_logprobs is not None]
    if not asked:
        return None
    if tp:
        raise ValueError("prompt_logprobs are not supported with tensor parallelism (--tp)")
    return max(asked)


def _slo_overrides(ttft_ms: float | None, tpot_ms: float | None) -> tuple[float | None, float | None]:
    """A request's own SLO targets in seconds; a value that is not > 0 is a ValueError."""
    out = []
    for name, v in (("slo_ttft_ms", ttft_ms), ("slo_tpot_ms", tpot_ms)):
        if v is not None and not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a number > 0, got {v!r}")
        out.append(None if v is None else float(v) / 1000)
    return out[0], out[1]


__all__ = ["Engine", "EngineStats", "FinishReason", "RequestOutput", "check_max_model_len"]
