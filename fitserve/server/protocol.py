"""Pydantic models of the OpenAI HTTP API subset fitserve serves, and the limits it enforces.

Requests are validated in strict mode straight from the JSON bytes, so ``"max_tokens": "5"`` or
``"n": 1.5`` is a 400, not a silent coercion. Unknown fields are ignored (clients send things
like ``metadata``), except the ones listed in :data:`REJECTED_FIELDS`: a chat template is code,
and the server never runs a template a client sent; the others are features fitserve does not
have. Every field a model declares has an effect (or is checked and refused): none is accepted
and dropped. ``user`` (OpenAI's end-user id) goes into the server's debug log of the request.

Sampling fields default to ``None`` so that "omitted" and "given" differ: an omitted
temperature/top_p/top_k/min_p/repetition_penalty is filled by :meth:`with_defaults` from the
defaults the server put in force (the model's recommended ones, else the server's; see
``fitserve.loading.generation_defaults``), a given one is kept as sent.

The field descriptions, and the bounds the server enforces (stated in the JSON schema only, see
:func:`_doc`), make up the request schemas of the OpenAPI document (``fitserve.server.openapi``);
the response models (``fitserve.server.protocol_responses``, re-exported here) are its response
schemas; the structured-output and tool models are in ``fitserve.server.protocol_structured``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from fitserve.sampling.params import MAX_LOGPROBS
from fitserve.server.protocol_responses import (  # re-exported (see __all__)
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    ErrorBody,
    ErrorResponse,
    FinishReasonName,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    StopReason,
    TokenLogprob,
    TopLogprob,
    Usage,
    chat_body,
    completion_chunk,
)
from fitserve.server.protocol_structured import (
    MAX_TOOLS,
    MessageToolCall,
    ResponseFormat,
    StructuredOutputs,
    ToolChoice,
    ToolDefinition,
)

MAX_N = 16  # children per request: each one holds KV blocks, so n is a memory multiplier
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
MAX_PROMPTS_PER_REQUEST = 64
MAX_MESSAGES = 512
MAX_STOP_TOKEN_IDS = 64  # serving.py's limit (it has its own constant), stated in the OpenAPI document

# Fields a client may not set. Chat-template knobs run server-side Jinja; the others are
# features fitserve does not have, and silently ignoring them would change results.
REJECTED_FIELDS: dict[str, str] = {
    "chat_template": "client-supplied chat templates are not accepted",
    "chat_template_kwargs": "client-supplied chat template arguments are not accepted",
    "add_generation_prompt": "client-supplied chat template arguments are not accepted",
    "continue_final_message": "client-supplied chat template arguments are not accepted",
    "documents": "client-supplied chat template arguments are not accepted",
    "functions": "the legacy `functions` field is not supported: use `tools`",
    "function_call": "the legacy `function_call` field is not supported: use `tool_choice`",
    "suffix": "suffix (text after the completion, for insertion) is not supported",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (JSON output is compact)",
}
# Tokenizer routes (/tokenize) take vLLM's add_generation_prompt: only the template's code is refused.
TOKENIZE_REJECTED_FIELDS: dict[str, str] = {
    k: v for k, v in REJECTED_FIELDS.items() if k not in ("add_generation_prompt", "suffix")}
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias

# Request fields an omitted value of which takes the server's default (not SamplingParams').
DEFAULTED_FIELDS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

_Strict = ConfigDict(strict=True, extra="ignore")
NonNegInt = Annotated[int, Field(ge=0)]
StopField = str | list[str] | None


def _doc(default: Any, description: str, **by_type: dict[str, Any]) -> Any:
    """A field with a description and bounds that exist in its JSON schema only.

    ``by_type`` maps a JSON type ("integer", "number", "string", "array") to the keywords that
    go into the non-null branch of that type (an ``"items"`` or ``"additionalProperties"`` entry is
    merged into the one pydantic wrote). Validation does not change: the server checks these bounds itself (``serving.py``,
    ``SamplingParams``), with its own messages; the schema only says what it will accept, for
    the OpenAPI document (``fitserve.server.openapi``) and for clients.
    """

    def extra(schema: dict[str, Any]) -> None:
        branches = [b for b in schema.get("anyOf", [schema]) if b.get("type") != "null"]
        for b in branches:
            for key, value in by_type.get(b.get("type", ""), {}).items():
                if key in ("items", "additionalProperties") and isinstance(b.get(key, {}), dict):
                    b.setdefault(key, {}).update(value)
                else:
                    b[key] = value

    return Field(default, description=description, json_schema_extra=extra)


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


class StreamOptions(BaseModel):
    model_config = _Strict
    include_usage: bool = Field(False, description="Send a last chunk with `usage` (and no choices) "
                                                   "before `data: [DONE]`.")


class _SamplingFields(BaseModel):
    """Sampling fields common to both endpoints; ranges are checked by SamplingParams."""

    model_config = _Strict

    model: str | None = _doc(None, "The served model's id (see GET /v1/models); any other value is a 404. "
                                   "Optional in fitserve (required by OpenAI).")
    n: int = _doc(1, f"Choices to generate for each prompt, 1..{MAX_N} (OpenAI allows up to 128). "
                     "With `use_beam_search` it is the beam width: the n best beams are returned.",
                  integer={"minimum": 1, "maximum": MAX_N})
    temperature: float | None = _doc(None, "Sampling temperature >= 0 (0 is greedy); unlike OpenAI no upper "
                                           "bound of 2. Omitted: the server's default (the model's recommended "
                                           "one, else 1; see `sampling_defaults` in GET /v1/models).",
                                     number={"minimum": 0})
    top_p: float | None = _doc(None, "Nucleus sampling mass, in (0, 1]. Omitted: the server's default.",
                               number={"exclusiveMinimum": 0, "maximum": 1})
    top_k: int | None = _doc(None, "vLLM extension (not OpenAI): sample from the k most likely tokens; 0 or -1 "
                                   "disable it. Omitted: the server's default.", integer={"minimum": -1})
    min_p: float | None = _doc(None, "vLLM extension (not OpenAI): drop tokens less likely than min_p times the "
                                     "most likely one, in [0, 1]. Omitted: the server's default.",
                               number={"minimum": 0, "maximum": 1})
    presence_penalty: float | None = _doc(None, "OpenAI's presence penalty, in [-2, 2]; default 0.",
                                          number={"minimum": -2, "maximum": 2})
    frequency_penalty: float | None = _doc(None, "OpenAI's frequency penalty, in [-2, 2]; default 0.",
                                           number={"minimum": -2, "maximum": 2})
    repetition_penalty: float | None = _doc(None, "vLLM extension (not OpenAI): multiplicative penalty on tokens "
                                                  "already seen, > 0 (1 is none). Omitted: the server's default.",
                                            number={"exclusiveMinimum": 0})
    seed: int | None = _doc(None, "Seed of the request's own random stream (any integer, taken modulo 2**64); "
                                  "choice j uses seed + j.")
    stop: StopField = _doc(None, f"Up to {MAX_STOP_SEQUENCES} stop strings (OpenAI allows 4) of 1.."
                                 f"{MAX_STOP_LENGTH} characters; the text stops before the first one.",
                           string={"minLength": 1, "maxLength": MAX_STOP_LENGTH},
                           array={"maxItems": MAX_STOP_SEQUENCES,
                                  "items": {"minLength": 1, "maxLength": MAX_STOP_LENGTH}})
    stop_token_ids: list[NonNegInt] | None = _doc(None, f"vLLM extension (not OpenAI): up to {MAX_STOP_TOKEN_IDS} "
                                                        "token ids that end the text (kept out of it).",
                                                  array={"maxItems": MAX_STOP_TOKEN_IDS})
    ignore_eos: bool = _doc(False, "vLLM extension (not OpenAI): keep generating past the end-of-sequence token.")
    skip_special_tokens: bool = _doc(True, "vLLM extension (not OpenAI): leave special tokens out of the text.")
    include_stop_str_in_output: bool = _doc(False, "vLLM extension (not OpenAI): keep the matched stop string "
                                                   "at the end of the text.")
    stream: bool = _doc(False, "Stream the result as server-sent events (text/event-stream), one chunk per "
                               "new piece of text, ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = _doc(None, "Only allowed when `stream` is true (else a 400).")
    user: str | None = _doc(None, "OpenAI's end-user id: written to the server's debug log of the request "
                                  "(with --log-level debug); it changes nothing else.")
    logit_bias: dict[str, float] | None = _doc(
        None, f"OpenAI's: token id (as a string) -> a bias in [-100, 100] added to its logit before sampling "
              f"(-100 bans it, 100 all but forces it); ids in [0, vocabulary size), at most {MAX_LOGIT_BIAS}.",
        object={"propertyNames": {"pattern": "^(0|[1-9][0-9]{0,8})$"},
                "additionalProperties": {"minimum": -100, "maximum": 100},
                "maxProperties": MAX_LOGIT_BIAS})
    # structured output: at most one of these (a 400 otherwise)
    response_format: ResponseFormat | None = _doc(
        None, "OpenAI's: `text` (no constraint), `json_object` (the output is a JSON object) or `json_schema` "
              "(it matches `json_schema.schema`). At most one of this and the guided_* fields.")
    guided_json: dict[str, Any] | str | None = _doc(
        None, "vLLM extension (not OpenAI): the output matches this JSON schema (an object, or its JSON text).")
    guided_regex: str | None = _doc(None, "vLLM extension (not OpenAI): the whole output matches this regular "
                                          "expression (Rust regex syntax: no look-arounds or backreferences).",
                                    string={"minLength": 1})
    guided_choice: list[str] | None = _doc(None, "vLLM extension (not OpenAI): the output is exactly one of "
                                                 "these strings (non-empty, at least one).",
                                           array={"minItems": 1, "items": {"minLength": 1}})
    guided_grammar: str | None = _doc(None, "vLLM extension (not OpenAI): the output matches this context-free "
                                            "grammar, GBNF (llama.cpp's) or Lark (llguidance's syntax).",
                                      string={"minLength": 1})
    structured_outputs: StructuredOutputs | None = _doc(
        None, "vLLM extension (its newer form of the guided_* fields): exactly one of json, regex, choice, "
              "grammar, json_object.")
    # vLLM's extension: beam search with n beams returned (``n`` is the beam width)
    use_beam_search: bool = _doc(False, "vLLM extension (not OpenAI): beam search of width `n`, the beams "
                                        "returned as choices, best first. Not with `stream`, `logprobs`, `stop` "
                                        "or `stop_token_ids` (a 400).")
    length_penalty: float = _doc(1.0, "vLLM extension (not OpenAI): beam search only, beams are ranked by "
                                      "cumulative logprob / length**length_penalty.")
    # vLLM's: lower runs first (needs --scheduling-policy priority; any other value is a 400)
    priority: int = _doc(0, "vLLM extension (not OpenAI): lower runs first. Needs a server started with "
                            "--scheduling-policy priority; elsewhere any value but 0 is a 400.")
    # fitserve's: this request's own targets under --scheduling-policy slo (ms, > 0)
    slo_ttft_ms: float | None = _doc(None, "fitserve extension: this request's time-to-first-token target in "
                                           "ms (> 0), replacing the server's under --scheduling-policy slo "
                                           "(which may answer 429 when it predicts a miss).",
                                     number={"exclusiveMinimum": 0})
    slo_tpot_ms: float | None = _doc(None, "fitserve extension: this request's time-per-output-token target "
                                           "in ms (> 0), under --scheduling-policy slo.",
                                     number={"exclusiveMinimum": 0})

    def with_defaults(self, defaults: Mapping[str, float | int]) -> Self:
        """A copy whose omitted (None) fields among DEFAULTED_FIELDS take ``defaults``' values."""
        fill = {k: v for k, v in defaults.items() if k in DEFAULTED_FIELDS and getattr(self, k) is None}
        return self.model_copy(update=fill) if fill else self


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="A string, token ids, or a batch of either (at most "
                    f"{MAX_PROMPTS_PER_REQUEST} prompts; choice i*n + j is sample j of prompt i). Token ids "
                    "must be in [0, vocabulary size); no prompt may be empty or fill the context.",
        json_schema_extra=_prompt_schema)
    max_tokens: int | None = _doc(16, "Most tokens to generate, >= 1 (default 16, as OpenAI); null: up to the "
                                      "context length. Prompt + max_tokens over the context length is a 400.",
                                  integer={"minimum": 1})
    logprobs: int | None = _doc(None, f"Return the chosen tokens' logprobs and the top-N alternatives, N in "
                                      f"0..{MAX_LOGPROBS} (OpenAI allows 5).",
                                integer={"minimum": 0, "maximum": MAX_LOGPROBS})
    echo: bool = _doc(False, "Prepend the prompt's text to each choice's text (a token-id prompt is decoded). "
                             "Not with `logprobs` (fitserve computes no prompt logprobs: a 400).")
    best_of: int | None = _doc(None, "Not supported beyond OpenAI's default: absent, null or equal to `n`.")


class TextPart(BaseModel):
    model_config = _Strict
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _Strict
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="`developer` is treated as `system`; a `tool` message (with `tool_call_id`) carries a "
                    "tool's result.")
    content: str | list[TextPart] | None = _doc(None, "Text, or text parts (joined); null is empty.")
    name: str | None = _doc(None, "Passed to the chat template with the message (as transformers does); "
                                  "most templates do not show it.")
    tool_calls: list[MessageToolCall] | None = _doc(None, "An assistant message's tool calls (as a response "
                                                          "returned them).")
    tool_call_id: str | None = _doc(None, "Required in (and only allowed in) a `tool` message: the call it "
                                          "answers.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(
        description=f"The conversation, 1..{MAX_MESSAGES} messages, rendered with the model's own chat "
                    "template (a client cannot send one).",
        json_schema_extra={"minItems": 1, "maxItems": MAX_MESSAGES})
    max_tokens: int | None = _doc(None, "Deprecated by OpenAI in favour of `max_completion_tokens` (which wins "
                                        "when both are given); >= 1, null: up to the context length.",
                                  integer={"minimum": 1})
    max_completion_tokens: int | None = _doc(None, "Most tokens to generate, >= 1; null: up to the context "
                                                   "length. Prompt + max_completion_tokens over the context "
                                                   "length is a 400.", integer={"minimum": 1})
    logprobs: bool = _doc(False, "Return the logprob of each chosen token (in `choices[].logprobs.content`).")
    top_logprobs: int | None = _doc(None, f"Alternatives per token, 0..{MAX_LOGPROBS}; needs `logprobs: true`.",
                                    integer={"minimum": 0, "maximum": MAX_LOGPROBS})
    tools: list[ToolDefinition] | None = _doc(
        None, f"OpenAI's: up to {MAX_TOOLS} functions the model may call, shown to it through its chat template "
              "(or, if the template has no place for tools, in the system message, Hermes style).",
        array={"maxItems": MAX_TOOLS})
    tool_choice: ToolChoice | None = _doc(
        None, "`none` (no tools shown), `auto` (the default with tools: the model decides), `required` (at least "
              "one call) or a named function (a call to it); `required` and a named function are enforced by a "
              "grammar, so their calls always parse. `required` or a named function need `tools`.")
    parallel_tool_calls: bool | None = _doc(
        None, "OpenAI's: false: at most one tool call per choice. `required` makes exactly one call unless this "
              "is true (then up to 8); `auto` parses as many as the model makes unless this is false.")


__all__ = [
    "DEFAULTED_FIELDS", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_MESSAGES", "MAX_N", "MAX_PROMPTS_PER_REQUEST",
    "MAX_STOP_LENGTH", "MAX_STOP_SEQUENCES", "MAX_STOP_TOKEN_IDS", "REJECTED_FIELDS", "TOKENIZE_REJECTED_FIELDS",
    "AssistantMessage", "ChatChoice", "ChatChunkChoice", "ChatCompletion", "ChatCompletionChunk",
    "ChatCompletionRequest", "ChatDelta", "ChatLogprobs", "ChatMessage", "Completion", "CompletionChoice",
    "CompletionChunk", "CompletionChunkChoice", "CompletionLogprobs", "CompletionRequest", "ErrorBody",
    "ErrorResponse", "FinishReasonName", "ModelCard", "ModelList", "NonNegInt", "PromptTokensDetails", "StopReason",
    "StreamOptions", "TextPart", "TokenLogprob", "TopLogprob", "Usage", "chat_body", "completion_chunk",
]
