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

Sharing: an n>1 request computes its prompt once; the chunk that ends it samples the first
token of every child from the same logits (``ScheduledChunk.fanout``), then the children fork
its block table (ref counts) and go on alone. The first write into the shared partial block
copies it (copy-on-write: the runner copies the blocks in ``SchedulerOutput.block_copies``
first); the last holder writes it in place::

    block_size 4, prompt [p0 .. p5], n = 3    step k: A computes [p0 .. p5], samples a, b, c
    fork: B, C share A's [3, 8] (ref 3)       step k+1: A writes a at 6, B b, C c (block 8)
    A: 8 -> copy 9, B: 8 -> copy 10, C: writes block 8 in place (the last holder)

Layer groups (fitserve.kv.group): a model with sliding-window layers has its tables per group;
each chunk carries every group's (``ScheduledChunk.group_tables`` when there are several) and a
windowed group frees the blocks behind its window as the request's chunks are given slots.

Beam search forks and prunes through :meth:`Scheduler.fork`, :meth:`Scheduler.append_token` and
:meth:`Scheduler.finish`; a beam that sampled before its siblings is idle (nothing to compute)
until the group's next tokens are chosen.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from fitserve.config import SchedulerConfig
from fitserve.kv.manager import KVCacheManager
from fitserve.kv.prefix_hash import extend_block_hashes
from fitserve.ledger.kv import sharing_blocks, window_span_blocks
from fitserve.ledger.step_time import StepTimeModel
from fitserve.sched.request import SchedRequest
from fitserve.sched.slo import SLOController
from fitserve.types import RequestStatus, ScheduledChunk, SchedulerOutput


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Decides, each step, which tokens of which requests run and which blocks they write.

    Protocol: ``schedule()`` -> run the model on its chunks -> ``update(out, sampled)``;
    ``add_request`` and ``finish`` may be called between any two of those calls.

    ``config.scheduling_policy`` orders the running list and the queue (fcfs: arrival;
    priority: (priority, arrival); slo: (late, arrival)) and, for ``slo``, adds the chunk cap
    and admission of :mod:`fitserve.sched.slo`, which need ``step_model``. ``clock`` gives
    seconds (time.monotonic; tests pass a fake one).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, *,
                 step_model: StepTimeModel | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config.validate()
        self.config = config
        self.kv = kv
        self.policy = config.scheduling_policy
        self.clock = clock
        self.slo: SLOController | None = None
        if self.policy == "slo":
            self.slo = SLOController(config.slo_targets(), max_num_batched_tokens=config.max_num_batched_tokens,
                                     max_num_seqs=config.max_num_seqs,
                                     min_prefill_tokens=kv.block_size, step_model=step_model)
        self._prefill_left: int | None = None  # slo: prompt-chunk tokens this step may still take
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
        children = req.fork_children
        for c in children:
            if c.request_id in self._requests or c.request_id == rid:
                raise ValueError(f"request id {c.request_id!r} is already in the scheduler")
            if c.prompt_token_ids != req.prompt_token_ids or c.output_token_ids:
                raise ValueError(f"fork child {c.request_id!r} must have its parent's prompt and no output")
        if len({c.request_id for c in children}) != len(children):
            raise ValueError(f"request {rid!r} has fork children with the same id")
        seats = max(req.seats, 1 + len(children))
        if seats > self.config.max_num_seqs:
            raise ValueError(f"request {rid!r} needs {seats} sequences at once, more than "
                             f"max_num_seqs={self.config.max_num_seqs}")
        # The longest this request (and every sibling it forks) can get; it must fit in the
        # pool alone, or preempting everyone else would still not let it finish.
        longest = max(min(n + r.max_tokens, mml) for r in (req, *children))
        bs = self.kv.block_size
        # the planner's count of sequences sharing a prompt (one ledger): its full blocks once
        need = sharing_blocks(n, longest - n, seats, bs).shared if seats > 1 else _cdiv(longest, bs)
        for g in self.kv.groups:
            total = g.num_usable_blocks
            # a windowed group holds at most its window and one step's chunk per sequence
            held = need if g.window is None else min(need, seats * window_span_blocks(
                g.window, bs, self._max_chunk(longest)))
            if held > total:
                who = f"request {rid!r}" + (f" with its {seats - 1} siblings" if seats > 1 else "")
                pool = "the whole KV pool" if len(self.kv.groups) == 1 else f"the {g.group.kind} layers' KV pool"
                raise ValueError(
                    f"{who} can grow to {longest} tokens{' each' if seats > 1 else ''}, which needs {held} blocks of "
                    f"{bs} slots, but {pool} has {total} blocks ({total * bs} slots); "
                    "lower max_model_len or max_tokens, or give the KV cache more memory"
                )
        if req.priority != 0 and self.policy != "priority":
            raise ValueError(f"request {rid!r} has priority {req.priority}, but the scheduling policy is "
                             f"{self.policy!r}: priorities need --scheduling-policy priority")
        req.seats = seats
        req.arrival_time = self.clock()
        if self.slo is not None:  # may raise AdmissionRejected: nothing is queued then
            self.slo.admit(req, self.running, self.waiting)
        req.arrival = self._next_arrival
        self._next_arrival += 1
        req.status = RequestStatus.WAITING
        self._requests[rid] = req
        for c in children:
            c.awaiting_fork_of, c.status, c.arrival, c.seats = rid, RequestStatus.WAITING, req.arrival, 1
            c.priority, c.late, c.arrival_time = req.priority, req.late, req.arrival_time
            self._requests[c.request_id] = c
        self._enqueue(req)

    def _max_chunk(self, longest: int) -> int:
        """The most tokens one chunk of a request of ``longest`` tokens can hold."""
        t = self.config.long_prefill_token_threshold
        return min(longest, self.config.max_num_batched_tokens, t or longest)

    def fork(self, parent_id: str, child: SchedRequest) -> None:
        """Add ``child`` as a fork of a request: same prompt, its own outputs (which must extend
        the parent's tokens so far), the parent's block table shared (copy-on-write).

        The child takes its arrival (and so its place among the running) from the parent and one
        of the parent's seats while the parent holds more than one. A parent that is waiting
        (preempted) holds no blocks: the child then waits right behind it, to be recomputed.
        """
        parent = self._requests.get(parent_id)
        cid = child.request_id
        if parent is None or parent.awaiting_fork_of is not None:
            raise KeyError(f"fork from unknown request {parent_id!r}")
        if cid in self._requests:
            raise ValueError(f"request id {cid!r} is already in the scheduler")
        if child.prompt_token_ids != parent.prompt_token_ids or child.num_tokens <= parent.num_computed_tokens:
            raise ValueError(f"fork {cid!r} must share {parent_id!r}'s prompt and extend its computed tokens")
        child.arrival, child.seats, child.awaiting_fork_of = parent.arrival, 1, None
        child.priority, child.late, child.arrival_time = parent.priority, parent.late, parent.arrival_time
        parent.seats = max(1, parent.seats - 1)
        self._requests[cid] = child
        if parent.status == RequestStatus.RUNNING:
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_hashes = parent.block_hashes[: parent.num_computed_tokens // self.kv.block_size]
            self.kv.fork(parent_id, cid)
            child.status = RequestStatus.RUNNING
            bisect.insort(self.running, child, key=self._order_key)
        else:
            child.num_computed_tokens = 0
            child.status = RequestStatus.PREEMPTED
            self.waiting.insert(self.waiting.index(parent) + 1, child)

    def append_token(self, request_id: str, token_id: int) -> None:
        """Append a token chosen outside the sampler (beam search) to an unfinished request."""
        req = self._requests.get(request_id)
        if req is None or req.awaiting_fork_of is not None:
            raise KeyError(f"append to unknown request {request_id!r}")
        req.output_token_ids.append(token_id)

    def finish(self, request_id: str) -> SchedRequest | None:
        """Remove a request (stop, length or abort) and free all its blocks now."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        if req.awaiting_fork_of is not None:  # a child not forked yet: it holds nothing
            parent = self._requests[req.awaiting_fork_of]
            parent.fork_children.remove(req)
            parent.seats -= 1
            req.awaiting_fork_of = None
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(request_id)
        req.status = RequestStatus.FINISHED
        # children still waiting for this fork become plain requests, first in the queue (they
        # may hit the prompt blocks just freed in the prefix cache)
        for c in reversed(req.fork_children):
            c.awaiting_fork_of = None
            self._enqueue(c, front=True)
        req.fork_children = []
        return req

    # ---------------------------------------------------------------- policy order

    def _order_key(self, req: SchedRequest) -> tuple[int, int]:
        """Where a request stands among the running and in the queue (smaller first)."""
        if self.policy == "priority":
            return (req.priority, req.arrival)
        if self.policy == "slo":
            return (int(req.late), req.arrival)
        return (0, req.arrival)

    def _enqueue(self, req: SchedRequest, front: bool = False) -> None:
        """fcfs: the back of the queue (``front``: the front, a preempted request); the other
        policies: in order of :meth:`_order_key` (a preempted request keeps its arrival, so it
        lands ahead of everything newer of its class)."""
        if self.policy == "fcfs":
            if front:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
        else:
            bisect.insort(self.waiting, req, key=self._order_key)

    @property
    def step_model(self) -> StepTimeModel | None:
        """The step-time model the slo policy uses (None for other policies or not set yet)."""
        return None if self.slo is None else self.slo.step_model

    @step_model.setter
    def step_model(self, model: StepTimeModel | None) -> None:
        if self.slo is None:
            raise ValueError(f"the {self.policy!r} scheduling policy uses no step-time model")
        self.slo.step_model = model

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
        if self.slo is not None:
            if self.slo.mark_overdue(self.waiting, self.clock()):
                self.waiting = deque(sorted(self.waiting, key=self._order_key))
            self._prefill_left = out.prefill_cap = self.slo.prefill_cap(self.running)
        budget = self._schedule_running(out, budget)
        # NOTE: after a preemption the pool is tight; admitting new work now would only
        # cause more preemptions next step.
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        if not out.chunks and self.waiting and self.running:
            # Every running request is idle (beams waiting for a sibling) and the queue's head
            # does not fit: free the newest idle one's blocks for it, or nothing would move.
            # It waits behind the head, so the head (maybe that sibling) goes first.
            victim = self.running[-1]
            self._preempt(victim, out)
            self.waiting.remove(victim)
            self.waiting.insert(min(1, len(self.waiting)), victim)
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(len(c.token_ids) for c in out.chunks)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        return out

    def _chunk_len(self, req: SchedRequest, budget: int, computed: int | None = None) -> int:
        done = req.num_computed_tokens if computed is None else computed
        n = min(req.num_tokens - done, budget)
        t = self.config.long_prefill_token_threshold
        if t is not None:
            n = min(n, t)
        if self._prefill_left is not None and req.num_tokens - done > 1:
            n = min(n, self._prefill_left)  # slo rule 1: the TPOT target caps prompt chunks
        return n

    def _took(self, req: SchedRequest, num_new: int, computed: int) -> None:
        """Charge a prompt chunk to this step's slo cap."""
        if self._prefill_left is not None and req.num_tokens - computed > 1:
            self._prefill_left -= num_new

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk_len(req, budget)
            if num_new <= 0:
                i += 1
                continue
            drafts = self._take_drafts(req, budget) if num_new == 1 else []
            start, num_new = req.num_computed_tokens, num_new + len(drafts)
            while (copies := self.kv.allocate_slots(req.request_id, start, start + num_new)) is None:
                victim = self.running[-1]  # newest; always at index >= i
                self._preempt(victim, out)
                if victim is req:
                    return budget  # nothing older is left to take blocks from
            self._add_copies(out, copies)
            out.chunks.append(self._make_chunk(req, num_new - len(drafts), drafts))
            self._took(req, num_new, start)
            budget -= num_new
            i += 1
        return budget

    def _add_copies(self, out: SchedulerOutput, copies: list[list[tuple[int, int]]]) -> None:
        """Copy-on-write copies of one request: group 0's in ``block_copies``, and every
        group's in ``group_block_copies`` for a hybrid model."""
        out.block_copies.extend(copies[0])
        if len(copies) > 1:
            if not out.group_block_copies:
                out.group_block_copies = [[] for _ in copies]
            for acc, c in zip(out.group_block_copies, copies, strict=True):
                acc.extend(c)

    def _take_drafts(self, req: SchedRequest, budget: int) -> list[int]:
        """The request's draft tokens that fit this step: in the token budget, before
        max_model_len, and no more than the outputs it may still emit minus one."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not drafts or req.num_tokens - req.num_computed_tokens != 1:
            return []
        room = min(budget - 1, self.config.max_model_len - req.num_tokens,
                   req.max_tokens - len(req.output_token_ids) - 1)
        return drafts[: max(0, room)]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        seats = sum(r.seats for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if seats + req.seats > self.config.max_num_seqs:
                break
            hits = self._lookup_prefix(req)
            num_cached = len(hits[0]) * self.kv.block_size
            num_new = self._chunk_len(req, budget, computed=num_cached)
            if num_new <= 0 or not self.kv.allocate(req.request_id, num_cached + num_new,
                                                     computed_groups=hits):
                break  # FIFO: never let a later request jump ahead of this one
            self.kv.record_prefix_lookup(req.num_tokens, num_cached)
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            seats += req.seats
            bisect.insort(self.running, req, key=self._order_key)
            out.chunks.append(self._make_chunk(req, num_new))
            self._took(req, num_new, num_cached)
            budget -= num_new

    def _lookup_prefix(self, req: SchedRequest) -> list[list[int]]:
        """Per layer group, the cached blocks a waiting request (no blocks, nothing computed)
        can start from (fitserve.kv.manager.KVCacheManager.find_prefix_hit)."""
        if self.kv.enable_caching:
            self._extend_hashes(req, req.num_tokens)
        if req.skip_prefix_hits:  # no hashes to match: every group's hit is empty
            return self.kv.find_prefix_hit([], req.num_tokens)
        return self.kv.find_prefix_hit(req.block_hashes, req.num_tokens)

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
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.total_preemptions += 1
        self._enqueue(req, front=True)
        out.preempted_ids.append(req.request_id)

    def _make_chunk(self, req: SchedRequest, num_new: int, drafts: list[int] | None = None) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + num_new
        sample = end == req.num_tokens
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:end] + (drafts or []),
            start_pos=start,
            block_table=self.kv.block_table(req.request_id),
            sample=sample,
            fanout=[c.request_id for c in req.fork_children] if sample else [],
            num_draft=len(drafts or ()),
            group_tables=self.kv.block_tables(req.request_id) if self.kv.num_groups > 1 else [],
        )

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               emitted: dict[str, list[int]] | None = None) -> None:
        """Advance each scheduled request by its chunk and append its sampled token.

        A chunk with draft tokens advances by its last token plus the drafts accepted and
        appends every token ``emitted[id]`` holds (accepted drafts, then one more); the
        rejected drafts' slots lie past the new length (rollback) and blocks holding only them
        are freed. Chunks of requests finished or aborted since ``schedule()`` are ignored.
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
            if chunk.num_draft:
                tokens = (emitted or {}).get(chunk.request_id)
                if tokens is None or not 1 <= len(tokens) <= chunk.num_draft + 1:
                    raise RuntimeError(f"{chunk.request_id!r} verified {chunk.num_draft} drafts "
                                       f"but emitted {tokens}")
                req.num_computed_tokens += len(tokens)  # its last token + the accepted drafts
                req.output_token_ids.extend(tokens)
                self.kv.trim(req.request_id, req.num_computed_tokens)
            else:
                req.num_computed_tokens += len(chunk.token_ids)
                if chunk.sample and chunk.request_id in sampled:
                    req.output_token_ids.append(sampled[chunk.request_id])
            if self.kv.enable_caching:
                # the K/V of this chunk is written now: offer the blocks it filled to the cache
                self._extend_hashes(req, req.num_computed_tokens)
                self.kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
            if chunk.sample and req.fork_children:
                self._fork_children(req, sampled)

    def _fork_children(self, req: SchedRequest, sampled: dict[str, int]) -> None:
        """Fork an n>1 request's waiting children off its table, each with the first token it
        sampled from the prompt's logits (see the module docstring)."""
        missing = [c.request_id for c in req.fork_children if c.request_id not in sampled]
        if missing:
            raise RuntimeError(f"children {missing} of {req.request_id!r} were not sampled with it")
        children, req.fork_children = req.fork_children, []
        for c in children:
            del self._requests[c.request_id]  # fork() adds it back as a request of its own
            c.output_token_ids.append(sampled[c.request_id])
            self.fork(req.request_id, c)
