"""vLLM's tokenizer routes, POST /tokenize and POST /detokenize: their requests and responses.

``/tokenize`` takes a plain prompt (``prompt``, ``add_special_tokens`` default true, as a
completion encodes it) or a conversation (``messages``, the chat-template fields of
/v1/chat/completions, ``tools``, ``add_special_tokens`` default false); :func:`tokenize_model` tells which.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from fitserve.server.errors import bad_request
from fitserve.server.protocol.chat import ChatMessage, ChatTemplateFields
from fitserve.server.protocol.common import BODY, MAX_MESSAGES, STRICT, NonNegInt
from fitserve.server.protocol.structured import MAX_TOOLS, ToolDefinition

_MODEL = "The served model's id; any other value is a 404. Optional."
_TOKEN_STRS = "Also return each token's string as the vocabulary spells it (`token_strs`)."


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a plain prompt."""

    model_config = STRICT
    model: str | None = Field(None, description=_MODEL)
    prompt: str = Field(description="The text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the model's BOS token if it uses one (as "
                                                       "/v1/completions does).")
    return_token_strs: bool = Field(False, description=_TOKEN_STRS)


class TokenizeChatRequest(ChatTemplateFields):
    """POST /tokenize with a conversation, rendered by the model's chat template."""

    model_config = STRICT
    model: str | None = Field(None, description=_MODEL)
    messages: list[ChatMessage] = Field(description=f"1..{MAX_MESSAGES} messages, as for /v1/chat/completions.",
                                        json_schema_extra={"minItems": 1, "maxItems": MAX_MESSAGES})
    add_special_tokens: bool = Field(False, description="Add BOS on top of the template's own special tokens.")
    tools: list[ToolDefinition] | None = Field(None, description="Tools shown to the model, as with "
                                                                 "/v1/chat/completions and tool_choice auto.",
                                               json_schema_extra={"maxItems": MAX_TOOLS})
    return_token_strs: bool = Field(False, description=_TOKEN_STRS)


class TokenizeResponse(BaseModel):
    model_config = BODY
    count: int = Field(description="The number of tokens.")
    max_model_len: int = Field(description="The server's context length.")
    tokens: list[int]
    token_strs: list[str] | None = Field(description="With return_token_strs: each token as the vocabulary "
                                                     "spells it; else null.")


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = STRICT
    model: str | None = Field(None, description=_MODEL)
    tokens: list[NonNegInt] = Field(description="Token ids, each in [0, vocabulary size).")


class DetokenizeResponse(BaseModel):
    model_config = BODY
    prompt: str = Field(description="The text of the tokens, special tokens included.")


def tokenize_model(data: dict[str, Any]) -> type[TokenizeCompletionRequest] | type[TokenizeChatRequest]:
    """Which /tokenize request a parsed body is: a conversation if it has ``messages``."""
    if "messages" in data and "prompt" in data:
        raise bad_request("send either prompt or messages, not both", "prompt")
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
