"""Pydantic models of the bodies the server writes: responses, stream chunks, errors, model list.

responses.py builds them as dicts, the same shape; the OpenAPI document
(``fitserve.server.openapi``) publishes their serialization schemas. Closed (extra="forbid": no
other key is ever written), and in a body every key is always written, defaults included; stream
chunks (_Chunk) leave some keys out, as noted. ``fitserve.server.protocol`` re-exports them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fitserve.server.protocol_structured import ToolCall, ToolCallDelta

_Body = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)
_Chunk = ConfigDict(extra="forbid")

# fitserve.types.FinishReason's values, and "tool_calls" (a chat choice that ended in tool calls)
FinishReasonName = Literal["stop", "length", "abort", "error", "tool_calls"]
StopReason = str | int | None  # the stop string or stop token id that ended a choice; null: EOS or length


def _absent_or_value(schema: dict[str, Any]) -> None:
    """A stream key that is either left out or has a value (never null)."""
    branches = [b for b in schema.pop("anyOf", []) if b.get("type") != "null"]
    if branches:
        schema.update(branches[0] if len(branches) == 1 else {"anyOf": branches})
    schema.pop("default", None)


class PromptTokensDetails(BaseModel):
    model_config = _Body
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    model_config = _Body
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorBody(BaseModel):
    model_config = _Body
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "rate_limit_error, server_error or service_unavailable.")
    param: str | None = Field(None, description="The request field at fault, when there is one.")
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body (and an error event in a stream): the OpenAI error shape."""

    model_config = _Body
    error: ErrorBody


class CompletionLogprobs(BaseModel):
    model_config = _Body
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int] = Field(description="Character offset of each token in the choice's text.")


class CompletionChoice(BaseModel):
    model_config = _Body
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonName | None
    stop_reason: StopReason = Field(description="vLLM extension: the stop string or stop token id that "
                                                "ended the choice.")


class Completion(BaseModel):
    """A POST /v1/completions response (stream=false)."""

    model_config = _Body
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    model_config = _Body
    token: str
    logprob: float
    bytes: list[int] = Field(description="The token's UTF-8 bytes.")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    model_config = _Body
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    model_config = _Body
    role: Literal["assistant"]
    content: str | None = Field(description="The text; null when the choice is only tool calls.")
    tool_calls: list[ToolCall] = Field(description="The tool calls the model made (empty: none).")


class ChatChoice(BaseModel):
    model_config = _Body
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName | None
    stop_reason: StopReason = Field(description="vLLM extension: the stop string or stop token id that "
                                                "ended the choice.")


class ChatCompletion(BaseModel):
    """A POST /v1/chat/completions response (stream=false)."""

    model_config = _Body
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    model_config = _Chunk
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonName | None
    stop_reason: StopReason = Field(None, description="Only in the choice's last chunk.")


class CompletionChunk(BaseModel):
    """One `data:` event of a streamed POST /v1/completions."""

    model_config = _Chunk
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(None, description="Only in the last chunk (with no choices), when "
                                                  "stream_options.include_usage is true.",
                                json_schema_extra=_absent_or_value)


class ChatDelta(BaseModel):
    model_config = _Chunk
    role: Literal["assistant"] | None = Field(None, description="Only in the first chunk.",
                                              json_schema_extra=_absent_or_value)
    content: str | None = Field(None, description="The new text; left out of a chunk that only finishes.",
                                json_schema_extra=_absent_or_value)
    tool_calls: list[ToolCallDelta] | None = Field(None, description="Tool calls completed since the last chunk, "
                                                                     "each whole.",
                                                   json_schema_extra=_absent_or_value)


class ChatChunkChoice(BaseModel):
    model_config = _Chunk
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName | None
    stop_reason: StopReason = Field(None, description="Only in the choice's last chunk.")


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed POST /v1/chat/completions."""

    model_config = _Chunk
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="Only in the last chunk (with no choices), when "
                                                  "stream_options.include_usage is true.",
                                json_schema_extra=_absent_or_value)


class ModelCard(BaseModel):
    model_config = _Body
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fitserve"
    max_model_len: int | None = None
    # fitserve extras: what a request that omits a sampling field gets, and where it came from
    sampling_defaults: dict[str, float | int] | None = Field(
        None, description="fitserve extension: what a request that omits a sampling field gets.")
    sampling_defaults_source: dict[str, str] | None = Field(
        None, description="fitserve extension: where each of sampling_defaults comes from.")


class ModelList(BaseModel):
    model_config = _Body
    object: Literal["list"] = "list"
    data: list[ModelCard]


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


def chat_body(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], *, chunk: bool,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """A /v1/chat/completions response (``chunk=False``) or stream chunk (``chunk=True``)."""
    body: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": created, "model": model, "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body


__all__ = [
    "AssistantMessage",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatDelta",
    "ChatLogprobs",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionChunkChoice",
    "CompletionLogprobs",
    "ErrorBody",
    "ErrorResponse",
    "FinishReasonName",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "StopReason",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "chat_body",
    "completion_chunk",
]
