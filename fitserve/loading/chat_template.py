"""Chat templates rendered in jinja2's immutable sandbox, with Hugging Face's helpers.

Templates come from model files (untrusted), so they run in
:class:`jinja2.sandbox.ImmutableSandboxedEnvironment` with the globals transformers exposes:
``raise_exception``, ``strftime_now`` and a ``tojson`` filter that does not HTML-escape.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing, malformed, or raised an error while rendering."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from exc


def template_globals() -> frozenset[str]:
    """The names every template sees without being given them (``range``, ``raise_exception``...)."""
    return frozenset(_environment().globals)


@lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """The names a template reads from its context (``messages``, ``tools``, ``bos_token``...).

    A template that never reads ``tools`` has no place for tool definitions: a caller then has
    to show them some other way (the server puts them in the system message).
    """
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from exc


# NOTE: vLLM's rule for --chat-template: a value that cannot be opened as a file is the template's
# text if it has one of these characters, else a mistyped path (an error, not a one-line template).
_TEMPLATE_CHARS = "{}\n"


def check_chat_template(source: str) -> str:
    """``source`` if it compiles as a chat template, else a :class:`ChatTemplateError`."""
    _compile(source)
    return source


def load_chat_template(value: str) -> str:
    """The template text ``--chat-template`` names: a file's contents, or ``value`` itself.

    As in vLLM: a path that opens is read; otherwise a value with ``{``, ``}`` or a newline is
    the template itself (its backslash escapes such as ``\\n`` decoded, so a shell can pass
    one line), and anything else is a path that does not exist (an error saying so). The
    template must compile.
    """
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except (OSError, ValueError) as exc:
        if not any(c in value for c in _TEMPLATE_CHARS):
            raise ChatTemplateError(f"{value!r} looks like a file path, but it cannot be read ({exc}); "
                                    "give a Jinja file or the template text itself") from None
        # NOTE: backslashreplace keeps non-ASCII text intact through unicode_escape.
        text = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    return check_chat_template(text)


def select_template(template: str | list[Any] | None, name: str = "default") -> str | None:
    """Pick one template from ``tokenizer_config.json``'s string or list-of-named-templates form."""
    if template is None or isinstance(template, str):
        return template
    named = {t["name"]: t["template"] for t in template if isinstance(t, Mapping)}
    return named.get(name) or next(iter(named.values()), None)


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    special_tokens: Mapping[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with ``template`` the way transformers' ``apply_chat_template`` does.

    ``special_tokens`` (``bos_token``, ``eos_token``...) are visible to the template, as are any
    extra ``kwargs`` (``tools``, ``documents``, ``enable_thinking``...). With
    ``continue_final_message`` the text ends where the last message's content ends (no
    end-of-turn token after it), for the model to continue it.
    """
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true: "
                                "one continues the last message, the other starts a new assistant turn")
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages must be dicts, got {message!r}")
    chat = [dict(m) for m in messages]
    if continue_final_message:
        _tag_final_message(chat)
    context: dict[str, Any] = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    context.update(kwargs)
    try:
        text = _compile(template).render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    return _cut_at_tag(text) if continue_final_message else text


# NOTE: transformers' way to find where the last message ends: render it with this tag appended
# and cut there (a template that trims the message also trims the space before the tag).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(chat: list[dict[str, Any]]) -> None:
    """Append the tag to the last message's text (its last text part, for a list of parts)."""
    if not chat:
        raise ChatTemplateError("continue_final_message needs at least one message")
    final = chat[-1].get("content")
    if isinstance(final, str):
        chat[-1]["content"] = final + _CONTINUE_TAG
        return
    parts = [dict(p) for p in final] if isinstance(final, (list, tuple)) else []
    for part in reversed(parts):
        if isinstance(part.get("text"), str):
            part["text"] += _CONTINUE_TAG
            chat[-1]["content"] = parts
            return
    raise ChatTemplateError("continue_final_message needs text in the last message to continue")


def _cut_at_tag(text: str) -> str:
    """``text`` up to where the last message's text ended."""
    tag = _CONTINUE_TAG.strip()
    if tag not in text:
        raise ChatTemplateError("continue_final_message: the chat template does not show the last message's "
                                "content, so there is nothing to continue")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
