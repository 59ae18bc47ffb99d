"""Pydantic models of the OpenAI HTTP API subset fitserve serves, and the limits it enforces.

Requests are validated in strict mode straight from the JSON bytes, so ``"max_tokens": "5"`` or
``"n": 1.5`` is a 400, not a silent coercion. Unknown fields are ignored (clients send things
like ``user`` or ``metadata``), except the ones listed in :data:`REJECTED_FIELDS`: a chat
template is code, and the server never runs a template a client sent.

Sampling fields default to ``None`` so that "omitted" and "given" differ: an omitted
temperature/top_p/top_k/min_p/repetition_penalty is filled by :meth:`with_defaults` from the
defaults the server put in force (the model's recommended ones, else the server's; see
``fitserve.loading.generation_defaults``), a given one is kept as sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from fitserve.sampling.params import MAX_LOGPROBS

MAX_N = 16  # children per request: each one holds KV blocks, so n is a memory multiplier
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
MAX_PROMPTS_PER_REQUEST = 64
MAX_MESSAGES = 512

# Fields a client may not set. Chat-template knobs run server-side Jinja; the others are
# features fitserve does not have, and silently ignoring them would change results.
REJECTED_FIELDS: dict[str, str] = {
    "chat_template": "client-supplied chat templates are not accepted",
    "chat_template_kwargs": "client-supplied chat template arguments are not accepted",
    "add_generation_prompt": "client-supplied chat template arguments are not accepted",
    "continue_final_message": "client-supplied chat template arguments are not accepted",
    "documents": "client-supplied chat template arguments are not accepted",
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix is not supported",
    "response_format": "response_format is not supported",
}

# Request fields an omitted value of which takes the server's default (not SamplingParams').
DEFAULTED_FIELDS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

_Strict = ConfigDict(strict=True, extra="ignore")
NonNegInt = Annotated[int, Field(ge=0)]
StopField = str | list[str] | None


class StreamOptions(BaseModel):
    model_config = _Strict
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields common to both endpoints; ranges are checked by SamplingParams."""

    model_config = _Strict

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: StopField = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extension: beam search with n beams returned (``n`` is the beam width)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: lower runs first (needs --scheduling-policy priority; any other value is a 400)
    priority: int = 0
    # fitserve's: this request's own targets under --scheduling-policy slo (ms, > 0)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def with_defaults(self, defaults: Mapping[str, float | int]) -> Self:
        """A copy whose omitted (None) fields among DEFAULTED_FIELDS take ``defaults``' values."""
        fill = {k: v for k, v in defaults.items() if k in DEFAULTED_FIELDS and getattr(self, k) is None}
        return self.model_copy(update=fill) if fill else self


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = _Strict
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _Strict
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# -- responses ----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fitserve"
    max_model_len: int | None = None
    # fitserve extras: what a request that omits a sampling field gets, and where it came from
    sampling_defaults: dict[str, float | int] | None = None
    sampling_defaults_source: dict[str, str] | None = None


class ModelList(BaseModel):
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
    "DEFAULTED_FIELDS", "MAX_LOGPROBS", "MAX_MESSAGES", "MAX_N", "MAX_PROMPTS_PER_REQUEST", "MAX_STOP_LENGTH",
    "MAX_STOP_SEQUENCES", "REJECTED_FIELDS", "ChatCompletionRequest", "ChatMessage",
    "CompletionRequest", "ErrorBody", "ModelCard", "ModelList", "StreamOptions", "Usage",
    "chat_body", "completion_chunk",
]
