"""Sampling: per-request parameters and the batched sampler.

``SamplingParams`` is torch-free and imported eagerly (the scheduler reads it and must not
import torch); ``Sampler`` and ``RequestSamplingState`` load torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    from fitserve.sampling.sampler import RequestSamplingState, Sampler

__all__ = ["RequestSamplingState", "Sampler", "SamplingParams"]


def __getattr__(name: str) -> object:
    # NOTE: lazy so `from fitserve.sampling import SamplingParams` stays torch-free.
    if name in ("Sampler", "RequestSamplingState"):
        from fitserve.sampling import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
