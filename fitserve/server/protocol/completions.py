"""POST /v1/completions: the request, the response, and the chunks of its stream."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from fitserve.sampling.params import MAX_LOGPROBS
from fitserve.server.protocol.common import (
    BODY,
    CHUNK,
    MAX_PROMPTS_PER_REQUEST,
    FinishReasonName,
    SamplingFields,
    StopReason,
    Usage,
    absent_or_value,
    desc,
)


def _prompt_schema(schema: dict[str, Any]) -> None:
    """prompt: a non-empty string, token ids, or a batch of either (1..MAX_PROMPTS_PER_REQUEST)."""
    for b in schema["anyOf"]:
        if b["type"] == "string":
            b["minLength"] = 1
            continue
        b["minItems"] = 1
        item = b["items"]
        if item["type"] == "integer":  # token ids of one prompt
            item["minimum"] = 0
        else:  # a batch
            b["maxItems"] = MAX_PROMPTS_PER_REQUEST
            item.update({"minLength": 1} if item["type"] == "string" else {"minItems": 1})
            if item["type"] == "array":
                item["items"]["minimum"] = 0


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="A string, token ids, or a batch of either (at most "
                    f"{MAX_PROMPTS_PER_REQUEST} prompts; choice i*n + j is sample j of prompt i). Token ids "
                    "must be in [0, vocabulary size); no prompt may be empty or fill the context.",
        json_schema_extra=_prompt_schema)
    max_tokens: int | None = desc(16, "Most tokens to generate, >= 1 (default 16, as OpenAI); null: up to the "
                                      "context length. Prompt + max_tokens over the context length is a 400. "
                                      "0 only with `echo`: the prompt alone, scored (lm-eval's loglikelihood).",
                                  integer={"minimum": 0})
    logprobs: int | None = desc(None, f"Return the chosen tokens' logprobs and the top-N alternatives, N in "
                                      f"0..{MAX_LOGPROBS} (OpenAI allows 5).",
                                integer={"minimum": 0, "maximum": MAX_LOGPROBS})
    echo: bool = desc(False, "Prepend the prompt's text to each choice's text (a token-id prompt is decoded); "
                             "with `logprobs`, the prompt's tokens come first in `logprobs` too (the first "
                             "one's logprob and top_logprobs null).")
    prompt_logprobs: int | None = desc(None, f"vLLM extension (not OpenAI): return `prompt_logprobs`, each prompt "
                                             f"token's logprob given the tokens before it with the top-N, N in "
                                             f"0..{MAX_LOGPROBS}. Not with `stream` (a 400).",
                                       integer={"minimum": 0, "maximum": MAX_LOGPROBS})
    add_special_tokens: bool = desc(True, "vLLM extension (not OpenAI): add the model's BOS token to a text "
                                          "prompt if it uses one (token-id prompts are taken as given).")
    best_of: int | None = desc(None, "Not supported beyond OpenAI's default: absent, null or equal to `n`.")


class CompletionLogprobs(BaseModel):
    model_config = BODY
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token.")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int] = Field(description="Character offset of each token in the choice's text.")


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's entry in ``prompt_logprobs``."""

    model_config = BODY
    logprob: float
    rank: int = Field(description="1 = the most likely token at that position.")
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None] | None
"""vLLM's prompt_logprobs: per prompt token (null first), token id -> its entry, the prompt's
token and the top-N."""


class CompletionChoice(BaseModel):
    model_config = BODY
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs = Field(description="vLLM extension: with `prompt_logprobs` set.")
    finish_reason: FinishReasonName | None
    stop_reason: StopReason = Field(description="vLLM extension: the stop string or stop token id that "
                                                "ended the choice.")


class Completion(BaseModel):
    """A POST /v1/completions response (stream=false)."""

    model_config = BODY
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    model_config = CHUNK
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonName | None
    stop_reason: StopReason = Field(None, description="Only in the choice's last chunk.")


class CompletionChunk(BaseModel):
    """One `data:` event of a streamed POST /v1/completions."""

    model_config = CHUNK
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(None, description="Only in the last chunk (with no choices), when "
                                                  "stream_options.include_usage is true.",
                                json_schema_extra=absent_or_value)


def completion_chunk(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], usage: Usage | None = None
) -> dict[str, Any]:
    """A /v1/completions response body or stream chunk (same shape, OpenAI-style)."""
    body: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body
