"""Tokenizers for fitserve: a thin wrapper over Hugging Face ``tokenizers`` plus chat templates.

Two sources build a :class:`Tokenizer`: a folder's ``tokenizer.json`` (+ ``tokenizer_config.json``
/ ``chat_template.jinja``), and a GGUF file's vocabulary (byte-level BPE or SentencePiece, see
:mod:`fitserve.loading.gguf_vocab`). :class:`IncrementalDetokenizer` turns a token stream into
text deltas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from fitserve.loading.chat_template import ChatTemplateError, render_chat_template, select_template
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.gguf_vocab import (  # noqa: F401 (re-exported: GGUF vocabularies)
    byte_level_bpe,
    bytes_to_unicode,
)

NO_TEMPLATE_HINT = ("this model has no chat template: give one with --chat-template FILE|TEXT (a Jinja "
                    "file or the template itself), or send a plain prompt to /v1/completions")
_GIL_FREE_ENCODE_CHARS = 8192  # longer texts are encoded without holding the GIL (see encode)


class Tokenizer:
    """Text <-> token ids, special token ids, and the model's chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        added = backend.get_added_tokens_decoder()
        special = {i for i, t in added.items() if t.special}
        special.update(i for i in (bos_token_id, *self.eos_token_ids) if i is not None)
        self.all_special_ids: tuple[int, ...] = tuple(sorted(special))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (the one ``eos_token`` names), if any."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's BOS (if it uses one)."""
        if len(text) > _GIL_FREE_ENCODE_CHARS:
            # NOTE: tokenizers' encode() holds the GIL (~0.7 s for 1 MiB, stalling every other
            # thread, e.g. a server's event loop); encode_batch() releases it. Same ids. Short
            # texts keep encode(): encode_batch() starts tokenizers' thread pool, which makes a
            # later fork() print a warning.
            enc = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        ids = list(enc.ids)
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens dropped when ``skip_special_tokens``."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string as spelled in the vocabulary, or None."""
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
        chat_template: str | None = None, continue_final_message: bool = False, **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text the model was trained on.

        ``chat_template`` (its text) replaces the model's own for this call, as in transformers.
        """
        template = chat_template or self.chat_template
        if not template:
            raise ChatTemplateError(NO_TEMPLATE_HINT)
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    @classmethod
    def from_folder(
        cls, folder: Path, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None
    ) -> Tokenizer:
        """Load ``tokenizer.json`` and the optional ``tokenizer_config.json`` / chat template.

        ``eos_token_ids``/``bos_token_id`` (from config.json) are merged with the tokenizer's own.
        """
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing file (an HF model folder needs tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"{path}: cannot be read as a tokenizer: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        special = {
            k: _token_text(config.get(k))
            for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        template = select_template(config.get("chat_template"))
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        elif template is None and (folder / "chat_template.json").is_file():
            template = select_template(
                _read_json(folder / "chat_template.json").get("chat_template")
            )

        def tid(key: str) -> int | None:
            text = special.get(key)
            return backend.token_to_id(text) if text else None

        eos = [*eos_token_ids, *(i for i in [tid("eos_token")] if i is not None)]
        bos = bos_token_id if bos_token_id is not None else tid("bos_token")
        add_bos = config.get("add_bos_token")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            chat_template=template,
            add_bos_token=None if add_bos is None else bool(add_bos),
            special_tokens=special,
        )


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time.

    Like vLLM's detokenizer it decodes a short window (a few tokens of context before the
    unread ones) rather than the whole output, and holds back text that ends in U+FFFD: a
    multi-byte UTF-8 character split across tokens comes out whole once its last byte arrives.
    """

    _CONTEXT = 5  # tokens of already-emitted context decoded with the new ones

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._prefix = max(len(self._ids) - self._CONTEXT, 0)
        self._read = len(self._ids)
        self._pieces: list[str] = []  # NOTE: joined on demand; `str +=` on an attribute copies

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned)."""
        return "".join(self._pieces)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def finish(self) -> str:
        """Flush held-back text at the end of a stream and return it.

        What is held back is text ending in U+FFFD: a character whose last bytes never came
        (the request stopped inside it) or a genuinely invalid byte sequence. It comes out as
        the tokenizer decodes it, so the stream's text equals ``decode(all output ids)``.
        Calling it again returns "".
        """
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        dec = self.tokenizer.decode
        before = dec(self._ids[self._prefix : self._read], self.skip_special_tokens)
        now = dec(self._ids[self._prefix :], self.skip_special_tokens)
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        delta = now[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._pieces.append(delta)
        return delta
