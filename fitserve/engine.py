"""Engine: add_request / step / abort, with streaming outputs. The one loop everything uses.

Each step: the scheduler picks which tokens of which requests run and which blocks they write;
the runner computes them and samples; the scheduler records the new tokens; the engine then
detokenizes, checks stop conditions and frees finished requests' blocks at once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from fitserve.config import EngineConfig, SchedulerConfig
from fitserve.engine_setup import (
    check_pool_fits,
    release_freed_host_memory,
    resolve_device,
    resolve_dtype,
    size_kv_pool,
)
from fitserve.kv.manager import KVCacheManager, KVStats
from fitserve.loading import IncrementalDetokenizer, LoadedModel, load_model
from fitserve.model.llama import build_model, check_supported
from fitserve.runner import ModelRunner
from fitserve.sampling import RequestSamplingState, SamplingParams
from fitserve.sampling.stop import check_stop
from fitserve.sched.request import SchedRequest
from fitserve.sched.scheduler import Scheduler
from fitserve.types import FinishReason, RequestOutput, TokenLogprobs


@dataclass(slots=True)
class _Tracked:
    """Engine-side state of one request (the scheduler holds the token-level state)."""

    sched: SchedRequest
    params: SamplingParams
    sampling: RequestSamplingState
    detok: IncrementalDetokenizer
    max_tokens: int
    arrival_time: float
    text: str = ""
    sent_tokens: int = 0
    sent_chars: int = 0
    logprobs: list[TokenLogprobs] | None = None
    first_token_time: float | None = None


@dataclass(slots=True)
class EngineStats:
    """A snapshot for metrics and the dashboard."""

    num_running: int
    num_waiting: int
    total_preemptions: int
    kv: KVStats
    block_owners: dict[int, list[str]] = field(default_factory=dict)


class Engine:
    """A step-level inference engine over a paged KV cache with continuous batching."""

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.loaded = loaded if loaded is not None else load_model(cfg.model, dtype=self.dtype)
        self.spec = self.loaded.spec
        check_supported(self.spec)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = cfg.max_model_len or self.spec.max_position_embeddings
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        model = build_model(
            self.spec, self.loaded.weights, dtype=self.dtype, device=self.device,
            max_positions=self.max_model_len,
        )
        if loaded is None:
            self.loaded.weights = {}  # the model holds its own copies; don't keep two
        if self.device.type == "cpu":
            # Hand the loader's freed scratch back to the OS before the KV pool is allocated,
            # so the process peak is what the ledger says (see release_freed_host_memory).
            release_freed_host_memory()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.pool = size_kv_pool(cfg, self.spec, self.dtype, self.device, weight_bytes)
        check_pool_fits(self.pool, self.max_model_len)
        self.kv = KVCacheManager(self.pool.num_blocks, cfg.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                max_model_len=self.max_model_len,
                long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            ),
            self.kv,
        )
        self.runner = ModelRunner(
            model, self.spec, num_blocks=self.pool.num_blocks, block_size=cfg.block_size,
            kv_dtype=self.dtype, device=self.device,
        )
        self._requests: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        torch.manual_seed(cfg.seed)

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises ValueError (and changes nothing) if it is invalid."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("Engine.add_request takes n=1; LLM.generate and the server fan out n>1")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, but max_model_len={self.max_model_len} leaves "
                "no room to generate"
            )
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        sched = SchedRequest(request_id=rid, prompt_token_ids=prompt_ids, max_tokens=max_tokens, arrival=0)
        self.scheduler.add_request(sched)  # validates against the pool before anything is kept
        self._requests[rid] = _Tracked(
            sched=sched,
            params=params,
            sampling=RequestSamplingState.create(params, prompt_ids, sched.output_token_ids, device=str(self.device)),
            detok=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens),
            max_tokens=max_tokens,
            arrival_time=time.monotonic(),
            logprobs=[] if params.logprobs is not None else None,
        )
        return rid

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
            return False
        self.scheduler.finish(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return an output for every request that got a new token."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        states = {c.request_id: self._requests[c.request_id].sampling for c in plan.chunks if c.sample}
        result = self.runner.execute(plan, states)
        self.scheduler.update(plan, result.sampled)
        now = time.monotonic()
        outputs = []
        for rid, token in result.sampled.items():
            tracked = self._requests[rid]
            if tracked.logprobs is not None and rid in result.logprobs:
                tracked.logprobs.append(result.logprobs[rid])
            outputs.append(self._advance(rid, tracked, token, now))
        return outputs

    def _advance(self, rid: str, t: _Tracked, token: int, now: float) -> RequestOutput:
        if t.first_token_time is None:
            t.first_token_time = now
        delta = t.detok.push(token)
        t.text += delta
        p = t.params
        decision = check_stop(
            token_id=token,
            num_output_tokens=len(t.sched.output_token_ids),
            max_tokens=t.max_tokens,
            num_total_tokens=t.sched.num_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.tokenizer.eos_token_ids,
            stop_token_ids=p.stop_token_ids,
            ignore_eos=p.ignore_eos,
            text=t.text,
            new_text_len=len(delta),
            stop_strings=p.stop or [],
            include_stop_str=p.include_stop_str_in_output,
        )
        finished = decision is not None
        if decision is not None and decision.text_end is not None:
            t.text = t.text[: decision.text_end]
        # Streaming holds back a tail that might still become a stop string.
        holdback = 0 if finished or not p.stop else max(len(s) for s in p.stop) - 1
        visible = max(t.sent_chars, len(t.text) - holdback)
        tokens = t.sched.output_token_ids
        out = RequestOutput(
            request_id=rid,
            prompt_token_ids=t.sched.prompt_token_ids,
            token_ids=list(tokens),
            text=t.text[:visible],
            delta_token_ids=list(tokens[t.sent_tokens :]),
            delta_text=t.text[t.sent_chars : visible],
            logprobs=list(t.logprobs) if t.logprobs is not None else None,
            finished=finished,
            finish_reason=decision.reason if decision else None,
            stop_reason=decision.stop_reason if decision else None,
            arrival_time=t.arrival_time,
            first_token_time=t.first_token_time,
            finish_time=now if finished else None,
        )
        t.sent_tokens, t.sent_chars = len(tokens), visible
        if finished:
            self._requests.pop(rid, None)
            self.scheduler.finish(rid)
        return out

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Run one request to completion on this engine, yielding its outputs as they come.

        It drives step() itself, so it needs the engine to itself: other requests' outputs
        would be lost. With others in flight, use add_request/step instead.
        """
        if self._requests:
            raise RuntimeError(
                f"Engine.stream needs an idle engine; {len(self._requests)} other request(s) are "
                "in flight (use add_request/step)"
            )
        rid = self.add_request(prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)

    def stats(self, with_owners: bool = False) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            total_preemptions=self.scheduler.total_preemptions,
            kv=self.kv.stats(),
            block_owners=self.kv.block_owners() if with_owners else {},
        )


__all__ = ["Engine", "EngineStats", "FinishReason", "RequestOutput"]
