"""Sampler against a naive float64 / pure-Python reference of each transformation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fitserve.sampling import RequestSamplingState, Sampler, SamplingParams
from fitserve.sampling.sampler import _apply_penalties

# ----------------------------------------------------------------------------- reference


def ref_penalise(
    logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float,
    pres: float,
) -> list[float]:
    """HF/vLLM penalties, one token at a time, in float64."""
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def _normalise(w: list[float]) -> list[float]:
    z = sum(w)
    return [v / z for v in w]


def ref_probs(
    logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    min_p: float = 0.0,
) -> list[float]:
    """The distribution a random row samples from; zero outside the kept set.

    Ties at each boundary are kept (top-k keeps every token equal to the k-th largest; top-p
    keeps every token equal to the last one of the nucleus).
    """
    x = [v / temperature for v in logits]
    keep = [True] * len(x)
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        keep = [v >= kth for v in x]
    if top_p < 1.0:
        m = max(x)
        p = _normalise([math.exp(v - m) if k else 0.0 for v, k in zip(x, keep, strict=True)])
        order = sorted(range(len(x)), key=lambda i: -x[i])
        before, last = 0.0, order[0]
        for i in order:
            if before >= top_p or p[i] == 0.0:
                break
            last, before = i, before + p[i]
        keep = [k and v >= x[last] for v, k in zip(x, keep, strict=True)]
    m = max(x)
    p = _normalise([math.exp(v - m) if k else 0.0 for v, k in zip(x, keep, strict=True)])
    pmax = max(p)
    p = [v if v >= min_p * pmax else 0.0 for v in p]
    return _normalise(p)


def make_states(
    params: SamplingParams, rows: int, prompt: list[int] | None = None,
    output: list[int] | None = None,
) -> list[RequestSamplingState]:
    return [RequestSamplingState.create(params, list(prompt or []), list(output or []))
            for _ in range(rows)]


def empirical(logits: list[float], params: SamplingParams, draws: int, seed: int = 0,
              sampler: Sampler | None = None) -> list[int]:
    """Counts per token over ``draws`` rows of the same logits in one batch."""
    gen = torch.Generator().manual_seed(seed)
    sampler = sampler or Sampler(generator=gen)
    x = torch.tensor([logits] * draws, dtype=torch.float32)
    tokens, _ = sampler(x, make_states(params, draws))
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).tolist()


def assert_same_distribution(counts: list[int], probs: list[float]) -> None:
    n = sum(counts)
    outside = [t for t, (c, p) in enumerate(zip(counts, probs, strict=True)) if p == 0 and c]
    assert not outside, f"sampled tokens outside the reference support: {outside}"
    support = [t for t, p in enumerate(probs) if p > 0]
    chi2 = sum((counts[t] - n * probs[t]) ** 2 / (n * probs[t]) for t in support)
    df = len(support) - 1
    # Mean df, sd sqrt(2 df): 6 sd is far beyond chance; the draws are seeded anyway.
    assert chi2 <= df + 6 * math.sqrt(2 * max(df, 1)), (chi2, df, counts, probs)


LOGITS = [2.0, 1.5, 1.4, 0.3, 0.0, -0.2, -1.0, -1.1, -2.5, -4.0]
TIES = [2.0, 2.0, 1.0, 1.0, 1.0, 0.0, -1.0]

DIST_CASES = [
    (LOGITS, {}),
    (LOGITS, {"temperature": 0.5}),
    (LOGITS, {"temperature": 2.0}),
    (LOGITS, {"top_k": 3}),
    (LOGITS, {"top_k": 1}),
    (LOGITS, {"top_k": 10}),  # k == V: no-op
    (LOGITS, {"top_k": -1}),
    (LOGITS, {"top_p": 0.5}),
    (LOGITS, {"top_p": 0.9}),
    (LOGITS, {"top_p": 0.01}),  # only the argmax
    (LOGITS, {"top_p": 1.0}),
    (LOGITS, {"min_p": 0.1}),
    (LOGITS, {"min_p": 0.5, "temperature": 2.0}),
    (LOGITS, {"temperature": 0.7, "top_k": 6, "top_p": 0.8, "min_p": 0.05}),
    (LOGITS, {"temperature": 1.5, "top_k": 8, "top_p": 0.95}),
    (TIES, {"top_k": 1}),  # both maxima kept
    (TIES, {"top_k": 3}),  # all three 1.0s kept
    (TIES, {"top_p": 0.5}),
    (TIES, {"top_p": 0.8}),  # boundary inside the 1.0 tie: the whole tie is kept
    (TIES, {"top_k": 4, "top_p": 0.9}),
    ([0.0] * 8, {"top_p": 0.3}),  # all tied: nothing can be dropped
]


@pytest.mark.parametrize(("logits", "kwargs"), DIST_CASES)
def test_empirical_distribution_matches_reference(logits: list[float], kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    counts = empirical(logits, params, draws=20_000)
    assert_same_distribution(counts, ref_probs(logits, **kwargs))


def test_chi_square_check_is_not_vacuous() -> None:
    counts = empirical(LOGITS, SamplingParams(temperature=0.9), draws=20_000)
    with pytest.raises(AssertionError):
        assert_same_distribution(counts, ref_probs(LOGITS))


@pytest.mark.parametrize("width", [1, 2, 4])
def test_top_p_fallback_beyond_the_candidate_window(width: int) -> None:
    """A nucleus wider than candidate_width goes through the widen-and-retry path."""
    logits = [0.1 * math.sin(i) for i in range(40)]
    sampler = Sampler(generator=torch.Generator().manual_seed(1), candidate_width=width)
    counts = empirical(logits, SamplingParams(top_p=0.9, top_k=30), 20_000, sampler=sampler)
    assert_same_distribution(counts, ref_probs(logits, top_p=0.9, top_k=30))


def test_seeded_rows_sample_the_reference_distribution() -> None:
    kwargs = {"temperature": 0.8, "top_p": 0.9}
    x = torch.tensor([LOGITS] * 4000)
    states = [RequestSamplingState.create(SamplingParams(seed=s, **kwargs), [], [])
              for s in range(4000)]
    tokens, _ = Sampler()(x, states)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).tolist()
    assert_same_distribution(counts, ref_probs(LOGITS, **kwargs))


@settings(max_examples=100, deadline=None)
@given(
    logits=st.lists(st.integers(-12, 12).map(lambda v: v / 2), min_size=2, max_size=24),
    temperature=st.sampled_from([0.3, 1.0, 1.7]),
    top_k=st.integers(-1, 25),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32),
)
def test_sampled_token_is_always_in_reference_support(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    counts = empirical(logits, params, draws=64, seed=seed)
    # Loosened by float32 rounding only: a larger top_p and smaller min_p keep a superset.
    loose = ref_probs(logits, temperature, top_k, min(1.0, top_p + 1e-5), min_p * (1 - 1e-4))
    assert all(c == 0 for c, p in zip(counts, loose, strict=True) if p == 0)


# ----------------------------------------------------------------------------- greedy, penalties


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    x = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    tokens, lps = Sampler()(x, make_states(SamplingParams(temperature=0.0), 16))
    assert tokens == x.float().argmax(dim=-1).tolist()
    assert lps == [None] * 16


def test_plain_greedy_rows_take_the_same_tokens_as_the_full_path() -> None:
    """A batch of plain greedy rows skips the fp32 copy; one row asking for logprobs sends the
    same batch down the full path: the tokens must not differ (ties included: the first index)."""
    x = torch.randn(8, 3000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[2, 17] = x[2, 2900] = x[2].max() + 1
    plain = make_states(SamplingParams(temperature=0.0), 8)
    mixed = [*plain[:7], *make_states(SamplingParams(temperature=0.0, logprobs=1), 1)]
    fast, _ = Sampler()(x, plain)
    full, lps = Sampler()(x, mixed)
    assert fast == full == x.float().argmax(dim=-1).tolist()
    assert fast[2] == 17 and lps[7] is not None


def test_penalties_match_reference_values() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 50, generator=gen, dtype=torch.float64) * 3
    cases = [(1.0, 0.0, 0.0), (1.7, 0.0, 0.0), (0.6, 0.0, 0.0), (1.0, 0.8, 0.0),
             (1.0, 0.0, -1.5), (1.3, 0.5, 0.7)]
    states = []
    for i, (rep, freq, pres) in enumerate(cases):
        prompt = torch.randint(0, 50, (12,), generator=gen).tolist()
        output = torch.randint(0, 50, (9,), generator=gen).tolist() + [i, i, i]
        p = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        states.append(RequestSamplingState.create(p, prompt, output))
    got = x.float()
    _apply_penalties(got, states)
    for row, s in enumerate(states):
        p = s.params
        want = ref_penalise(x[row].tolist(), s.prompt_token_ids, s.output_token_ids,
                            p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        torch.testing.assert_close(got[row].double(), torch.tensor(want, dtype=torch.float64),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("logits", "prompt", "output", "rep", "freq", "pres", "expected"),
    [
        ([3.0, 2.0], [0], [], 2.0, 0.0, 0.0, 1),  # positive logit divided: 1.5 < 2
        ([-1.0, -2.0], [0], [], 3.0, 0.0, 0.0, 1),  # negative logit multiplied: -3 < -2
        ([3.0, 2.0], [], [0], 1.0, 0.0, 1.5, 1),  # presence: 1.5 < 2
        ([3.0, 2.0], [0], [], 1.0, 0.0, 1.5, 0),  # presence ignores the prompt
        ([3.0, 2.5], [], [0, 0], 1.0, 0.2, 0.0, 0),  # frequency 0.4: 2.6 > 2.5
        ([3.0, 2.5], [], [0, 0, 0], 1.0, 0.2, 0.0, 1),  # frequency 0.6: 2.4 < 2.5
        ([3.0, 2.0], [0], [], 0.5, 0.0, 0.0, 0),  # penalty < 1 favours seen tokens
        ([2.0, 3.0], [], [0], 1.0, 0.0, -1.5, 0),  # negative presence favours them too
    ],
)
def test_penalties_change_greedy_choice_as_reference_says(
    logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float,
    pres: float, expected: int,
) -> None:
    want = ref_penalise(logits, prompt, output, rep, freq, pres)
    assert max(range(len(want)), key=want.__getitem__) == expected
    params = SamplingParams(temperature=0.0, repetition_penalty=rep, frequency_penalty=freq,
                            presence_penalty=pres)
    tokens, _ = Sampler()(torch.tensor([logits]), make_states(params, 1, prompt, output))
    assert tokens == [expected]


def test_penalties_reject_out_of_vocab_ids() -> None:
    params = SamplingParams(repetition_penalty=1.2)
    with pytest.raises(ValueError, match="token ids"):
        Sampler()(torch.zeros(2, 10), make_states(params, 2, prompt=[10]))


def test_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(3, 10), make_states(SamplingParams(), 2))


# ----------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"temperature": 0.6, "top_k": 5},
                                    {"repetition_penalty": 2.0, "frequency_penalty": 1.0}])
def test_logprobs_come_from_raw_logits(kwargs: dict) -> None:
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(8, 200, generator=gen) * 4).to(torch.bfloat16)
    nums = [None, 0, 1, 5, 20, 3, None, 2]
    states = [RequestSamplingState.create(SamplingParams(logprobs=n, seed=i, **kwargs),
                                          list(range(20)), [1, 1, 2])
              for i, n in enumerate(nums)]
    tokens, lps = Sampler()(x, states)
    ref = torch.log_softmax(x.double(), dim=-1)
    for row, (n, tok, lp) in enumerate(zip(nums, tokens, lps, strict=True)):
        if n is None:
            assert lp is None
            continue
        assert lp is not None and lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[row, tok].item(), abs=1e-5)
        assert lp.rank == int((ref[row] > ref[row, tok]).sum()) + 1
        want = ref[row].topk(n) if n else None
        assert len(lp.top) == n
        if want is not None:
            assert [t for t, _ in lp.top] == want.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-5)


def test_greedy_choice_has_rank_one() -> None:
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    _, lps = Sampler()(x, make_states(SamplingParams(temperature=0.0, logprobs=1), 4))
    assert all(lp is not None and lp.rank == 1 and lp.top[0][0] == lp.token_id for lp in lps)


# ----------------------------------------------------------------------------- seeds


def decode(
    target: SamplingParams, others: list[SamplingParams], position: int, steps: int = 16,
    vocab: int = 64,
) -> list[int]:
    """Run ``steps`` steps with ``target`` at ``position`` among ``others``; its tokens."""
    table = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(11))
    params = others[:position] + [target] + others[position:]
    states = [RequestSamplingState.create(p, [1, 2, 3], []) for p in params]
    sampler = Sampler()
    for step in range(steps):
        noise = torch.randn(len(states), vocab)  # other rows' logits change every run
        x = noise.clone()
        x[position] = table[step] + 0.05 * len(states[position].output_token_ids)
        tokens, _ = sampler(x, states)
        for s, t in zip(states, tokens, strict=True):
            s.output_token_ids.append(t)
    return states[position].output_token_ids


OTHERS = [
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(seed=99, top_p=0.5),
    SamplingParams(top_k=3, repetition_penalty=1.3, logprobs=2),
    SamplingParams(seed=7, min_p=0.2, temperature=1.4),
]


@pytest.mark.parametrize(
    "target",
    [SamplingParams(seed=1234, temperature=1.3),
     SamplingParams(seed=42, top_k=20, top_p=0.9, min_p=0.01, presence_penalty=0.5)],
)
def test_seeded_request_is_batch_invariant(target: SamplingParams) -> None:
    alone = decode(target, [], 0)
    assert decode(target, [], 0) == alone  # same seed, same tokens
    assert decode(target, OTHERS, 0) == alone
    assert decode(target, OTHERS, 3) == alone
    assert decode(target, OTHERS * 3, 15) == alone
    # Not vacuous: another seed takes a different path.
    other_seed = SamplingParams(**{**{f: getattr(target, f) for f in target.__slots__},
                                   "seed": target.seed + 1})
    assert decode(other_seed, OTHERS, 3) != alone


def test_unseeded_rows_follow_the_shared_generator() -> None:
    x = torch.zeros(32, 100)
    states = make_states(SamplingParams(), 32)
    a, _ = Sampler(torch.Generator().manual_seed(5))(x, states)
    b, _ = Sampler(torch.Generator().manual_seed(5))(x, states)
    c, _ = Sampler(torch.Generator().manual_seed(6))(x, states)
    assert a == b and a != c


def test_large_vocab_batch_smoke() -> None:
    """The engine's real shape: mixed params over V=49152 in bf16."""
    x = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    mix = [SamplingParams(temperature=0.0), SamplingParams(seed=3, top_p=0.95),
           SamplingParams(top_k=50, logprobs=5), SamplingParams(min_p=0.05, temperature=0.7),
           SamplingParams(repetition_penalty=1.1, frequency_penalty=0.3, top_p=0.9)]
    states = [RequestSamplingState.create(mix[i % 5], list(range(100)), [5, 6, 7])
              for i in range(64)]
    tokens, lps = Sampler()(x, states)
    assert len(tokens) == 64 and all(0 <= t < 49152 for t in tokens)
    assert tokens[0::5] == x[0::5].float().argmax(dim=-1).tolist()
    assert all((lp is not None) == (i % 5 == 2) for i, lp in enumerate(lps))
