"""N-gram (prompt lookup) proposer: draft tokens copied from earlier in the sequence. Torch-free.

For n from ``n_max`` down to ``n_min``: take the sequence's last n tokens, find their latest
earlier occurrence, and propose the (up to) k tokens that followed it::

    tokens  ... a b c d e ... x a b c        last 3 = [a b c], seen before at i
    draft   d e ...                          the tokens after that occurrence, up to k

Repetitive text (code edits, summaries quoting their source, templated output) hits often; a
miss proposes nothing and the request decodes one token as usual.
"""

from __future__ import annotations

from collections.abc import Sequence


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
