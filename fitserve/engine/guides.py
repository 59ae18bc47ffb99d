"""The engine's checks and per-request states for structured output, at add_request.

Everything here runs before a request is queued, so a bad grammar or bias is a ValueError
and nothing is kept (no blocks, no scheduler entry).
"""

from __future__ import annotations

from collections.abc import Sequence

from fitserve.loading.tokenizer import Tokenizer
from fitserve.sampling.params import SamplingParams
from fitserve.structured.compiler import GrammarCompiler
from fitserve.structured.guide import GuideState


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """``ValueError`` if a logit_bias token id is outside the model's vocabulary."""
    bad = sorted(t for t in (params.logit_bias or {}) if t >= vocab_size)
    if bad:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {bad[:5]}")


def guide_states(compiler: GrammarCompiler, params: Sequence[SamplingParams], tokenizer: Tokenizer,
                 vocab_size: int) -> list[GuideState | None]:
    """One grammar state per request (None: unconstrained), each its own matcher, so n>1
    siblings go their own ways; ``ValueError`` naming the problem for an invalid grammar."""
    states: list[GuideState | None] = []
    for p in params:
        check_logit_bias(p, vocab_size)
        states.append(None if p.guided is None
                      else compiler.compile(p.guided, tokenizer, vocab_size).new_state())
    return states

