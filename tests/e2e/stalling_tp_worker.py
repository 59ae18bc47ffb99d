"""Test-only tensor-parallel worker: ``python -m tests.e2e.stalling_tp_worker`` is
``python -m fitserve.dist.worker`` whose rank RANK sleeps SECONDS before its step STEP, as
``$FITSERVE_TEST_TP_STALL=RANK:STEP:SECONDS`` (read here, never by fitserve) says.

Tests point :data:`fitserve.dist.group.WORKER_MODULE` at this module.
"""

from __future__ import annotations

import os
import time
from typing import Any

from fitserve.dist import worker

STALL_ENV = "FITSERVE_TEST_TP_STALL"


def _stall(seconds: float) -> None:
    time.sleep(seconds)  # the watchdog's stack report of this rank names this function


def install(rank: int, spec: str) -> None:
    """Wrap the worker's per-step plan decoding: the stalling rank sleeps before its step."""
    stall_rank, stall_step, seconds = spec.split(":")
    real_decode = worker.decode_step
    steps = 0

    def decode_step(payload: Any) -> Any:
        nonlocal steps
        steps += 1
        if rank == int(stall_rank) and steps == int(stall_step):
            _stall(float(seconds))
        return real_decode(payload)

    worker.decode_step = decode_step  # type: ignore[assignment]


if __name__ == "__main__":
    install(int(os.environ["RANK"]), os.environ[STALL_ENV])
    raise SystemExit(worker.main())
