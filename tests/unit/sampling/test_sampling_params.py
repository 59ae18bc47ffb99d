"""SamplingParams: OpenAI/vLLM defaults, validation that names the field, stop normalisation."""

from __future__ import annotations

import math

import pytest

from fitserve.sampling.params import SamplingParams


def test_defaults_follow_openai_and_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.logprobs is None
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy and not p.top_k_enabled


def test_default_lists_are_not_shared() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop_token_ids.append(7)
    assert b.stop_token_ids == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", -3),
        ("n", 1.5),
        ("n", True),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", "16"),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "hot"),
        ("temperature", None),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.0001),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("frequency_penalty", "0.5"),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 2.0),
        ("seed", 1.5),
        ("seed", "42"),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", 5),
        ("stop_token_ids", None),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("include_stop_str_in_output", None),
    ],
)
def test_bad_value_raises_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 5},  # an int is fine for a float field
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"repetition_penalty": 1e-3},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": 0},
        {"logprobs": 20},
        {"max_tokens": None},
        {"max_tokens": 1},
        {"seed": -5},
        {"seed": 2**70},
        {"n": 4},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]  # must not raise
    for field, value in kwargs.items():
        assert getattr(params, field) == value, field  # and keeps the value as given


def test_numbers_are_normalised_to_their_field_type() -> None:
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=1)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.presence_penalty, float)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, []), ("###", ["###"]), (["a", "bc"], ["a", "bc"]), (("x",), ["x"]), ([], [])],
)
def test_stop_is_normalised_to_a_list(stop: object, expected: list[str]) -> None:
    assert SamplingParams(stop=stop).stop == expected  # type: ignore[arg-type]


def test_stop_list_is_copied() -> None:
    stops = ["a"]
    p = SamplingParams(stop=stops, stop_token_ids=(2, 3))  # type: ignore[arg-type]
    stops.append("b")
    assert p.stop == ["a"]
    assert p.stop_token_ids == [2, 3]


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-5, False),
                                                     (0.7, False)])
def test_greedy_uses_vllm_epsilon(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_top_k_minus_one_and_zero_both_disable() -> None:
    assert not SamplingParams(top_k=-1).top_k_enabled
    assert not SamplingParams(top_k=0).top_k_enabled
    assert SamplingParams(top_k=3).top_k_enabled
