"""Structured-output request fields -> the engine's :class:`GuidedDecoding`; logit_bias, vLLM's token-level
extras (allowed_token_ids, bad_words, min_tokens) and truncate_prompt_tokens.

The fields (OpenAI's ``response_format``; vLLM's ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` and its newer ``structured_outputs``) are checked for their
*form* here (a schema must be a JSON object, a choice list non-empty...), each mistake a 400
naming the field. Whether a schema, regex or grammar is *valid* is the engine's call: it compiles
the grammar at ``add_request`` and raises ValueError, which comes back as a 400 whose ``param``
is the field the constraint came from (:attr:`Guided.param`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from fitserve.server.errors import bad_request
from fitserve.server.protocol.chat import ChatCompletionRequest
from fitserve.server.protocol.common import MAX_LOGIT_BIAS
from fitserve.server.protocol.completions import CompletionRequest
from fitserve.server.protocol.structured import StructuredOutputs
from fitserve.structured.guided import GuidedDecoding

_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,8}")  # the key pattern the OpenAPI document states
GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")


@dataclass(frozen=True, slots=True)
class Guided:
    """A request's output constraint and the request field it came from (for error messages)."""

    decoding: GuidedDecoding
    param: str


def _schema_text(value: dict[str, Any] | str, param: str) -> str:
    """A JSON schema given as an object or as its JSON text -> its text; a 400 if it is neither."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(parsed, dict):
            raise bad_request(f"{param} must be a JSON schema object, got {type(parsed).__name__}", param)
        return value
    return json.dumps(value, ensure_ascii=False)


def _choice(choices: list[str], param: str) -> GuidedDecoding:
    if not choices:
        raise bad_request(f"{param} must list at least one string", param)
    if any(not c for c in choices):
        raise bad_request(f"{param} must not contain an empty string", param)
    return GuidedDecoding("choice", json.dumps(choices, ensure_ascii=False))


def _text(kind: str, value: str, param: str) -> GuidedDecoding:
    if not value:
        raise bad_request(f"{param} must not be empty", param)
    return GuidedDecoding(kind, value)


def _from_structured_outputs(so: StructuredOutputs) -> GuidedDecoding | None:
    param = "structured_outputs"
    given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None]
    if so.json_object:
        given.append("json_object")
    if len(given) > 1:
        names = ", ".join(k.rstrip("_") for k in given)
        raise bad_request(f"structured_outputs takes one constraint, got {names}", param)
    if not given:
        return None
    if so.json_ is not None:
        return GuidedDecoding("json_schema", _schema_text(so.json_, f"{param}.json"))
    if so.regex is not None:
        return _text("regex", so.regex, f"{param}.regex")
    if so.choice is not None:
        return _choice(so.choice, f"{param}.choice")
    if so.grammar is not None:
        return _text("grammar", so.grammar, f"{param}.grammar")
    return GuidedDecoding("json_object")


def _response_format(req: CompletionRequest | ChatCompletionRequest) -> GuidedDecoding | None:
    rf = req.response_format
    if rf is None:
        return None
    if rf.type != "json_schema":
        if rf.json_schema is not None:
            raise bad_request(f"response_format.json_schema is only allowed with type json_schema, not {rf.type}",
                              "response_format")
        return GuidedDecoding("json_object") if rf.type == "json_object" else None  # text: no constraint
    if rf.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
    return GuidedDecoding("json_schema", _schema_text(rf.json_schema.schema_, "response_format"))


def _one(req: CompletionRequest | ChatCompletionRequest, name: str) -> GuidedDecoding | None:
    if name == "response_format":
        return _response_format(req)
    if name == "structured_outputs":
        return _from_structured_outputs(req.structured_outputs) if req.structured_outputs else None
    value = getattr(req, name)
    if value is None:
        return None
    if name == "guided_json":
        return GuidedDecoding("json_schema", _schema_text(value, name))
    if name == "guided_choice":
        return _choice(value, name)
    return _text("regex" if name == "guided_regex" else "grammar", value, name)


def guided_from_request(req: CompletionRequest | ChatCompletionRequest) -> Guided | None:
    """The request's output constraint, or None; a 400 for two at once or a malformed one."""
    found: list[Guided] = []
    for name in GUIDED_FIELDS:
        decoding = _one(req, name)
        if decoding is not None:
            found.append(Guided(decoding, name))
    if len(found) > 1:
        names = ", ".join(g.param for g in found)
        raise bad_request(f"at most one output constraint per request: got {names}", found[1].param)
    return found[0] if found else None


def logit_bias_from_request(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> [-100, 100]) as token ids; a 400 naming a bad entry."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS} are allowed", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key) or int(key) >= vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}) written in decimal, "
                              f"got {key!r}", "logit_bias")
        if not -100.0 <= value <= 100.0:  # NaN fails this too
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value} for token {key}", "logit_bias")
        out[int(key)] = float(value)
    return out


def sampling_extras(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> dict[str, Any]:
    """vLLM's token-level extras as SamplingParams fields; a 400 naming a bad or refused one."""
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise bad_request("allowed_token_ids must list at least one token id", "allowed_token_ids")
        if max(req.allowed_token_ids) >= vocab_size:
            raise bad_request(f"allowed_token_ids must be token ids in [0, {vocab_size}), got "
                              f"{max(req.allowed_token_ids)}", "allowed_token_ids")
    if req.bad_words is not None and any(not w.strip() for w in req.bad_words):
        raise bad_request("bad_words must not contain an empty or blank word", "bad_words")
    if req.spaces_between_special_tokens and not req.skip_special_tokens:
        raise bad_request("spaces_between_special_tokens: fitserve decodes special tokens as vLLM's fast "
                          "detokenizer does, with no spaces added around them (send false or leave it out)",
                          "spaces_between_special_tokens")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise bad_request("stream_options.continuous_usage_stats is not supported: usage comes in the last "
                          "chunk (include_usage)", "stream_options")
    return {"min_tokens": req.min_tokens, "allowed_token_ids": req.allowed_token_ids,
            "bad_words": req.bad_words or None}


def truncate_prompts(prompts: list[list[int]], keep: int | None, max_model_len: int) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens``: each prompt's last ``keep`` tokens (-1: the context length)."""
    if keep is None:
        return prompts
    if keep == -1:
        keep = max_model_len
    if not 1 <= keep <= max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the context length), "
                          f"got {keep}", "truncate_prompt_tokens")
    return [ids[-keep:] for ids in prompts]
