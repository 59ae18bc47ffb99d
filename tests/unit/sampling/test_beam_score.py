"""beam_score over the whole range of length_penalty vLLM accepts (any finite float)."""

from __future__ import annotations

import math

import pytest

from fitserve.sampling.beam_search import beam_score


@pytest.mark.parametrize(("cum", "n", "lp", "want"), [
    (-3.0, 3, 1.0, -1.0),  # the plain rule: cum / len ** lp
    (-3.0, 4, 0.5, -1.5),
    (-3.0, 1, 5e178, -3.0),  # 1 ** anything is 1
    (-3.0, 2, 1100.0, -0.0),  # 2 ** 1100 overflows: the limit is 0
    (-3.0, 2, -1100.0, -math.inf),  # 2 ** -1100 underflows to 0: the limit is -inf
    (0.0, 2, -1100.0, 0.0),
    (-3.0, 0, 2.0, -3.0),  # no token yet counts as one
])
def test_beam_score_takes_its_limit_instead_of_raising(cum: float, n: int, lp: float, want: float) -> None:
    assert beam_score(cum, n, lp) == want


def test_the_ranking_keeps_its_order_near_the_limits() -> None:
    # with a huge positive penalty longer hypotheses win; with a huge negative one shorter ones
    assert beam_score(-5.0, 8, 1000.0) > beam_score(-5.0, 2, 1000.0)
    assert beam_score(-5.0, 2, -1000.0) >= beam_score(-5.0, 8, -1000.0)
