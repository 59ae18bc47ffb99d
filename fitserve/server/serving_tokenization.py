"""vLLM's tokenizer routes with the engine's tokenizer (vLLM's ``serving_tokenization.py``):
the bodies of POST /tokenize and POST /detokenize.

A conversation is rendered exactly as /v1/chat/completions renders it
(``fitserve.server.chat_render``), so ``count`` is the ``usage.prompt_tokens`` a chat completion
of it reports. ``/detokenize`` decodes token ids back to text, special tokens included.
"""

from __future__ import annotations

from typing import Any

from fitserve.server.chat_render import render_chat
from fitserve.server.errors import bad_request
from fitserve.server.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from fitserve.server.serving import ModelContext, check_model
from fitserve.server.tools import shown_tools


def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest, ctx: ModelContext) -> dict[str, Any]:
    """The /tokenize response body."""
    check_model(req.model, ctx)
    if isinstance(req, TokenizeChatRequest):
        tools = shown_tools(req.tools) if req.tools else []
        text = render_chat(ctx.tokenizer, req.messages, tools, req, trusted=ctx.trust_request_chat_template)
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
