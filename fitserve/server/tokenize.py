"""vLLM's tokenizer routes: POST /tokenize and POST /detokenize, with the engine's tokenizer.

``/tokenize`` takes a plain prompt (``prompt``, ``add_special_tokens`` default true, as a
completion encodes it) or a conversation (``messages``, ``add_generation_prompt`` default
true, ``tools``, ``add_special_tokens`` default false), the latter rendered exactly as
/v1/chat/completions renders it (``fitserve.server.chat_render``), so ``count`` is the
``usage.prompt_tokens`` a chat completion of it reports. ``/detokenize`` decodes token ids
back to text, special tokens included.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fitserve.server.chat_render import render_chat
from fitserve.server.errors import bad_request
from fitserve.server.protocol import MAX_MESSAGES, ChatMessage, NonNegInt
from fitserve.server.protocol_structured import MAX_TOOLS, ToolDefinition
from fitserve.server.serving import ModelContext, check_model
from fitserve.server.tools import shown_tools

_Strict = ConfigDict(strict=True, extra="ignore")
_Body = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)
_MODEL = "The served model's id; any other value is a 404. Optional."
_TOKEN_STRS = "Also return each token's string as the vocabulary spells it (`token_strs`)."


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a plain prompt."""

    model_config = _Strict
    model: str | None = Field(None, description=_MODEL)
    prompt: str = Field(description="The text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the model's BOS token if it uses one (as "
                                                       "/v1/completions does).")
    return_token_strs: bool = Field(False, description=_TOKEN_STRS)


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with a conversation, rendered by the model's chat template."""

    model_config = _Strict
    model: str | None = Field(None, description=_MODEL)
    messages: list[ChatMessage] = Field(description=f"1..{MAX_MESSAGES} messages, as for /v1/chat/completions.",
                                        json_schema_extra={"minItems": 1, "maxItems": MAX_MESSAGES})
    add_generation_prompt: bool = Field(True, description="End with the template's assistant header (what "
                                                          "/v1/chat/completions generates after).")
    add_special_tokens: bool = Field(False, description="Add BOS on top of the template's own special tokens.")
    tools: list[ToolDefinition] | None = Field(None, description="Tools shown to the model, as with "
                                                                 "/v1/chat/completions and tool_choice auto.",
                                               json_schema_extra={"maxItems": MAX_TOOLS})
    return_token_strs: bool = Field(False, description=_TOKEN_STRS)


class TokenizeResponse(BaseModel):
    model_config = _Body
    count: int = Field(description="The number of tokens.")
    max_model_len: int = Field(description="The server's context length.")
    tokens: list[int]
    token_strs: list[str] | None = Field(description="With return_token_strs: each token as the vocabulary "
                                                     "spells it; else null.")


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = _Strict
    model: str | None = Field(None, description=_MODEL)
    tokens: list[NonNegInt] = Field(description="Token ids, each in [0, vocabulary size).")


class DetokenizeResponse(BaseModel):
    model_config = _Body
    prompt: str = Field(description="The text of the tokens, special tokens included.")


def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest, ctx: ModelContext) -> dict[str, Any]:
    """The /tokenize response body."""
    check_model(req.model, ctx)
    if isinstance(req, TokenizeChatRequest):
        tools = shown_tools(req.tools) if req.tools else []
        text = render_chat(ctx.tokenizer, req.messages, tools, add_generation_prompt=req.add_generation_prompt)
    else:
        text = req.prompt
    ids = ctx.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    strs = None
    if req.return_token_strs:
        backend = ctx.tokenizer.backend
        strs = [backend.id_to_token(i) or "" for i in ids]
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                            token_strs=strs).model_dump()


def detokenize(req: DetokenizeRequest, ctx: ModelContext) -> dict[str, Any]:
    """The /detokenize response body; a 400 for a token id outside the vocabulary."""
    check_model(req.model, ctx)
    vocab = min(ctx.vocab_size, ctx.tokenizer.vocab_size)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens must be token ids in [0, {vocab}), got {bad[:5]}", "tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)).model_dump()


def tokenize_model(data: dict[str, Any]) -> type[TokenizeCompletionRequest] | type[TokenizeChatRequest]:
    """Which /tokenize request a parsed body is: a conversation if it has ``messages``."""
    if "messages" in data and "prompt" in data:
        raise bad_request("send either prompt or messages, not both", "prompt")
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


__all__ = ["DetokenizeRequest", "DetokenizeResponse", "TokenizeChatRequest", "TokenizeCompletionRequest",
           "TokenizeResponse", "detokenize", "tokenize", "tokenize_model"]
