"""POST /v1/chat/completions: the request and its messages, the response, and the chunks of
its stream. The structured-output and tool models they use are in ``protocol.structured``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fitserve.sampling.params import MAX_LOGPROBS
from fitserve.server.protocol.common import (
    BODY,
    CHUNK,
    MAX_MESSAGES,
    STRICT,
    FinishReasonName,
    SamplingFields,
    StopReason,
    Usage,
    absent_or_value,
    desc,
)
from fitserve.server.protocol.completions import PromptLogprobs
from fitserve.server.protocol.structured import (
    MAX_TOOLS,
    MessageToolCall,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolDefinition,
)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="`developer` is treated as `system`; a `tool` message (with `tool_call_id`) carries a "
                    "tool's result.")
    content: str | list[TextPart] | None = desc(None, "Text, or text parts (joined); null is empty.")
    name: str | None = desc(None, "Passed to the chat template with the message (as transformers does); "
                                  "most templates do not show it.")
    tool_calls: list[MessageToolCall] | None = desc(None, "An assistant message's tool calls (as a response "
                                                          "returned them).")
    tool_call_id: str | None = desc(None, "Required in (and only allowed in) a `tool` message: the call it "
                                          "answers.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatTemplateFields(BaseModel):
    """vLLM's chat-template fields, shared by /v1/chat/completions and /tokenize."""

    model_config = STRICT
    chat_template: str | None = desc(
        None, "vLLM extension: a Jinja chat template used instead of the server's for this request. Refused "
              "(400) unless the server was started with --trust-request-chat-template.")
    chat_template_kwargs: dict[str, Any] | None = desc(
        None, "vLLM extension: more variables for the chat template (e.g. Qwen3's `enable_thinking`). A name "
              "the template never reads, or one the server sets itself (`messages`, `tools`...), is a 400.")
    add_generation_prompt: bool | None = desc(
        None, "vLLM extension: end the prompt with the template's assistant header. Omitted: true, or false "
              "with `continue_final_message`.")
    continue_final_message: bool = desc(
        False, "vLLM extension: end the prompt where the last message's text ends (no end-of-turn), so the "
               "model continues that message. Cannot be combined with `add_generation_prompt: true`.")


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(
        description=f"The conversation, 1..{MAX_MESSAGES} messages, rendered with the server's chat "
                    "template (the model's own, or --chat-template).",
        json_schema_extra={"minItems": 1, "maxItems": MAX_MESSAGES})
    max_tokens: int | None = desc(None, "Deprecated by OpenAI in favour of `max_completion_tokens` (which wins "
                                        "when both are given); >= 1, null: up to the context length.",
                                  integer={"minimum": 1})
    max_completion_tokens: int | None = desc(None, "Most tokens to generate, >= 1; null: up to the context "
                                                   "length. Prompt + max_completion_tokens over the context "
                                                   "length is a 400.", integer={"minimum": 1})
    logprobs: bool = desc(False, "Return the logprob of each chosen token (in `choices[].logprobs.content`).")
    top_logprobs: int | None = desc(None, f"Alternatives per token, 0..{MAX_LOGPROBS}; needs `logprobs: true`.",
                                    integer={"minimum": 0, "maximum": MAX_LOGPROBS})
    prompt_logprobs: int | None = desc(None, f"vLLM extension (not OpenAI): return `prompt_logprobs` (top level), "
                                             f"each prompt token's logprob with the top-N, N in 0..{MAX_LOGPROBS}. "
                                             "Not with `stream` (a 400).",
                                       integer={"minimum": 0, "maximum": MAX_LOGPROBS})
    tools: list[ToolDefinition] | None = desc(
        None, f"OpenAI's: up to {MAX_TOOLS} functions the model may call, shown to it through its chat template "
              "(or, if the template has no place for tools, in the system message, Hermes style).",
        array={"maxItems": MAX_TOOLS})
    tool_choice: ToolChoice | None = desc(
        None, "`none` (no tools shown), `auto` (the default with tools: the model decides), `required` (at least "
              "one call) or a named function (a call to it); `required` and a named function are enforced by a "
              "grammar, so their calls always parse. `required` or a named function need `tools`.")
    add_special_tokens: bool = desc(False, "vLLM extension (not OpenAI): add BOS on top of the chat template's "
                                           "own special tokens.")
    parallel_tool_calls: bool | None = desc(
        None, "OpenAI's: false: at most one tool call per choice. `required` makes exactly one call unless this "
              "is true (then up to 8); `auto` parses as many as the model makes unless this is false.")


class TopLogprob(BaseModel):
    model_config = BODY
    token: str
    logprob: float
    bytes: list[int] = Field(description="The token's UTF-8 bytes.")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    model_config = BODY
    content: list[TokenLogprob]


def _reasoning_keys_optional(schema: dict[str, Any]) -> None:
    """The reasoning keys are there only with --reasoning-parser."""
    schema["required"] = [k for k in schema.get("required", []) if k not in ("reasoning_content", "reasoning")]


class AssistantMessage(BaseModel):
    model_config = ConfigDict(**BODY, json_schema_extra=_reasoning_keys_optional)
    role: Literal["assistant"]
    content: str | None = Field(description="The text; null when the choice is only tool calls.")
    tool_calls: list[ToolCall] = Field(description="The tool calls the model made (empty: none).")
    reasoning_content: str | None = Field(None, description="vLLM extension, with --reasoning-parser only: the "
                                                            "think block's text (null: the output had none).")
    reasoning: str | None = Field(None, description="The same as reasoning_content (current vLLM's name).")


class ChatChoice(BaseModel):
    model_config = BODY
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName | None
    stop_reason: StopReason = Field(description="vLLM extension: the stop string or stop token id that "
                                                "ended the choice.")


class ChatCompletion(BaseModel):
    """A POST /v1/chat/completions response (stream=false)."""

    model_config = BODY
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs = Field(description="vLLM extension: with `prompt_logprobs` set "
                                                        "(the rendered prompt's tokens).")


class ChatDelta(BaseModel):
    model_config = CHUNK
    role: Literal["assistant"] | None = Field(None, description="Only in the first chunk.",
                                              json_schema_extra=absent_or_value)
    content: str | None = Field(None, description="The new text; left out of a chunk that only finishes.",
                                json_schema_extra=absent_or_value)
    tool_calls: list[ToolCallDelta] | None = Field(None, description="Tool calls completed since the last chunk, "
                                                                     "each whole.",
                                                   json_schema_extra=absent_or_value)
    reasoning_content: str | None = Field(None, description="vLLM extension, with --reasoning-parser: new text of "
                                                            "the think block.", json_schema_extra=absent_or_value)
    reasoning: str | None = Field(None, description="The same as reasoning_content (current vLLM's name).",
                                  json_schema_extra=absent_or_value)


class ChatChunkChoice(BaseModel):
    model_config = CHUNK
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName | None
    stop_reason: StopReason = Field(None, description="Only in the choice's last chunk.")


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed POST /v1/chat/completions."""

    model_config = CHUNK
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="Only in the last chunk (with no choices), when "
                                                  "stream_options.include_usage is true.",
                                json_schema_extra=absent_or_value)


def chat_body(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], *, chunk: bool,
    usage: Usage | None = None, prompt_logprobs: list[Any] | None = None,
) -> dict[str, Any]:
    """A /v1/chat/completions response (``chunk=False``) or stream chunk (``chunk=True``)."""
    body: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": created, "model": model, "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage.model_dump()
    if not chunk:
        body["prompt_logprobs"] = prompt_logprobs
    return body
