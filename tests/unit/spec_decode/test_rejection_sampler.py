"""Speculative verification (rejection sampling) against plain, one-token-at-a-time sampling.

The reference is the plain algorithm: greedy decoding's argmax, and for random requests the
distribution ``Sampler.__call__`` draws from, which ``Sampler.probabilities`` must equal (checked
here by many draws). With target logits that do not depend on the prefix, plain sampling emits
its j-th token from ``p_j`` independently of the rest, so the j-th token verify() emits (in the
trials where it emits one) must be distributed as ``p_j`` whatever the draft does.

Statistic: Pearson's chi-square over the reference support (a token outside it fails at once),
compared with the chi-square critical value at significance 1e-3 for ``df = |support| - 1``
(table CHI2_CRITICAL_1E3). Every run is seeded, so the tests are deterministic; the 1e-3 level
says how unlikely a pass/fail flip would be for another seed. The same statistic exceeds the
critical value when a deliberately wrong acceptance or correction rule is substituted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from fitserve.sampling import RequestSamplingState, Sampler, SamplingParams
from fitserve.spec_decode import rejection
from fitserve.spec_decode.rejection import verify

# Upper 1e-3 quantiles of the chi-square distribution, by degrees of freedom.
CHI2_CRITICAL_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458,
                     7: 24.322}


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs`` and its df; inf off the support."""
    n = sum(counts)
    if any(c and p == 0 for c, p in zip(counts, probs, strict=True)):
        return float("inf"), 0
    support = [t for t, p in enumerate(probs) if p > 0]
    stat = sum((counts[t] - n * probs[t]) ** 2 / (n * probs[t]) for t in support)
    return stat, len(support) - 1


def assert_matches(counts: list[int], probs: list[float], what: str) -> None:
    stat, df = chi_square(counts, probs)
    if df == 0:  # a point mass: only the support check applies
        assert stat == 0.0, (what, counts, probs)
        return
    assert stat <= CHI2_CRITICAL_1E3[df], (what, stat, df, counts, probs)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Run these tiny-tensor loops on one intra-op thread, restored afterwards.

    NOTE: softmax of a [4, 6] tensor still forks onto torch's thread pool; on a shared,
    oversubscribed CPU each such op then waits ~8 ms for a descheduled worker, which turns a
    20k-trial loop from seconds into minutes. The result is the same on any thread count.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def state_for(params: SamplingParams) -> RequestSamplingState:
    return RequestSamplingState.create(params, [1, 2, 3], [])


# ----------------------------------------------------------------------------- probabilities

V6 = [1.2, 0.9, 0.4, 0.0, -0.3, -1.1]

PROB_CASES = [
    {},
    {"temperature": 0.6},
    {"temperature": 1.8},
    {"top_k": 3},
    {"top_p": 0.7},
    {"min_p": 0.3},
    {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.5, "top_k": 4, "top_p": 0.8},
]


def sampler_counts(logits: list[float], params: SamplingParams, draws: int,
                   seed: int = 0) -> list[int]:
    """Counts per token of ``Sampler.__call__`` over ``draws`` rows of the same logits."""
    sampler = Sampler(generator=torch.Generator().manual_seed(seed))
    x = torch.tensor([logits] * draws)
    tokens, _ = sampler(x, [state_for(params) for _ in range(draws)])
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).tolist()


def probs_of(logits: list[float], params: SamplingParams) -> list[float]:
    out = Sampler().probabilities(torch.tensor([logits]), [state_for(params)])
    return out[0].tolist()


@pytest.mark.parametrize("kwargs", PROB_CASES)
def test_probabilities_is_what_the_sampler_draws_from(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    probs = probs_of(V6, params)
    assert sum(probs) == pytest.approx(1.0, abs=1e-6)
    assert_matches(sampler_counts(V6, params, 40_000), probs, f"sampler {kwargs}")


def test_probabilities_check_is_not_vacuous() -> None:
    counts = sampler_counts(V6, SamplingParams(temperature=0.85), 40_000)
    stat, df = chi_square(counts, probs_of(V6, SamplingParams()))
    assert stat > CHI2_CRITICAL_1E3[df]


def test_probabilities_exact_values() -> None:
    x = torch.tensor([[2.0, 1.0, 1.0, 0.0], [0.0, 3.0, 3.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    states = [state_for(SamplingParams(top_k=1)), state_for(SamplingParams(temperature=0.0)),
              state_for(SamplingParams(top_k=2, temperature=0.5))]
    got = Sampler().probabilities(x.to(torch.bfloat16), states)
    assert got.dtype == torch.float32
    e2 = torch.exp(torch.tensor(-2.0)).item()  # (0 - 1) / 0.5: the ties at 0 all stay (top-k)
    want = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0],
                         [1.0, e2, e2, e2]])
    want[2] /= want[2].sum()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("field", ["repetition_penalty", "frequency_penalty",
                                   "presence_penalty"])
def test_probabilities_and_verify_refuse_penalties(field: str) -> None:
    state = state_for(SamplingParams(**{field: 1.5}))
    with pytest.raises(ValueError, match="penalt"):
        Sampler().probabilities(torch.zeros(1, 5), [state])
    with pytest.raises(ValueError, match="penalt"):
        verify(torch.zeros(2, 5), [1], None, state, Sampler())


# ----------------------------------------------------------------------------- greedy

GREEDY = SamplingParams(temperature=0.0)


def one_hot_rows(argmaxes: list[int], vocab: int = 7) -> torch.Tensor:
    x = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(4))
    for row, t in enumerate(argmaxes):
        x[row, t] = 10.0
    return x


def test_greedy_all_accepted_appends_the_bonus_argmax() -> None:
    x = one_hot_rows([3, 1, 4, 6])
    assert verify(x, [3, 1, 4], None, state_for(GREEDY), Sampler()) == [3, 1, 4, 6]


@pytest.mark.parametrize("j", [0, 1, 2])
def test_greedy_rejection_at_j_appends_that_rows_argmax(j: int) -> None:
    best = [3, 1, 4, 6]
    drafts = best[:3]
    drafts[j] = (best[j] + 2) % 7
    out = verify(one_hot_rows(best), drafts, None, state_for(GREEDY), Sampler())
    assert out == drafts[:j] + [best[j]]


def test_greedy_ties_take_the_first_index() -> None:
    x = torch.tensor([[0.0, 5.0, 5.0, 1.0], [2.0, 2.0, 0.0, 0.0]])
    assert verify(x, [2], None, state_for(GREEDY), Sampler()) == [1]
    assert verify(x, [1], None, state_for(GREEDY), Sampler()) == [1, 0]


def test_greedy_equals_plain_greedy_decoding_and_ignores_draft_probs() -> None:
    gen = torch.Generator().manual_seed(8)
    for _ in range(50):
        k = int(torch.randint(0, 6, (1,), generator=gen))
        x = torch.randn(k + 1, 40, generator=gen).to(torch.bfloat16)
        plain, _ = Sampler()(x, [state_for(GREEDY)] * (k + 1))
        # drafts: plain greedy's tokens, then a wrong one at a random place (or none)
        drafts = plain[:k]
        cut = int(torch.randint(0, k + 1, (1,), generator=gen))
        if cut < k:
            drafts[cut] = (drafts[cut] + 1) % 40
        q = torch.softmax(torch.randn(k, 40, generator=gen), dim=-1)
        state = RequestSamplingState.create(SamplingParams(temperature=0.0, seed=5), [], [])
        before = state.generator.get_state() if state.generator is not None else None
        out = verify(x, drafts, q, state, Sampler())
        assert out == plain[:min(cut, k) + 1]
        assert state.generator is not None and torch.equal(state.generator.get_state(), before)


# ----------------------------------------------------------------------------- distribution

VOCAB = 6
TARGET = torch.tensor([[1.0, 0.6, 0.2, -0.2, -0.7, 0.1],
                       [-0.3, 0.8, 0.5, 1.1, -1.0, 0.0],
                       [0.4, -0.5, 1.3, 0.2, 0.9, -0.8],
                       [0.0, 0.3, -0.6, 0.7, 1.0, 0.5]])
# What the draft model gets wrong at each position (same params as the target).
DRAFT_SHIFT = torch.tensor([[-0.9, 0.8, 0.0, 0.6, 0.3, -0.4],
                            [0.7, -0.8, 0.4, -0.5, 0.9, 0.2],
                            [-0.6, 0.7, -0.9, 0.5, 0.0, 0.6]])

# A deterministic proposer's choices, cycled by trial: every token (so also ones top-k/top-p
# exclude), not uniformly (a uniform mixture would hide a wrong correction rule on average).
PROPOSALS = [0, 0, 1, 3, 5, 2, 0, 4]

Rule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def run_trials(params: SamplingParams, k: int, use_draft: bool, trials: int,
               seeded: bool = True) -> tuple[list[list[int]], torch.Tensor]:
    """Per emitted position j, counts of each token over ``trials`` verify() calls; and p.

    The draft model's q_i is ``Sampler.probabilities`` of shifted target logits, its drafts
    drawn from q_i by an independent generator. Without a draft model the proposer is
    deterministic but varies by trial (so it also proposes tokens the target excludes).
    """
    sampler = Sampler(generator=torch.Generator().manual_seed(123))
    state = RequestSamplingState.create(SamplingParams(**{**_fields(params),
                                                          "seed": 7 if seeded else None}),
                                        [], [])
    logits = TARGET[:k + 1]
    p = sampler.probabilities(logits, [state] * (k + 1))
    q = sampler.probabilities(logits[:k] + DRAFT_SHIFT[:k], [state] * k) if use_draft else None
    proposer = torch.Generator().manual_seed(99)
    if q is not None and k:
        drafts = torch.multinomial(q, trials, replacement=True, generator=proposer).T.tolist()
    else:
        drafts = [[PROPOSALS[(t + 3 * i) % len(PROPOSALS)] for i in range(k)]
                  for t in range(trials)]
    counts = [[0] * VOCAB for _ in range(k + 1)]
    for d in drafts:
        for j, token in enumerate(verify(logits, d, q, state, sampler)):
            counts[j][token] += 1
    return counts, p


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__slots__}


def check_positions(counts: list[list[int]], p: torch.Tensor, what: str) -> None:
    for j, row in enumerate(counts):
        if sum(row) >= 500:  # later positions are reached only after accepted drafts
            assert_matches(row, p[j].tolist(), f"{what}, emitted token {j}")


DIST_CASES = [
    # (params, k, draft model?, seeded state?)
    (SamplingParams(), 3, False, True),
    (SamplingParams(), 3, True, True),
    (SamplingParams(temperature=0.7, top_k=4), 2, True, True),
    (SamplingParams(temperature=1.4, top_p=0.8), 3, True, False),
    (SamplingParams(top_k=5, top_p=0.9, min_p=0.1), 2, False, False),
    (SamplingParams(temperature=0.9), 0, False, True),
]


@pytest.mark.parametrize(("params", "k", "use_draft", "seeded"), DIST_CASES)
def test_emitted_tokens_follow_the_target(params: SamplingParams, k: int, use_draft: bool,
                                          seeded: bool) -> None:
    counts, p = run_trials(params, k, use_draft, trials=20_000, seeded=seeded)
    assert sum(counts[0]) == 20_000
    assert k == 0 or sum(counts[1]) >= 500  # the second position is really tested
    check_positions(counts, p, f"{params} k={k} draft={use_draft}")


def _always_accept(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(p_x)


def _inverted_ratio(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    return torch.where(q_x > 0, (q_x / p_x).clamp(max=1.0), torch.zeros_like(q_x))


def _resample_target(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p


@pytest.mark.parametrize(
    ("name", "rule", "use_draft"),
    [("_accept_probability", _always_accept, True),
     ("_accept_probability", _always_accept, False),
     ("_accept_probability", _inverted_ratio, True),
     ("_residual", _resample_target, True),
     ("_residual", _resample_target, False)],
)
def test_a_wrong_rule_fails_the_statistic(name: str, rule: Rule, use_draft: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rejection, name, rule)
    counts, p = run_trials(SamplingParams(), 2, use_draft, trials=10_000)
    stat, df = chi_square(counts[0], p[0].tolist())
    assert stat > CHI2_CRITICAL_1E3[df], (name, rule.__name__, stat, counts[0])


def test_draft_equal_to_target_accepts_everything() -> None:
    """q == p: every ratio is 1 (and the residual fallback is never needed)."""
    params = SamplingParams(temperature=0.8, top_k=4)
    sampler = Sampler(generator=torch.Generator().manual_seed(1))
    state = state_for(params)
    p = sampler.probabilities(TARGET, [state] * 4)
    drafts = torch.multinomial(p[:3], 200, replacement=True,
                               generator=torch.Generator().manual_seed(2)).T.tolist()
    assert all(len(verify(TARGET, d, p[:3], state, sampler)) == 4 for d in drafts)


def test_residual_falls_back_to_p_when_p_equals_q() -> None:
    p = torch.tensor([0.5, 0.25, 0.25, 0.0])
    assert torch.equal(rejection._residual(p, p.clone()), p)
    torch.testing.assert_close(rejection._residual(p, torch.tensor([0.25, 0.5, 0.25, 0.0])),
                               torch.tensor([1.0, 0.0, 0.0, 0.0]))


# ----------------------------------------------------------------------------- seeds, shapes


def seeded_run(seed: int, calls: int = 30) -> list[list[int]]:
    params = SamplingParams(seed=seed, temperature=1.2, top_p=0.95)
    state = state_for(params)
    sampler = Sampler()  # unseeded rows would use torch's global RNG: this one must not
    q = sampler.probabilities(TARGET[:3] + DRAFT_SHIFT, [state] * 3)
    return [verify(TARGET, [i % VOCAB, 1, 4], q, state, sampler) for i in range(calls)]


def test_seeded_requests_are_reproducible() -> None:
    a = seeded_run(11)
    torch.manual_seed(0)
    torch.rand(1000)  # disturbing the global RNG must not matter
    assert seeded_run(11) == a
    assert seeded_run(12) != a


def test_unseeded_requests_follow_the_samplers_generator() -> None:
    def run(seed: int) -> list[list[int]]:
        sampler = Sampler(generator=torch.Generator().manual_seed(seed))
        state = state_for(SamplingParams())
        return [verify(TARGET, [0, 3, 2], None, state, sampler) for _ in range(30)]

    assert run(5) == run(5)
    assert run(5) != run(6)


@pytest.mark.parametrize(
    ("logits", "drafts", "q", "match"),
    [(torch.zeros(6), [], None, "target_logits"),
     (torch.zeros(3, 6), [1], None, r"target_logits must be \[k \+ 1, V\] = \[2, V\]"),
     (torch.zeros(3, 6), [1, 2], torch.zeros(2, 5), r"draft_probs must be \[k, V\] = \[2, 6\]"),
     (torch.zeros(3, 6), [1, 2], torch.zeros(1, 6), "draft_probs"),
     (torch.zeros(3, 6), [1, 2], torch.zeros(2, 6, 1), "draft_probs"),
     (torch.zeros(3, 6), [1, 6], None, "draft_tokens"),
     (torch.zeros(3, 6), [-1, 2], None, "draft_tokens")],
)
def test_shape_mismatches_are_named(logits: torch.Tensor, drafts: list[int],
                                    q: torch.Tensor | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        verify(logits, drafts, q, state_for(SamplingParams()), Sampler())


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.0)])
def test_k_zero_emits_one_token(params: SamplingParams) -> None:
    x = torch.tensor([[0.0, 4.0, 1.0]])
    out = verify(x, [], torch.zeros(0, 3), state_for(params), Sampler())
    assert len(out) == 1 and 0 <= out[0] < 3


def test_large_vocab_smoke() -> None:
    """The engine's shape: k=8, V=49152, bf16 logits, a draft model."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 49152, generator=gen).to(torch.bfloat16)
    params = SamplingParams(seed=3, top_k=50, temperature=0.8)
    sampler, state = Sampler(), state_for(params)
    q = sampler.probabilities(x[:8].float() + 0.1 * torch.randn(8, 49152, generator=gen),
                              [state] * 8)
    drafts = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
    out = verify(x, drafts, q, state, sampler)
    assert 1 <= len(out) <= 9 and out[:-1] == drafts[:len(out) - 1]
    assert all(0 <= t < 49152 for t in out)
