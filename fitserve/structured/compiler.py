"""GuidedDecoding -> a compiled llguidance grammar, checked once and cached.

A request's :class:`~fitserve.structured.guided.GuidedDecoding` is turned into llguidance's
grammar text (:func:`grammar_text`), then into a *template* ``LLMatcher`` bound to the engine's
tokenizer. Every request gets a ``deep_copy`` of the template (~20 us) instead of building its
own matcher (~1.5 ms, far more for a large schema), and copies share the template's lazily built
lexer, which the compiler warms with one mask so no request pays for it.

A problem with the grammar (a schema that is not JSON or not a schema, a regex with
look-arounds, a GBNF rule that is never defined) is a ``ValueError`` naming the kind and
llguidance's message: the engine raises it from ``add_request`` before anything is queued, and
the server turns it into a 400.
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance

from fitserve.loading.tokenizer import Tokenizer
from fitserve.structured.guide import GuideState
from fitserve.structured.guided import GuidedDecoding

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# NOTE: json.dumps' separators and no free whitespace: llguidance's default lets a model
# insert any whitespace between tokens, and small models then loop on newlines until
# max_tokens. A schema may still ask for more through llguidance's "x-guidance" key.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                     "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'
DEFAULT_CACHE_SIZE = 128


def grammar_text(guided: GuidedDecoding) -> str:
    """llguidance's grammar for ``guided``; ``ValueError`` if its value cannot be one.

    This checks the *form* (JSON where JSON is due, a list of strings for ``choice``); whether
    the grammar is valid is checked by building a matcher (:meth:`GrammarCompiler.compile`).
    """
    kind, value = guided.kind, guided.value
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"guided json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"guided json_schema must be a JSON object, got {type(schema).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise ValueError(f"invalid guided json_schema: {exc}") from None
    if kind == "choice":
        try:
            choices = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"guided choice must be a JSON list of strings: {exc}") from None
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) for c in choices)):
            raise ValueError(f"guided choice must be a non-empty JSON list of strings, got {value!r}")
        # a Lark alternation of JSON-quoted literals (what llguidance's grammar_from builds)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "regex":
        return _from("regex", value)
    if kind == "grammar":
        return _from("grammar", value)  # GBNF (llama.cpp) or Lark: llguidance tells them apart
    raise ValueError(f"unknown guided decoding kind {kind!r}")  # GuidedDecoding checked it


def _from(fmt: str, text: str) -> str:
    try:
        return llguidance.grammar_from(fmt, text)  # type: ignore[arg-type]
    except ValueError as exc:  # e.g. "Failed to convert the grammar from GBNF to Lark: ..."
        raise ValueError(f"invalid guided {fmt}: {exc}") from None


@dataclass(slots=True)
class CompiledGrammar:
    """A checked grammar bound to one tokenizer; :meth:`new_state` starts a request on it."""

    guided: GuidedDecoding
    template: llguidance.LLMatcher
    vocab_size: int  # width of the bitmask (the LLTokenizer's vocabulary)

    def new_state(self) -> GuideState:
        """A fresh matcher at the start of the grammar, for one request (or one n>1 child)."""
        return GuideState(self.template.deep_copy(), self.vocab_size)


class GrammarCompiler:
    """Compiles GuidedDecoding values for tokenizers, with an LRU cache of compiled grammars.

    One ``LLTokenizer`` per (tokenizer, vocabulary width) is built on first use (~0.4 s for a
    49k vocabulary) and kept while the tokenizer lives. Compiled grammars are cached by
    (kind, value, tokenizer): a service sees the same few schemas over and over.
    """

    def __init__(self, max_entries: int = DEFAULT_CACHE_SIZE) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._tokenizers: weakref.WeakKeyDictionary[Tokenizer, dict[int, llguidance.LLTokenizer]] = (
            weakref.WeakKeyDictionary())
        self._cache: OrderedDict[tuple[str, str, int], CompiledGrammar] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    def lltokenizer(self, tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
        """The llguidance view of ``tokenizer`` with ``vocab_size`` logits (built once)."""
        per_width = self._tokenizers.setdefault(tokenizer, {})
        lltok = per_width.get(vocab_size)
        if lltok is None:
            # NOTE: a model may pad its logits past the tokenizer's vocabulary; those ids are
            # then never allowed. A smaller width than the tokenizer's is left to llguidance
            # (it keeps its own), and the mask is cut to the logits (fitserve.structured.logits).
            n_vocab = vocab_size if vocab_size >= tokenizer.vocab_size else None
            lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab,
                                           eos_token=list(tokenizer.eos_token_ids) or None)
            per_width[vocab_size] = lltok
        return lltok

    def compile(self, guided: GuidedDecoding, tokenizer: Tokenizer, vocab_size: int) -> CompiledGrammar:
        """The compiled grammar of ``guided`` (cached); ``ValueError`` naming the problem."""
        lltok = self.lltokenizer(tokenizer, vocab_size)
        value = "" if guided.kind == "json_object" else guided.value
        # id(lltok) is stable: the entry holds its template, which holds the LLTokenizer alive
        key = (guided.kind, value, id(lltok))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        compiled = _build(guided, lltok)
        self._cache[key] = compiled
        if len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return compiled


def _build(guided: GuidedDecoding, lltok: llguidance.LLTokenizer) -> CompiledGrammar:
    text = grammar_text(guided)
    # NOTE: LLMatcher never raises for a bad grammar; it starts in an error state instead.
    template = llguidance.LLMatcher(lltok, text, log_level=0)
    if template.is_error():
        raise ValueError(f"invalid guided {guided.kind}: {_first_lines(template.get_error())}")
    compiled = CompiledGrammar(guided, template, lltok.vocab_size)
    # Warm the lexer the copies will share (the first mask of a grammar costs ~10x a later one).
    template.compute_bitmask()
    if template.is_error():
        raise ValueError(f"invalid guided {guided.kind}: {_first_lines(template.get_error())}")
    return compiled


def _first_lines(message: str, limit: int = 6) -> str:
    """llguidance's message without its long source excerpt: the first few lines, joined."""
    lines = [ln.rstrip() for ln in message.strip().splitlines() if ln.strip()]
    return " | ".join(lines[:limit])
