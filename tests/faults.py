"""Test-only faults, injected from the test side (production code reads no test variable).

In-process tests set :attr:`fitserve.engine.core.Engine.fault_hook` themselves. For a real
server, ``python -m tests.faults serve ...`` is `fitserve serve` with :func:`prompt_token_faults`
on its engine: a step holding a request whose prompt starts with :data:`FAULT_TOKEN` fails that
step (:class:`InjectedFault`, isolated to the request), one starting with :data:`KILL_TOKEN`
kills the engine thread (:class:`InjectedEngineDeath`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

FAULT_TOKEN = 49150
KILL_TOKEN = 49151


class InjectedFault(RuntimeError):
    """A step failure the engine isolates to the requests in it (a model-step fault)."""


class InjectedEngineDeath(BaseException):
    """The engine thread's death: a BaseException, so neither the engine's per-request
    isolation nor the server's "fail the batch, keep serving" handler catches it."""


def prompt_token_faults(engine: Any) -> Callable[[Sequence[str]], None]:
    """A fault hook for ``engine`` keyed on the first prompt token of each request in a step."""

    def hook(request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            tracked = engine._requests.get(rid)
            first = tracked.sched.prompt_token_ids[:1] if tracked is not None else []
            if first == [FAULT_TOKEN]:
                raise InjectedFault(f"injected fault for request {rid!r} (prompt starts with {FAULT_TOKEN})")
            if first == [KILL_TOKEN]:
                raise InjectedEngineDeath(f"TEST-ONLY: request {rid!r} (prompt starts with {KILL_TOKEN}) "
                                          "killed the engine thread")

    return hook


def install() -> None:
    """Give every Engine built from now on the :func:`prompt_token_faults` hook."""
    from fitserve.engine.core import Engine

    real_init = Engine.__init__

    def init(self: Engine, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self.fault_hook = prompt_token_faults(self)

    Engine.__init__ = init  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from fitserve.cli.main import main

    raise SystemExit(main())
