"""Structured output: the engine's side of constrained decoding (llguidance grammars).

A request's ``SamplingParams.guided`` (:class:`~fitserve.structured.guided.GuidedDecoding`) is
compiled once per (kind, value, tokenizer) by :class:`GrammarCompiler` (``compiler``) into a
grammar whose copies are per-request :class:`GuideState` matchers (``guide``); each step the
sampler masks the logits of the constrained rows with them (``logits``), and the engine
advances each matcher with the token its request kept.

    compiler.py   GuidedDecoding -> CompiledGrammar (checked, cached); ValueError if invalid
    guide.py      GuideState: one request's matcher (fill a bitmask row, advance, fork)
    logits.py     the batched step: logit bias and bitmask -> -inf, only on the rows that ask

``logits`` needs only torch and numpy; ``compiler`` and ``guide`` import llguidance, lazily here
so that importing the sampler does not load the grammar library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitserve.structured.logits import GuidedMasker, apply_logit_bias, apply_token_bitmask

if TYPE_CHECKING:
    from fitserve.structured.compiler import CompiledGrammar, GrammarCompiler
    from fitserve.structured.guide import GuidedDecodingError, GuideState

__all__ = ["CompiledGrammar", "GrammarCompiler", "GuideState", "GuidedDecodingError",
           "GuidedMasker", "apply_logit_bias", "apply_token_bitmask"]

_LAZY = {"CompiledGrammar": "compiler", "GrammarCompiler": "compiler", "GuideState": "guide",
         "GuidedDecodingError": "guide"}


def __getattr__(name: str) -> object:
    # NOTE: PEP 562, so `fitserve.structured.logits` (the sampler's import) stays llguidance-free.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"fitserve.structured.{module}"), name)
