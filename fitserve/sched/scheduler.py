"""Continuous batching under one token budget per step, vLLM v1 style. Torch-free.

There are no prefill or decode phases. Each request has ``num_computed_tokens`` (in the KV
cache) and ``num_tokens`` (prompt + outputs); a step gives each request a chunk of the
difference, running requests first (oldest first), then waiting ones (FIFO)::

    budget 8, threshold none          step k                       step k+1
    A running, 1 token to go          A: [a9]            (1)       A: [a10]          (1)
    B running, 1 token to go          B: [b4]            (1)       B: [b5]           (1)
    C waiting, 20-token prompt        C: [c0 .. c5]      (6)       C: [c6 .. c11]    (6)

A chunk samples a token only when it reaches the request's last known token; after that
step ``num_tokens == num_computed_tokens + 1`` (the new token is not in the cache yet), so a
decode is just a chunk of length 1.

When the pool runs out, the newest running request is preempted by recompute: its blocks are
freed, ``num_computed_tokens`` drops to 0, and it waits at the front of the queue; when it is
admitted again it recomputes prompt + outputs so far in chunks like any prompt.

Prefix caching: after each step, the blocks a request has fully computed are registered under
their chained hashes (prompt and generated tokens alike). A waiting request being admitted
looks its hashes up; the blocks found start its table and count as computed, so its first
chunk starts after them (at least its last token is always computed, to sample from)::

    block_size 4, A computed [s0 .. s9] (blocks h0 h1 registered), B = [s0 .. s7, b8 .. b13]
    B admitted: hits h0 h1 -> num_computed_tokens = 8, first chunk [b8 .. b13] at start_pos 8

A preempted request's registered blocks become evictable, not lost: readmitted, it may hit them.
"""

from __future__ import annotations

import bisect
from collections import deque

from fitserve.config import SchedulerConfig
from fitserve.kv.manager import KVCacheManager
from fitserve.kv.prefix_hash import extend_block_hashes
from fitserve.sched.request import SchedRequest
from fitserve.types import RequestStatus, ScheduledChunk, SchedulerOutput


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Decides, each step, which tokens of which requests run and which blocks they write.

    Protocol: ``schedule()`` -> run the model on its chunks -> ``update(out, sampled)``;
    ``add_request`` and ``finish`` may be called between any two of those calls.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError(
                "max_num_batched_tokens and max_num_seqs must be >= 1, got "
                f"{config.max_num_batched_tokens} and {config.max_num_seqs}"
            )
        t = config.long_prefill_token_threshold
        if t is not None and t < 1:
            raise ValueError(f"long_prefill_token_threshold must be >= 1 or None, got {t}")
        self.config = config
        self.kv = kv
        self.running: list[SchedRequest] = []  # sorted by arrival, oldest first
        self.waiting: deque[SchedRequest] = deque()
        self.total_preemptions: int = 0
        self._requests: dict[str, SchedRequest] = {}  # every unfinished request
        self._next_arrival = 0

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, req: SchedRequest) -> None:
        """Queue a new request; raises ValueError for a request that could never run."""
        rid = req.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler")
        n = len(req.prompt_token_ids)
        mml = self.config.max_model_len
        if n == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if req.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {req.max_tokens}")
        if n >= mml:
            raise ValueError(
                f"request {rid!r}: prompt of {n} tokens leaves no room for output: "
                f"max_model_len={mml}"
            )
        # The longest this request can get; it must fit in the pool alone, or preempting
        # everyone else would still not let it finish.
        longest = min(n + req.max_tokens, mml)
        bs = self.kv.block_size
        need, total = _cdiv(longest, bs), self.kv.pool.num_blocks
        if need > total:
            raise ValueError(
                f"request {rid!r} can grow to {longest} tokens, which needs {need} blocks of "
                f"{bs} slots, but the whole KV pool has {total} blocks ({total * bs} slots); "
                "lower max_model_len or max_tokens, or give the KV cache more memory"
            )
        req.arrival = self._next_arrival
        self._next_arrival += 1
        req.status = RequestStatus.WAITING
        self._requests[rid] = req
        self.waiting.append(req)

    def finish(self, request_id: str) -> SchedRequest | None:
        """Remove a request (stop, length or abort) and free all its blocks now."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(request_id)
        req.status = RequestStatus.FINISHED
        return req

    def get(self, request_id: str) -> SchedRequest | None:
        """The unfinished request with this id, if any."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks within the token budget, preempting if the pool runs out."""
        out = SchedulerOutput(chunks=[], num_batched_tokens=0)
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        # NOTE: after a preemption the pool is tight; admitting new work now would only
        # cause more preemptions next step.
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(len(c.token_ids) for c in out.chunks)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        return out

    def _chunk_len(self, req: SchedRequest, budget: int, computed: int | None = None) -> int:
        done = req.num_computed_tokens if computed is None else computed
        n = min(req.num_tokens - done, budget)
        t = self.config.long_prefill_token_threshold
        return n if t is None else min(n, t)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk_len(req, budget)
            if num_new <= 0:
                i += 1
                continue
            target = req.num_computed_tokens + num_new
            while not self.kv.allocate(req.request_id, target):
                victim = self.running[-1]  # newest; always at index >= i
                self._preempt(victim, out)
                if victim is req:
                    return budget  # nothing older is left to take blocks from
            out.chunks.append(self._make_chunk(req, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits = self._lookup_prefix(req)
            num_cached = len(hits) * self.kv.block_size
            num_new = self._chunk_len(req, budget, computed=num_cached)
            if not self.kv.allocate(req.request_id, num_cached + num_new, hits):
                break  # FIFO: never let a later request jump ahead of this one
            self.kv.record_prefix_lookup(req.num_tokens, num_cached)
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival)
            out.chunks.append(self._make_chunk(req, num_new))
            budget -= num_new

    def _lookup_prefix(self, req: SchedRequest) -> list[int]:
        """The cached blocks a waiting request (no blocks, nothing computed) can start from."""
        if not self.kv.enable_caching:
            return []
        self._extend_hashes(req, req.num_tokens)
        return self.kv.get_computed_blocks(req.block_hashes, req.num_tokens)

    def _extend_hashes(self, req: SchedRequest, num_tokens: int) -> None:
        """Hash the request's full blocks among its first ``num_tokens`` tokens (new ones only)."""
        n = num_tokens // self.kv.block_size
        if len(req.block_hashes) < n:
            extend_block_hashes(req.block_hashes, req.all_token_ids, self.kv.block_size, n,
                                req.cache_extra_keys)

    def _preempt(self, req: SchedRequest, out: SchedulerOutput) -> None:
        # Newest-first preemption while walking oldest-first means the victim has not been
        # given a chunk this step; a chunk for it would write into blocks we just freed.
        assert all(c.request_id != req.request_id for c in out.chunks), req.request_id
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_ids.append(req.request_id)

    def _make_chunk(self, req: SchedRequest, num_new: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + num_new
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:end],
            start_pos=start,
            block_table=self.kv.block_table(req.request_id),
            sample=end == req.num_tokens,
        )

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance each scheduled request by its chunk and append its sampled token.

        Chunks of requests finished or aborted since ``schedule()`` are ignored.
        """
        for chunk in out.chunks:
            req = self._requests.get(chunk.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            if chunk.start_pos != req.num_computed_tokens:
                raise RuntimeError(
                    f"stale chunk for {chunk.request_id!r}: starts at {chunk.start_pos}, "
                    f"request has {req.num_computed_tokens} computed tokens"
                )
            req.num_computed_tokens += len(chunk.token_ids)
            if chunk.sample and chunk.request_id in sampled:
                req.output_token_ids.append(sampled[chunk.request_id])
            if self.kv.enable_caching:
                # the K/V of this chunk is written now: offer the blocks it filled to the cache
                self._extend_hashes(req, req.num_computed_tokens)
                self.kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
