"""The Proposer protocol and SpeculativeDecoding's one-way data flow, with a recording proposer:
drafts out of ``propose``, their q rows into the step's ``SchedulerOutput.spec_decode`` (cut to
what the scheduler took), the runner's hidden states back in at the next proposal."""

from __future__ import annotations

from collections.abc import Sequence, Set

import torch

from fitserve.config import SpeculativeConfig
from fitserve.engine.outputs import Tracked
from fitserve.sampling import RequestSamplingState, SamplingParams
from fitserve.sched.scheduler import Scheduler
from fitserve.spec_decode.ngram import NgramProposer
from fitserve.spec_decode.proposer import Draft, DraftRequest, Drafts
from fitserve.spec_decode.speculative import SpeculativeDecoding
from fitserve.types import RunnerOutput, SchedulerOutput

from ..sched.test_scheduler import make, req

VOCAB = 8


class Recording:
    """A probabilistic head-style proposer: k drafts of token 1, q rows of 1 / VOCAB."""

    needs_hidden_states = True

    def __init__(self) -> None:
        self.seen: list[list[DraftRequest]] = []

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        self.seen.append(list(requests))
        return {r.request_id: Draft([1] * r.num_drafts, torch.full((r.num_drafts, VOCAB), 1 / VOCAB))
                for r in requests}

    def after_step(self, plan: SchedulerOutput, failed: Set[str]) -> None:
        pass


def tracked(s: Scheduler, rid: str) -> Tracked:
    r = s.get(rid)
    assert r is not None
    sampling = RequestSamplingState(SamplingParams(temperature=1.0), r.prompt_token_ids, r.output_token_ids)
    return Tracked(sched=r, params=sampling.params, sampling=sampling, detok=None,  # type: ignore[arg-type]
                   max_tokens=r.max_tokens, arrival_time=0.0, speculates=True)


def decoding(rids: list[str], budget: int = 64) -> tuple[Scheduler, dict[str, Tracked]]:
    """A scheduler whose requests have run their 2-token prompts and sampled token 3 each."""
    s = make(budget=budget, num_blocks=64)
    for i, rid in enumerate(rids):
        s.add_request(req(rid, 2, base=10 * i))
    plan = s.schedule()
    s.update(plan, {c.request_id: 3 for c in plan.chunks})
    return s, {rid: tracked(s, rid) for rid in rids}


def test_ngram_proposer_drafts_point_masses_and_skips_misses() -> None:
    state = RequestSamplingState(SamplingParams(), [], [])
    hit = DraftRequest("a", [5, 6, 7, 5], [6], num_computed_tokens=4, num_drafts=2, sampling=state)
    miss = DraftRequest("b", [1, 2, 3], [4], num_computed_tokens=3, num_drafts=2, sampling=state)
    drafts = NgramProposer(1, 4).propose([hit, miss])
    assert set(drafts) == {"a"}
    assert drafts["a"].token_ids == [7, 5] and drafts["a"].probs is None


def test_drafts_reach_the_scheduler_and_their_probs_the_step_cut_to_what_it_took() -> None:
    s, requests = decoding(["a", "b"], budget=6)  # "a" takes 1 + 3 tokens, "b" 1 + 1 of its 3 drafts
    proposer = Recording()
    sd = SpeculativeDecoding(SpeculativeConfig("eagle", 3, model="head"), proposer, max_model_len=128)
    drafts = sd.propose(s, requests)
    assert [(r.request_id, r.num_drafts, r.last_token_id) for r in proposer.seen[0]] == [("a", 3, 3), ("b", 3, 3)]
    assert all(r.hidden_state is None for r in proposer.seen[0])  # no step has returned one yet
    plan = s.schedule()
    inputs = sd.step_inputs(plan, drafts)
    assert {c.request_id: c.num_draft for c in plan.chunks} == {"a": 3, "b": 1}
    assert {rid: q.shape[0] for rid, q in inputs.draft_probs.items()} == {"a": 3, "b": 1}
    assert inputs.return_hidden_states


def test_hidden_states_come_from_the_latest_runner_output_only() -> None:
    s, requests = decoding(["a", "b"])
    proposer = Recording()
    sd = SpeculativeDecoding(SpeculativeConfig("eagle", 2, model="head"), proposer, max_model_len=128)
    h = torch.arange(4.0)
    plan = SchedulerOutput(chunks=[], num_batched_tokens=0)
    sd.after_step(plan, RunnerOutput(sampled={"a": 3}, hidden_states={"a": h}), set())
    sd.propose(s, requests)
    got = {r.request_id: r.hidden_state for r in proposer.seen[-1]}
    assert got["a"] is h and got["b"] is None
    sd.after_step(plan, RunnerOutput(sampled={}), set())  # a step that returned none
    sd.propose(s, requests)
    assert all(r.hidden_state is None for r in proposer.seen[-1])


def test_disabled_by_batch_size_proposes_nothing_and_clears_earlier_drafts() -> None:
    s, requests = decoding(["a", "b"])
    proposer = Recording()
    sd = SpeculativeDecoding(SpeculativeConfig("eagle", 2, model="head", disable_by_batch_size=2), proposer,
                             max_model_len=128)
    for r in s.running:
        r.spec_token_ids = [4, 4]  # drafts of an earlier proposal that no step took
    assert sd.propose(s, requests) == {}
    assert proposer.seen == [] and all(r.spec_token_ids == [] for r in s.running)
