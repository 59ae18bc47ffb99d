"""What the HTTP side hands the engine thread (:class:`~fitserve.server.engine_loop.EngineLoop`).

The engine thread reads these from its command queue and dispatches on their type: a group of
:class:`Child` requests to add (:class:`AddCommand`), request ids to abort
(:class:`AbortCommand`), or the end of the loop (:class:`StopCommand`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fitserve.sampling import SamplingParams
from fitserve.sampling.beam_search import BeamSearchParams
from fitserve.types import RequestOutput

Sink = Callable[[list[RequestOutput] | BaseException], None]
"""Receives one step's outputs for a request group, or the error that ended the group."""

Added = Callable[[BaseException | None], None]
"""Told once whether a submitted group was queued (None) or refused (the error)."""


@dataclass(slots=True)
class Child:
    """One engine request: the server fans a client request out into n x prompts children."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams | BeamSearchParams  # a beam search is one child holding all n beams
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


@dataclass(slots=True, frozen=True)
class AddCommand:
    """Add a group of children, all or none; ``sink`` gets their outputs, ``on_added`` the outcome."""

    group: str
    children: list[Child]
    arrival: float  # time.monotonic() when the HTTP request arrived
    sink: Sink
    on_added: Added | None = None

    def prompt_runs(self) -> list[list[Child]]:
        """Consecutive sampling children of one prompt (the same list) grouped; a beam search alone."""
        runs: list[list[Child]] = []
        for c in self.children:
            prev = runs[-1][0] if runs else None
            if (prev is not None and prev.prompt_ids is c.prompt_ids
                    and isinstance(prev.params, SamplingParams) and isinstance(c.params, SamplingParams)):
                runs[-1].append(c)
            else:
                runs.append([c])
        return runs


@dataclass(slots=True, frozen=True)
class AbortCommand:
    """Abort these requests (unknown or finished ids are ignored)."""

    request_ids: list[str]


@dataclass(slots=True, frozen=True)
class StopCommand:
    """Abort everything still open and end the engine thread."""


EngineCommand = AddCommand | AbortCommand | StopCommand
