"""The engine's side of beam search: beams as scheduler requests, advanced group by group.

Each live beam is a request in the scheduler (so beams run in the same steps as every other
request, one token each, over block tables they share); its forward reports the top
``2 x beam_width`` logprobs instead of a sampled token. Once every live beam of a group has
reported, :class:`~fitserve.sampling.beam_search.BeamGroup` picks the next beams and this module
applies the choice to the scheduler: prune (finish: the blocks' refs drop), fork (the table is
shared, copy-on-write) and append.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fitserve.loading.tokenizer import Tokenizer
from fitserve.sampling import RequestSamplingState, SamplingParams
from fitserve.sampling.beam_search import BeamGroup, BeamSearchParams, BeamStep
from fitserve.sched.request import SchedRequest
from fitserve.sched.scheduler import Scheduler
from fitserve.types import FinishReason, RequestOutput, RequestStatus, TokenLogprobs


@dataclass(slots=True)
class _GroupInfo:
    group: BeamGroup
    prompt_token_ids: list[int]
    arrival_time: float
    first_token_time: float | None = None
    num_cached_tokens: int = 0


class BeamSearches:
    """Every beam search in flight on one engine, keyed by group (request) id."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, device: str) -> None:
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._device = device
        self._groups: dict[str, _GroupInfo] = {}
        self._group_of: dict[str, str] = {}  # live beam (request) id -> group id
        self._states: dict[str, RequestSamplingState] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    def is_beam(self, request_id: str) -> bool:
        return request_id in self._group_of

    def group_of(self, beam_id: str) -> str | None:
        """The beam search a live beam belongs to (None: not a beam)."""
        return self._group_of.get(beam_id)

    def state(self, beam_id: str) -> RequestSamplingState:
        return self._states[beam_id]

    def add(self, group_id: str, prompt_ids: list[int], params: BeamSearchParams, max_tokens: int,
            eos_token_ids: frozenset[int]) -> None:
        """Queue a beam search: one root beam holding ``beam_width`` seats; ValueError if the
        scheduler refuses it (nothing is then kept)."""
        if group_id in self._groups:
            raise ValueError(f"request id {group_id!r} is already in use")
        group = BeamGroup(group_id, params, max_tokens, eos_token_ids)
        root = SchedRequest(request_id=group.new_beam_id(), prompt_token_ids=prompt_ids,
                            max_tokens=max_tokens, seats=params.beam_width)
        self._scheduler.add_request(root)  # validates (seats, pool) before anything is kept
        group.add_beam(root.request_id, root.output_token_ids)
        self._groups[group_id] = _GroupInfo(group, prompt_ids, time.monotonic())
        self._track(group_id, root)

    def _track(self, group_id: str, beam: SchedRequest) -> None:
        info = self._groups[group_id]
        # greedy "sampling" gives the logprobs; the token it picks is not used
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=info.group.max_tokens)
        state = RequestSamplingState.create(params, beam.prompt_token_ids, beam.output_token_ids,
                                            device=self._device)
        state.num_logprobs = info.group.num_candidates
        self._states[beam.request_id] = state
        self._group_of[beam.request_id] = group_id

    def is_queued(self, group_id: str) -> bool:
        """True while the search waits for its first step (its root beam never scheduled)."""
        info = self._groups.get(group_id)
        if info is None or info.group.num_generated:
            return False
        root = self._scheduler.get(next(iter(info.group.live)))
        return root is not None and root.status == RequestStatus.WAITING

    def on_sampled(self, beam_id: str, logprobs: TokenLogprobs, now: float) -> RequestOutput | None:
        """Record a beam's candidates; when its group is complete, advance it. Returns the
        group's final output when the search ends."""
        gid = self._group_of[beam_id]
        info = self._groups[gid]
        group = info.group
        if group.num_generated == 0:
            req = self._scheduler.get(beam_id)
            info.num_cached_tokens = req.num_cached_tokens if req is not None else 0
        group.record(beam_id, logprobs.top)
        if not group.ready:
            return None
        if info.first_token_time is None:
            info.first_token_time = now
        step = group.advance()
        self._apply(gid, step)
        return self._finish(gid, now) if step.done else None

    def _apply(self, gid: str, step: BeamStep) -> None:
        sched, group = self._scheduler, self._groups[gid].group
        for b in step.pruned:  # first, so a lone survivor of a shared block writes in place
            self._drop(b)
        if not step.done:
            for parent_id, child_id, _ in step.forks:
                parent = sched.get(parent_id)
                assert parent is not None
                child = SchedRequest(request_id=child_id, prompt_token_ids=parent.prompt_token_ids,
                                     max_tokens=parent.max_tokens,
                                     output_token_ids=group.live[child_id].token_ids)
                sched.fork(parent_id, child)
                self._track(gid, child)
        for b, tok in step.extended:
            sched.append_token(b, tok)

    def _drop(self, beam_id: str) -> None:
        self._scheduler.finish(beam_id)
        self._states.pop(beam_id, None)
        self._group_of.pop(beam_id, None)

    def _finish(self, gid: str, now: float) -> RequestOutput:
        info = self._groups.pop(gid)
        for b in [b for b, g in self._group_of.items() if g == gid]:
            self._drop(b)
        beams = info.group.results()
        for h in beams:
            h.text = self._tokenizer.decode(h.token_ids, skip_special_tokens=True)
        best = beams[0]
        return RequestOutput(
            request_id=gid, prompt_token_ids=info.prompt_token_ids, delta_token_ids=list(best.token_ids),
            delta_text=best.text, delta_logprobs=None, finished=True,
            num_output_tokens=len(best.token_ids), num_cached_tokens=info.num_cached_tokens,
            token_ids=list(best.token_ids), text=best.text, finish_reason=best.finish_reason,
            stop_reason=best.stop_reason, beams=beams, arrival_time=info.arrival_time,
            first_token_time=info.first_token_time, finish_time=now,
        )

    def abort(self, group_id: str) -> bool:
        """Stop a beam search now, returning every block its beams held."""
        if group_id not in self._groups:
            return False
        del self._groups[group_id]
        for b in [b for b, g in self._group_of.items() if g == group_id]:
            self._drop(b)
        return True

    def fail(self, beam_id: str, exc: BaseException, now: float) -> RequestOutput:
        """A beam failed inside a step: the whole search ends with the error."""
        gid = self._group_of[beam_id]
        info = self._groups[gid]
        self.abort(gid)
        return RequestOutput(
            request_id=gid, prompt_token_ids=info.prompt_token_ids, delta_token_ids=[], delta_text="",
            delta_logprobs=None, finished=True, token_ids=[], text="", finish_reason=FinishReason.ERROR,
            error=exc, arrival_time=info.arrival_time, first_token_time=info.first_token_time,
            finish_time=now,
        )
