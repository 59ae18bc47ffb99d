"""vLLM's token-level sampling extras: ``allowed_token_ids``, ``bad_words`` and ``min_tokens``.

Each sets logits to -inf before penalties, temperature and the top-k/p/min-p filters (as vLLM
v1's logits processors do), so greedy and random rows alike choose among what is left:

- ``allowed_token_ids``: every other token of the vocabulary is banned;
- ``bad_words``: each word's token sequence (tokenized with and without a leading space, as
  vLLM's ``update_from_tokenizer``) bans its last token whenever the output so far ends with
  the rest of the sequence (a one-token word is always banned);
- ``min_tokens``: EOS and ``stop_token_ids`` are banned while the output is shorter.

The token ids are resolved once per request (:func:`build_token_masks`, at ``add_request``),
where an id outside the vocabulary is a ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fitserve.sampling.params import SamplingParams

_NEG_INF = float("-inf")


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(slots=True, frozen=True)
class TokenMasks:
    """One request's resolved extras (``None`` / empty: that extra is off)."""

    allowed: torch.Tensor | None = None  # long ids that may be sampled
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    stop_ids: torch.Tensor | None = None  # banned while fewer than min_tokens were output


def bad_words_token_ids(words: Sequence[str], tokenizer: _Encoder) -> list[list[int]]:
    """Each word's token ids, without and (when that makes a different first token of the same
    length, i.e. a word-initial variant) with a leading space: vLLM's rule."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if bare:
            out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out


def build_token_masks(
    params: SamplingParams, tokenizer: _Encoder, vocab_size: int, eos_token_ids: Sequence[int],
) -> TokenMasks | None:
    """The request's masks, or None when it asks for none; ValueError for an id >= vocab_size."""
    allowed = params.allowed_token_ids
    if not (allowed or params.bad_words or params.min_tokens):
        return None
    if allowed and max(allowed) >= vocab_size:
        raise ValueError(f"allowed_token_ids must be in [0, {vocab_size}), got {max(allowed)}")
    words = bad_words_token_ids(params.bad_words or [], tokenizer)
    stop: list[int] = []
    if params.min_tokens:
        stop = list(dict.fromkeys([*([] if params.ignore_eos else eos_token_ids), *params.stop_token_ids]))
        stop = [t for t in stop if t < vocab_size]
    return TokenMasks(
        allowed=torch.tensor(sorted(set(allowed)), dtype=torch.long) if allowed else None,
        bad_words=tuple(tuple(w) for w in words if max(w) < vocab_size),
        min_tokens=params.min_tokens,
        stop_ids=torch.tensor(stop, dtype=torch.long) if stop else None,
    )


def apply_token_masks(
    x: torch.Tensor, rows: Sequence[int], masks: Sequence[TokenMasks], outputs: Sequence[Sequence[int]],
) -> None:
    """Ban, in place on ``x`` ([B, V]), what each row's masks forbid given its output so far."""
    for row, m, out in zip(rows, masks, outputs, strict=True):
        line = x[row]
        if m.allowed is not None:
            ids = m.allowed.to(x.device)
            kept = line.index_select(0, ids)
            line.fill_(_NEG_INF).index_copy_(0, ids, kept)
        for word in m.bad_words:
            prefix = len(word) - 1
            if prefix > len(out):
                continue
            if prefix == 0 or list(out[len(out) - prefix:]) == list(word[:prefix]):
                line[word[-1]] = _NEG_INF
        if m.stop_ids is not None and len(out) < m.min_tokens:
            line.index_fill_(0, m.stop_ids.to(x.device), _NEG_INF)
