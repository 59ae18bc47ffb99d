"""sampling.token_masks vs the plain rules vLLM states (its ``_apply_bad_words_single_batch``,
the allowed-ids mask and the min_tokens stop-token ban), on random logits and outputs."""

from __future__ import annotations

import random

import pytest
import torch

from fitserve.sampling import SamplingParams
from fitserve.sampling.token_masks import (
    TokenMasks,
    apply_token_masks,
    bad_words_token_ids,
    build_token_masks,
)

V = 40


class WordTokenizer:
    """Each character is one token (its code - 96); a leading space is token 1."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 if c == " " else ord(c) - 96 for c in text]


def reference(logits: list[float], words: list[list[int]], allowed: list[int] | None, out: list[int],
              min_tokens: int, stops: list[int]) -> list[float]:
    x = list(logits)
    if allowed is not None:
        x = [v if i in allowed else float("-inf") for i, v in enumerate(x)]
    for w in words:
        if len(w) > len(out) + 1:
            continue
        prefix = w[:-1]
        if out[len(out) - len(prefix):] == prefix or not prefix:
            x[w[-1]] = float("-inf")
    if len(out) < min_tokens:
        for t in stops:
            x[t] = float("-inf")
    return x


@pytest.mark.parametrize("seed", range(40))
def test_masks_equal_the_plain_rules(seed: int) -> None:
    rng = random.Random(seed)
    words = [[rng.randrange(2, 6) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(1, 4))]
    out = [rng.randrange(2, 6) for _ in range(rng.randrange(0, 6))]
    allowed = sorted(rng.sample(range(V), 8)) if rng.random() < 0.5 else None
    min_tokens = rng.randrange(0, 8)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed)).tolist()  # float32 values
    masks = TokenMasks(allowed=torch.tensor(allowed) if allowed else None,
                       bad_words=tuple(tuple(w) for w in words), min_tokens=min_tokens,
                       stop_ids=torch.tensor([0, 9]))
    x = torch.tensor([logits, logits])
    apply_token_masks(x, [1], [masks], [out])
    assert x[1].tolist() == reference(logits, words, allowed, out, min_tokens, [0, 9])
    assert x[0].tolist() == logits  # rows not named are untouched


def test_bad_words_tokenized_bare_and_spaced() -> None:
    tok = WordTokenizer()
    assert bad_words_token_ids(["ab"], tok) == [[1, 2]]  # " ab" is 3 tokens: not a word-initial variant
    params = SamplingParams(bad_words=["ab"], min_tokens=2, stop_token_ids=[5], allowed_token_ids=[3, 4])
    m = build_token_masks(params, tok, V, eos_token_ids=[0])
    assert m is not None and m.bad_words == ((1, 2),) and m.stop_ids is not None
    assert m.stop_ids.tolist() == [0, 5] and m.allowed is not None and m.allowed.tolist() == [3, 4]
    assert build_token_masks(SamplingParams(), tok, V, eos_token_ids=[0]) is None
    with pytest.raises(ValueError, match="allowed_token_ids"):
        build_token_masks(SamplingParams(allowed_token_ids=[V]), tok, V, eos_token_ids=[0])
    for bad in ({"allowed_token_ids": []}, {"bad_words": [" "]}, {"min_tokens": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)  # type: ignore[arg-type]
