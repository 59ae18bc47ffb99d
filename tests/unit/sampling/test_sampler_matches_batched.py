"""The chunked sampler draws exactly what the batched formula drew (reference_sampler.py, the
sampler as it was before it worked one row chunk at a time), on fixed seeds, for each mode."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fitserve.ledger import sampler_memory as scratch
from fitserve.sampling import RequestSamplingState, Sampler, SamplingParams
from tests.unit.sampling import reference_sampler as ref

VOCAB = 3000
MODES: dict[str, list[dict[str, Any]]] = {
    "greedy+logprobs": [dict(temperature=0.0, logprobs=3)],
    "temperature": [dict(temperature=0.7)],
    "top_k": [dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_k=40)],
    "top_k wide": [dict(temperature=2.0, top_k=VOCAB - 7), dict(temperature=1.0, top_k=600)],
    "top_p": [dict(temperature=0.8, top_p=0.9)],
    "top_p wide": [dict(temperature=6.0, top_p=0.999), dict(temperature=0.8, top_p=0.5)],
    "min_p": [dict(temperature=1.1, min_p=0.05)],
    "top_k+top_p": [dict(temperature=1.5, top_k=300, top_p=0.95), dict(temperature=1.0, top_p=0.7)],
    "all filters": [dict(temperature=3.0, top_k=2000, top_p=0.99, min_p=1e-4, logprobs=5)],
    "penalties": [dict(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4,
                       presence_penalty=0.2, top_p=0.95),
                  dict(temperature=0.0, repetition_penalty=1.2)],
    "logit bias": [dict(temperature=1.0, logit_bias={7: 5.0, 11: -100.0}, logprobs=2),
                   dict(temperature=0.0, logit_bias={3: 30.0})],
    "logprobs": [dict(temperature=1.2, top_k=50, logprobs=0), dict(temperature=0.5, logprobs=7)],
    "mixed": [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, logprobs=1),
              dict(temperature=1.0, top_k=20), dict(temperature=0.0, logprobs=4)],
}


def states_for(params: list[dict[str, Any]], rows: int, seeded: bool,
               cls: type) -> list[Any]:
    out = []
    for r in range(rows):
        p = dict(params[r % len(params)])
        if seeded and r % 2 == 0:
            p["seed"] = 1000 + r
        out.append(cls.create(SamplingParams(**p), [r % 50, 5, 9, 5], [r % 13, 7, 7]))
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("rows,chunk_rows", [(1, 1), (5, 2), (9, 4), (16, 16)])
def test_tokens_and_logprobs_equal_the_batched_formula(
    mode: str, rows: int, chunk_rows: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scratch, "SAMPLER_CHUNK_ELEMENTS", chunk_rows * VOCAB)
    new = Sampler(generator=torch.Generator().manual_seed(5))
    old = ref.Sampler(generator=torch.Generator().manual_seed(5))
    new_states = states_for(MODES[mode], rows, True, RequestSamplingState)
    old_states = states_for(MODES[mode], rows, True, RequestSamplingState)
    data = torch.Generator().manual_seed(rows)
    for step in range(3):  # the generators' streams stay aligned step after step
        logits = torch.randn(rows, VOCAB, generator=data) * (1 + step)
        logits[:, :10] += 4.0  # a few likely tokens, and ties below
        logits[:, 100:110] = 2.5
        got, got_lp = new(logits, new_states)
        want, want_lp = old(logits, old_states)
        assert got == want, (mode, step)
        assert got_lp == want_lp, (mode, step)


@pytest.mark.parametrize("rows,chunk_rows", [(1, 1), (7, 3), (12, 12)])
def test_probabilities_equal_the_batched_formula(
    rows: int, chunk_rows: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scratch, "SAMPLER_CHUNK_ELEMENTS", chunk_rows * VOCAB)
    plain = [m for name, ms in MODES.items() if name not in ("penalties", "logit bias")
             for m in ms]
    for variant in (plain, [m for m in plain if "top_k" not in m or "top_p" not in m]):
        logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)) * 2
        got = Sampler().probabilities(logits, states_for(variant, rows, False,
                                                         RequestSamplingState))
        want = ref.Sampler().probabilities(logits, states_for(variant, rows, False,
                                                              RequestSamplingState))
        assert torch.equal(got, want)


def test_unseeded_rows_follow_the_global_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    """No sampler generator: torch.manual_seed makes the draws the batched formula's."""
    monkeypatch.setattr(scratch, "SAMPLER_CHUNK_ELEMENTS", 2 * VOCAB)
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    got = Sampler()(logits, states_for(MODES["top_k+top_p"], 7, False, RequestSamplingState))
    torch.manual_seed(3)
    want = ref.Sampler()(logits, states_for(MODES["top_k+top_p"], 7, False,
                                            RequestSamplingState))
    assert got == want
