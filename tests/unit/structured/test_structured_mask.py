"""The batched logits step of constrained decoding against plain references.

The bitmask application against a naive per-bit loop in float64, logit bias against a dict
loop, and the sampler with grammar rows: greedy picks the best *allowed* token, sampling draws
only allowed ones, and the unconstrained rows of the same batch are untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fitserve.engine.outputs import can_speculate
from fitserve.sampling import RequestSamplingState, Sampler, SamplingParams
from fitserve.structured.guided import GuidedDecoding
from fitserve.structured.logits import (
    GuidedMasker,
    apply_logit_bias,
    apply_token_bitmask,
    disallowed_mask,
)


def bitmask_of(allowed_sets: list[set[int]], vocab: int) -> torch.Tensor:
    """llguidance's layout, built bit by bit: token t is bit t % 32 of word t // 32."""
    words = np.zeros((len(allowed_sets), (vocab + 31) // 32), dtype=np.uint32)
    for i, allowed in enumerate(allowed_sets):
        for t in allowed:
            words[i, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32).copy())


def naive_masked(x: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """float64 reference: read every bit with Python integers."""
    out = x.double().clone()
    for i, r in enumerate(rows):
        for t in range(x.shape[1]):
            w = t // 32
            bit = (int(bitmask[i, w]) & 0xFFFFFFFF) >> (t % 32) & 1 if w < bitmask.shape[1] else 0
            if not bit:
                out[r, t] = float("-inf")
    return out


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_bitmask_application_matches_the_naive_loop(data: st.DataObject) -> None:
    vocab = data.draw(st.integers(1, 150))
    batch = data.draw(st.integers(1, 5))
    rows = sorted(data.draw(st.sets(st.integers(0, batch - 1), min_size=1)))
    sets = [data.draw(st.sets(st.integers(0, vocab - 1))) for _ in rows]
    # the mask may be narrower than the logits (padded vocabulary) or wider (cut)
    width = data.draw(st.sampled_from([vocab, max(1, vocab - 7), vocab + 40]))
    bitmask = bitmask_of([{t for t in s if t < width} for s in sets], width)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    x = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    want = naive_masked(x, rows, bitmask)
    apply_token_bitmask(x, rows, bitmask)
    assert torch.equal(x.double(), want)  # other rows bit-for-bit unchanged, too
    assert torch.equal(disallowed_mask(bitmask, vocab), torch.isinf(want[rows]))


def test_all_ones_and_all_zeros() -> None:
    x = torch.randn(2, 70)
    ref = x.clone()
    full = torch.full((1, 3), -1, dtype=torch.int32)  # every bit set
    apply_token_bitmask(x, [1], full)
    assert torch.equal(x, ref)
    apply_token_bitmask(x, [0], torch.zeros(1, 3, dtype=torch.int32))
    assert torch.isneginf(x[0]).all() and torch.equal(x[1], ref[1])


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_logit_bias_matches_a_dict_loop(data: st.DataObject) -> None:
    vocab, batch = data.draw(st.integers(1, 60)), data.draw(st.integers(1, 4))
    rows = sorted(data.draw(st.sets(st.integers(0, batch - 1), min_size=1)))
    biases = [data.draw(st.dictionaries(st.integers(0, vocab - 1),
                                        st.floats(-100, 100, allow_nan=False))) for _ in rows]
    x = torch.randn(batch, vocab, dtype=torch.float64)
    want = x.clone()
    for r, b in zip(rows, biases, strict=True):
        for t, v in b.items():
            want[r, t] += v
    apply_logit_bias(x, rows, [(torch.tensor(list(b), dtype=torch.long),
                                torch.tensor(list(b.values()), dtype=torch.float32)) for b in biases])
    assert torch.allclose(x, want, rtol=0, atol=1e-5)


class FakeGuide:
    """A MaskSource that always allows the same tokens."""

    def __init__(self, allowed: set[int], vocab: int) -> None:
        self.allowed, self.vocab_size = allowed, vocab

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = bitmask_of([self.allowed], self.vocab_size)[0]


def state(params: SamplingParams, guide: FakeGuide | None = None) -> RequestSamplingState:
    s = RequestSamplingState.create(params, [1, 2], [])
    s.guide = guide  # type: ignore[assignment]
    return s


VOCAB = 100


def test_greedy_picks_the_best_allowed_token() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    allowed = {3, 17, 58, 99}
    greedy = SamplingParams(temperature=0.0)
    sampler = Sampler()
    tokens, _ = sampler(logits, [state(greedy), state(greedy, FakeGuide(allowed, VOCAB)),
                                 state(greedy, FakeGuide({5}, VOCAB))])
    best = max(allowed, key=lambda t: float(logits[1, t]))
    assert tokens == [int(logits[0].argmax()), best, 5]
    assert sampler.masker.steps == 1 and sampler.masker.rows == 2
    assert sampler.masker.seconds >= sampler.masker.fill_seconds > 0


def test_sampling_draws_only_allowed_and_leaves_other_rows_alone() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    allowed = {2, 40, 41, 77}
    free = [SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=1.0, top_p=0.9, seed=8)]
    solo_states = [state(p) for p in free]
    states = [state(free[0]), state(SamplingParams(temperature=1.5, top_k=50, seed=9),
                                    FakeGuide(allowed, VOCAB)),
              state(free[1]), state(SamplingParams(temperature=1.0), FakeGuide(allowed, VOCAB))]
    solo, mixed = Sampler(), Sampler()
    seen = set()
    for _ in range(30):
        tokens, _ = mixed(logits, states)
        assert tokens[1] in allowed and tokens[3] in allowed
        seen.update((tokens[1], tokens[3]))
        # seeded unconstrained rows draw the same stream as without the constrained rows
        assert [tokens[0], tokens[2]] == solo(logits[[0, 2]], solo_states)[0]
    assert len(seen) > 1  # it really sampled among the allowed


def test_unconstrained_rows_match_a_run_without_the_constrained_ones() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    plain = [SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.0)]
    alone, _ = Sampler()(logits[[0, 2]], [state(p) for p in plain])
    mixed, _ = Sampler()(logits, [state(plain[0]), state(SamplingParams(temperature=0.0),
                                                          FakeGuide({1}, VOCAB)), state(plain[1])])
    assert [mixed[0], mixed[2]] == alone and mixed[1] == 1


def test_logit_bias_comes_before_penalties_and_temperature() -> None:
    # token 0: logit 1.0, bias +1.0, repetition penalty 2 (seen in the prompt)
    #   bias first: (1 + 1) / 2 = 1.0;   penalty first: 1 / 2 + 1 = 1.5
    # token 1: logit 1.2 -> bias first picks token 1, penalty first would pick token 0
    logits = torch.tensor([[1.0, 1.2, -5.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 1.0})
    s = RequestSamplingState.create(params, [0], [])
    assert Sampler()(logits, [s])[0] == [1]
    forced = RequestSamplingState.create(SamplingParams(temperature=0.0, logit_bias={2: 100}), [0], [])
    banned = RequestSamplingState.create(SamplingParams(temperature=0.0, logit_bias={1: -100}), [0], [])
    assert Sampler()(logits.repeat(2, 1), [forced, banned])[0] == [2, 0]


def test_logprobs_stay_the_models() -> None:
    """Bias and mask change what is sampled, not the raw logprobs reported."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    s = state(SamplingParams(temperature=0.0, logprobs=2, logit_bias={9: 50.0}), FakeGuide({9, 10}, VOCAB))
    tokens, lps = Sampler()(logits, [s])
    raw = torch.log_softmax(logits[0], -1)
    assert tokens == [9] and lps[0] is not None
    assert lps[0].logprob == pytest.approx(float(raw[9]), abs=1e-6)


def test_probabilities_refuses_grammars_and_bias() -> None:
    logits = torch.randn(1, VOCAB)
    with pytest.raises(ValueError, match="grammar"):
        Sampler().probabilities(logits, [state(SamplingParams(), FakeGuide({1}, VOCAB))])
    with pytest.raises(ValueError, match="bias"):
        Sampler().probabilities(logits, [state(SamplingParams(logit_bias={1: 1.0}))])


def test_constrained_requests_do_not_speculate() -> None:
    assert can_speculate(SamplingParams())
    assert not can_speculate(SamplingParams(guided=GuidedDecoding("regex", "a+")))
    assert not can_speculate(SamplingParams(logit_bias={1: 2.0}))


def test_masker_skips_empty_steps() -> None:
    m = GuidedMasker()
    m(torch.zeros(2, 4), [], [])
    assert (m.steps, m.rows, m.seconds) == (0, 0, 0.0)
