"""The scheduler's view of one request: its tokens and how many are in the KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from fitserve.types import RequestStatus


@dataclass(slots=True)
class SchedRequest:
    """A request's tokens and progress. No phases: the work left is
    ``num_tokens - num_computed_tokens``, whether that is a prompt, a resumed request's
    recompute, or one decode token.

    ``arrival`` orders requests (oldest first); :meth:`Scheduler.add_request` overwrites it
    with its own monotone sequence number.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the outputs so far (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """len(prompt) + len(outputs)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)
