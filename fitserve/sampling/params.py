"""Per-request sampling parameters with OpenAI/vLLM semantics and defaults.

Torch-free on purpose: the scheduler reads ``max_tokens``, ``stop_token_ids`` and ``ignore_eos``
and must not import torch. Every value is checked once, in ``__post_init__``, so a bad request
fails at ``add_request`` with a message naming the field, never inside a batched step where it
would disturb other requests.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from fitserve.structured.guided import GuidedDecoding

# NOTE: vLLM's _SAMPLING_EPS: a temperature below this is treated as greedy, because dividing
# logits by it would overflow or make sampling numerically indistinguishable from argmax.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


def _as_int(name: str, value: object) -> int:
    # bool is an Integral in Python; `n=True` is a caller bug, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return result


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    Defaults follow the OpenAI API / vLLM: plain sampling at temperature 1, 16 new tokens.
    ``top_k`` of 0 or -1 disables top-k; ``logprobs=0`` returns only the chosen token's logprob,
    ``logprobs=N`` also the N most likely tokens. ``prompt_logprobs=N`` (vLLM's) returns, for
    every prompt token but the first, its logprob given the tokens before it and the N most
    likely tokens there (``RequestOutput.prompt_logprobs``). ``stop`` may be given as one string
    or a list; it is stored as a list.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before sampling
    logit_bias: dict[int, float] | None = None
    # structured output: the output must match this schema / regex / choice / grammar
    guided: GuidedDecoding | None = None
    # vLLM's extras: EOS / stop tokens and stop strings do not end the output before min_tokens;
    # only these ids may be sampled; these words (tokenized by the engine) are never completed
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        self.n = _as_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1 (or None), got {self.max_tokens}")
        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or >= 0 (0 and -1 disable it), got {self.top_k}")
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), got {self.logprobs}"
                )
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _as_int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (or None), "
                                 f"got {self.prompt_logprobs}")
        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _as_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        if self.logit_bias is not None:
            self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self._check_extras()
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise ValueError(f"guided must be a GuidedDecoding, got {self.guided!r}")

    def _check_extras(self) -> None:
        """min_tokens, allowed_token_ids and bad_words, checked as vLLM's SamplingParams does."""
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list | tuple):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {self.allowed_token_ids!r}")
            ids = [_as_int("allowed_token_ids", i) for i in self.allowed_token_ids]
            if not ids:
                raise ValueError("allowed_token_ids must not be empty (nothing could be sampled)")
            if min(ids) < 0:
                raise ValueError(f"allowed_token_ids must be non-negative, got {min(ids)}")
            self.allowed_token_ids = ids
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list | tuple) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token = int(key)  # JSON object keys are strings: "50256"
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if token < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {token}")
            v = _as_float(f"logit_bias[{key}]", value)
            if not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v} for {key}")
            out[token] = v
        return out

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list | tuple):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for s in items:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {s!r}")
        return list(items)  # a copy: the caller's list stays theirs

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if not isinstance(ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
        result = [_as_int("stop_token_ids", i) for i in ids]
        for i in result:
            if i < 0:
                raise ValueError(f"stop_token_ids must be non-negative, got {i}")
        return result

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, up to vLLM's epsilon)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering applies (0 and -1 both mean disabled)."""
        return self.top_k > 0
