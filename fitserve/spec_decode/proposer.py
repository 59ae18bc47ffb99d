"""The proposer protocol of speculative decoding: this step's requests in, drafts out.

Torch-free at run time (tensors appear in annotations only), so the n-gram proposer stays
torch-free. Data flows one way::

    SpeculativeDecoding.propose   DraftRequest per decoding request  (tokens so far, k, and for a
                                  head-style drafter the target's hidden state from RunnerOutput)
        -> Proposer.propose       Drafts: per request the token ids and, for a probabilistic
                                  drafter's random requests, the q rows it sampled them from
        -> scheduler              SchedRequest.spec_token_ids -> ScheduledChunk.num_draft
        -> runner                 SchedulerOutput.spec_decode.draft_probs -> rejection sampling
        -> Proposer.after_step    the step that ran (a draft model mirrors it into its cache)

``probs`` None is a point mass on each draft (n-gram drafts, greedy requests): exactly what
:func:`fitserve.spec_decode.rejection.verify` does with ``draft_probs=None``.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from fitserve.sampling.sampler import RequestSamplingState
    from fitserve.types import SchedulerOutput


@dataclass(slots=True, frozen=True)
class DraftRequest:
    """One request to draft for: its tokens so far (every one computed but the last) and up to
    ``num_drafts`` drafts to propose after its last token."""

    request_id: str
    prompt_token_ids: list[int]  # the scheduler's own lists, shared, not copied: read only
    output_token_ids: list[int]
    num_computed_tokens: int  # tokens in the KV cache: all but the last
    num_drafts: int  # k for this request (>= 1)
    sampling: RequestSamplingState
    # head-style drafters (EAGLE): the target's final hidden state whose logits gave the last
    # token (RunnerOutput.hidden_states of the step before); None when the step had none
    hidden_state: torch.Tensor | None = None

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the outputs so far (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]


@dataclass(slots=True)
class Draft:
    """One request's draft tokens and, for a probabilistic drafter's random request, the
    ``[len(token_ids), V]`` rows of its own distribution q each was sampled from (processed
    by ``Sampler.probabilities`` with the request's params); None: point masses."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


Drafts = dict[str, Draft]
"""A proposer's drafts by request id; a request without any is absent."""


class Proposer(Protocol):
    """Who proposes draft tokens: n-gram lookup, a draft model, an EAGLE-like head."""

    @property
    def needs_hidden_states(self) -> bool:
        """Whether :meth:`propose` reads ``DraftRequest.hidden_state`` (the runner then returns
        them in ``RunnerOutput.hidden_states``)."""
        ...

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        """Up to ``num_drafts`` draft tokens for each request (fewer or none where it has none)."""
        ...

    def after_step(self, plan: SchedulerOutput, failed: Set[str]) -> None:
        """The target ran ``plan`` (its chunks of ``failed`` raised): catch up any state of the
        proposer's own (a draft model's KV cache)."""
        ...
