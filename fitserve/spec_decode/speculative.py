"""The engine's side of speculative decoding: one :class:`~fitserve.spec_decode.proposer.Proposer`
that drafts before each schedule, and the counters of what verification accepted.

One :class:`SpeculativeDecoding` per engine with ``speculative_config`` set. Each step:

1. :meth:`~SpeculativeDecoding.propose` gives every decoding request that may speculate
   (``Tracked.speculates``: no penalties, no logprobs; not a beam) up to k draft tokens in
   ``SchedRequest.spec_token_ids``, from the proposer :func:`build_proposer` chose (n-gram
   lookup, a draft model or an EAGLE-like head), and returns the drafts;
2. the scheduler puts them in the step (:mod:`fitserve.sched.scheduler`), and
   :meth:`~SpeculativeDecoding.step_inputs` turns the drafts the step took into the runner's
   ``SchedulerOutput.spec_decode`` (the draft probabilities, and whether hidden states are needed);
3. the runner accepts or rejects them (:mod:`fitserve.spec_decode.rejection`);
4. :meth:`~SpeculativeDecoding.after_step` hands the step to the proposer and keeps the
   ``RunnerOutput.hidden_states`` for the next proposal; :meth:`~SpeculativeDecoding.observe`
   counts each verified chunk.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Protocol

import torch

from fitserve.config import ModelSpec, SpeculativeConfig
from fitserve.kv.manager import KVCacheManager
from fitserve.model.eagle_head import load_eagle_head
from fitserve.runner.model_runner import ModelRunner
from fitserve.sampling import RequestSamplingState
from fitserve.sched.request import SchedRequest
from fitserve.sched.scheduler import Scheduler
from fitserve.spec_decode.draft_model import DraftModelProposer, load_draft_model
from fitserve.spec_decode.eagle import EagleProposer
from fitserve.spec_decode.ngram import NgramProposer
from fitserve.spec_decode.proposer import DraftRequest, Drafts, Proposer
from fitserve.spec_decode.stats import SpecDecodeStats
from fitserve.types import RunnerOutput, SchedulerOutput, SpecDecodeInputs


def build_proposer(config: SpeculativeConfig, *, target: ModelSpec, runner: ModelRunner, kv: KVCacheManager,
                   dtype: torch.dtype, device: torch.device, max_model_len: int) -> Proposer:
    """The proposer of ``config.method`` for the target model that ``runner`` runs (the one place
    that tells the methods apart)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    assert config.model is not None  # SpeculativeConfig checks it
    if config.method == "draft_model":
        model, spec = load_draft_model(config.model, target, dtype=dtype, device=device,
                                       max_model_len=max_model_len)
        return DraftModelProposer(model, spec, target=runner, kv=kv, kv_dtype=dtype, device=device)
    if config.method == "eagle":
        head = load_eagle_head(config.model, target.hidden_size, dtype=dtype, device=device)
        return EagleProposer(head, model=runner.model, sampler=runner.sampler)
    raise ValueError(f"unknown speculative method {config.method!r}")


class Tracked(Protocol):
    """What speculative decoding reads and counts of the engine's state for one request
    (fitserve.engine.outputs.Tracked is one; a protocol keeps this layer below the engine)."""

    speculates: bool  # gets drafts (speculation on, and no penalties, logprobs or grammar)
    sampling: RequestSamplingState
    num_draft_tokens: int
    num_accepted_tokens: int


class SpeculativeDecoding:
    """The proposer and the counters for one engine."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, *, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.max_model_len = max_model_len
        # the latest step's RunnerOutput.hidden_states (head-style proposers only): they serve
        # the next proposal and are replaced after every step
        self._hidden: dict[str, torch.Tensor] = {}

    def propose(self, scheduler: Scheduler, requests: dict[str, Tracked]) -> Drafts:
        """Draft tokens for every decoding request that may speculate, in its ``spec_token_ids``
        for the next schedule (every other running request's are cleared); returns the drafts."""
        spec = self.config
        want: list[DraftRequest] = []
        if spec.disable_by_batch_size is None or scheduler.num_running < spec.disable_by_batch_size:
            for req in scheduler.running:
                r = self._draft_request(req, requests.get(req.request_id))
                if r is not None:
                    want.append(r)
        drafts = self.proposer.propose(want) if want else {}
        # NOTE: every running request's drafts are this proposal's, so drafts a step did not
        # schedule never reach a later step without the probabilities they were drawn from
        for req in scheduler.running:
            d = drafts.get(req.request_id)
            req.spec_token_ids = d.token_ids if d is not None else []
        return drafts

    def _draft_request(self, req: SchedRequest, t: Tracked | None) -> DraftRequest | None:
        """What the proposer gets for one running request, or None where it may not speculate now."""
        if t is None or not t.speculates or req.num_tokens - req.num_computed_tokens != 1:
            return None
        # no draft past max_model_len or past the outputs the request may still emit
        k = min(self.config.num_speculative_tokens, self.max_model_len - req.num_tokens,
                req.max_tokens - len(req.output_token_ids) - 1)
        if k < 1:
            return None
        return DraftRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                            output_token_ids=req.output_token_ids, num_computed_tokens=req.num_computed_tokens,
                            num_drafts=k, sampling=t.sampling, hidden_state=self._hidden.get(req.request_id))

    def step_inputs(self, plan: SchedulerOutput, drafts: Drafts) -> SpecDecodeInputs:
        """The runner's inputs for ``plan``: the q rows of the drafts each chunk took (the
        scheduler may have cut them short), and whether to return hidden states."""
        probs: dict[str, torch.Tensor] = {}
        for c in plan.chunks:
            d = drafts.get(c.request_id) if c.num_draft else None
            if d is not None and d.probs is not None:
                probs[c.request_id] = d.probs[: c.num_draft]
        return SpecDecodeInputs(draft_probs=probs, return_hidden_states=self.proposer.needs_hidden_states)

    def after_step(self, plan: SchedulerOutput, result: RunnerOutput, failed: Set[str]) -> None:
        """The step ran: the proposer catches up (a draft model's cache), and the hidden states
        it returned wait for the next proposal."""
        self.proposer.after_step(plan, failed)
        self._hidden = result.hidden_states

    def observe(self, num_draft: int, emitted: list[int], tracked: Tracked) -> None:
        """Count one verified chunk: its ``num_draft`` drafts, and the ``len(emitted) - 1`` accepted."""
        accepted = len(emitted) - 1
        self.stats.observe(num_draft, accepted)
        tracked.num_draft_tokens += num_draft
        tracked.num_accepted_tokens += accepted
