"""N-gram (prompt lookup) proposer: draft tokens copied from earlier in the sequence. Torch-free.

For n from ``n_max`` down to ``n_min``: take the sequence's last n tokens, find their latest
earlier occurrence, and propose the (up to) k tokens that followed it::

    tokens  ... a b c d e ... x a b c        last 3 = [a b c], seen before at i
    draft   d e ...                          the tokens after that occurrence, up to k

Repetitive text (code edits, summaries quoting their source, templated output) hits often; a
miss proposes nothing and the request decodes one token as usual.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import TYPE_CHECKING

from fitserve.spec_decode.proposer import Draft, DraftRequest, Drafts

if TYPE_CHECKING:
    from fitserve.types import SchedulerOutput


def propose_ngram(tokens: Sequence[int], k: int, n_min: int = 1, n_max: int = 4) -> list[int]:
    """Up to ``k`` draft tokens for ``tokens`` (prompt + outputs so far); [] when nothing matches."""
    size = len(tokens)
    if k < 1 or size < 2:
        return []
    last = tokens[-1]
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = list(tokens[size - n:])
        # latest start i < size - n whose n tokens equal the pattern (its last token first)
        for end in range(size - 2, n - 2, -1):
            if tokens[end] == last and list(tokens[end - n + 1:end + 1]) == pattern:
                return list(tokens[end + 1:end + 1 + k])
    return []


class NgramProposer:
    """Prompt lookup as a :class:`~fitserve.spec_decode.proposer.Proposer`: deterministic drafts
    with no probabilities (point masses for the rejection sampler)."""

    needs_hidden_states = False

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        drafts: Drafts = {}
        for r in requests:
            tokens = propose_ngram(r.token_ids, r.num_drafts, self.n_min, self.n_max)
            if tokens:
                drafts[r.request_id] = Draft(tokens)
        return drafts

    def after_step(self, plan: SchedulerOutput, failed: Set[str]) -> None:
        """Nothing to catch up: the lookup reads the tokens each time."""
