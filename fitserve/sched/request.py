"""The scheduler's view of one request: its tokens and how many are in the KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from fitserve.kv.prefix_hash import BlockHash, ExtraKeys
from fitserve.types import RequestStatus


@dataclass(slots=True)
class SchedRequest:
    """A request's tokens and progress. No phases: the work left is
    ``num_tokens - num_computed_tokens``, whether that is a prompt, a resumed request's
    recompute, or one decode token.

    ``arrival`` orders requests (oldest first); :meth:`Scheduler.add_request` overwrites it
    with its own monotone sequence number.

    ``block_hashes`` is the prefix-cache hash chain of the request's full blocks so far
    (prompt and outputs alike), extended by the scheduler as blocks fill; ``cache_extra_keys``
    go into every one of those hashes (an adapter name, a cache salt: see
    :mod:`fitserve.kv.prefix_hash`).

    Sharing: ``seats`` is how many of ``max_num_seqs`` the request holds, counting the siblings
    it will fork (n samples, beams). ``fork_children`` are the other n - 1 samples of an n>1
    request: they sample their first token from this request's last prompt logits, then fork
    its block table, so the prompt is computed once. A child waiting for its fork has
    ``awaiting_fork_of`` set.

    Speculative decoding: ``spec_token_ids`` are draft tokens proposed for the request's next
    step; the scheduler puts them after its last token in one chunk (budget and KV slots for
    all of them) and drops them after that step, verified or not.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    cache_extra_keys: ExtraKeys = ()
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hits at its latest admission (not recomputed)
    seats: int = 1
    spec_token_ids: list[int] = field(default_factory=list)  # drafts for the next step
    fork_children: list[SchedRequest] = field(default_factory=list)
    # the parent whose prompt blocks this child forks once they are computed (None: forked)
    awaiting_fork_of: str | None = None
    priority: int = 0
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    arrival_time: float = 0.0
    late: bool = False
    predicted_ttft_s: float | None = None
    # computes its whole prompt even where the prefix cache holds it (prompt logprobs need
    # every prompt position's logits); the blocks it fills are still cached for others
    skip_prefix_hits: bool = False

    @property
    def is_idle(self) -> bool:
        """Every token is computed and no new one was appended (a beam waiting for its
        siblings to sample): nothing to schedule."""
        return self.num_computed_tokens >= self.num_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the outputs so far (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """len(prompt) + len(outputs)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)
