"""Pydantic models of structured output and tool calling (OpenAI's shapes, vLLM's extensions).

Request side: ``response_format`` and OpenAI ``tools`` / ``tool_choice``, and the tool calls an
assistant message of the history may carry. Response side: ``message.tool_calls`` and the
``delta.tool_calls`` of a stream chunk. ``protocol.chat`` and ``protocol.common`` use these in their request
and response models; what they mean for generation is in ``fitserve.server.guided_fields``
(structured output) and ``fitserve.server.tools`` (tool calling).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_Strict = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
_Body = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)
_Chunk = ConfigDict(extra="forbid")

MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


# -- response_format ----------------------------------------------------------------------------
class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's wrapper around the schema itself."""

    model_config = _Strict
    name: str | None = Field(None, description="The schema's name (required by OpenAI, optional here).")
    description: str | None = Field(None, description="What the schema is for; not shown to the model.")
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the output must match "
                                                                 "(a JSON object).")
    strict: bool | None = Field(None, description="Accepted: fitserve always enforces the schema exactly.")


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object)
    or ``json_schema`` (the output matches ``json_schema.schema``)."""

    model_config = _Strict
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="Required with (and only allowed "
                                                                    "with) type json_schema.")


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (its newer spelling of the ``guided_*`` fields)."""

    model_config = _Strict
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema (or its text).")
    regex: str | None = Field(None, description="A regular expression the whole output matches.",
                              json_schema_extra={"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]})
    choice: list[str] | None = Field(None, description="The output is exactly one of these.",
                                     json_schema_extra={"anyOf": [
                                         {"type": "array", "minItems": 1,
                                          "items": {"type": "string", "minLength": 1}}, {"type": "null"}]})
    grammar: str | None = Field(None, description="A GBNF or Lark grammar.",
                                json_schema_extra={"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]})
    json_object: bool | None = Field(None, description="true: any JSON object.")


# -- tools (request) ----------------------------------------------------------------------------
class FunctionDefinition(BaseModel):
    model_config = _Strict
    name: str = Field(description="1..64 letters, digits, `_` or `-`.",
                      json_schema_extra={"pattern": TOOL_NAME_PATTERN})
    description: str | None = Field(None, description="Shown to the model with the tool.")
    parameters: dict[str, Any] | None = Field(
        None, description="The arguments, as a JSON schema of an object; omitted: no arguments.")
    strict: bool | None = Field(None, description="Accepted: with tool_choice `required` or a named "
                                                  "function the arguments always match `parameters`.")


class ToolDefinition(BaseModel):
    model_config = _Strict
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _Strict
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: the answer is a call to it."""

    model_config = _Strict
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = _Strict
    name: str
    arguments: str = Field(description="The arguments as JSON text (OpenAI's form).")


class MessageToolCall(BaseModel):
    """A tool call of an assistant message in the history (as a response returned it)."""

    model_config = _Strict
    id: str
    type: Literal["function"]
    function: CalledFunction


# -- tool calls (response) ----------------------------------------------------------------------
class ToolCallFunction(BaseModel):
    model_config = _Body
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(BaseModel):
    model_config = _Body
    id: str = Field(description="`call_` and 24 hex digits; a `tool` message answers it by this id.")
    type: Literal["function"]
    function: ToolCallFunction


class ToolCallDeltaFunction(BaseModel):
    model_config = _Chunk
    name: str
    arguments: str


class ToolCallDelta(BaseModel):
    """One tool call of a stream chunk. fitserve sends each call whole, in one delta, once its
    ``</tool_call>`` has been generated (a client that joins argument pieces gets the same)."""

    model_config = _Chunk
    index: int = Field(description="The call's position among the choice's tool calls.")
    id: str
    type: Literal["function"]
    function: ToolCallDeltaFunction


__all__ = [
    "MAX_TOOLS", "TOOL_NAME_PATTERN", "CalledFunction", "FunctionDefinition", "JsonSchemaFormat",
    "MessageToolCall", "NamedFunction", "StructuredOutputs", "NamedToolChoice", "ResponseFormat", "ToolCall", "ToolCallDelta",
    "ToolCallDeltaFunction", "ToolCallFunction", "ToolChoice", "ToolDefinition",
]
