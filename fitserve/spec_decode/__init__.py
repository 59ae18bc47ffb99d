"""Speculative decoding: draft proposers and the target's verification step.

``proposer`` (the Proposer protocol, Draft, DraftRequest), ``ngram``, ``draft_model`` and
``eagle`` (its three implementations), ``speculative`` (the engine's side: one proposer, the
counters), ``rejection`` (verification), ``stats`` (vLLM's counters).

``verify`` (rejection sampling, in ``rejection``) needs torch and loads it on first use, so
torch-free proposers in this package can be imported without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fitserve.spec_decode.rejection import verify

__all__ = ["verify"]


def __getattr__(name: str) -> object:
    # NOTE: lazy, like fitserve.sampling, so importing a torch-free proposer stays torch-free.
    if name == "verify":
        from fitserve.spec_decode import rejection

        return rejection.verify
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
