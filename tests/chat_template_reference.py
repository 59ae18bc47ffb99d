"""Test helper: transformers' apply_chat_template as the independent reference renderer."""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers.models import WordLevel


def hf_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """``messages`` rendered by transformers with ``template`` (no tokenizing)."""
    from transformers import PreTrainedTokenizerFast

    backend = tokenizers.Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text
