"""The one timing helper the benchmark scripts share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], runs: int,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of ``runs`` calls of ``fn`` after one warm-up call, read on ``clock``:
    ``time.perf_counter`` (wall), ``time.thread_time`` (this thread's CPU: immune to other
    processes on a loaded host) or ``time.process_time`` (every thread of the process)."""
    fn()
    times = []
    for _ in range(runs):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)
