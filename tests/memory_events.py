"""Peak bytes a call allocates, from torch.profiler's CPU memory events (the measured side of
the ledger's scratch and sampler lines)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def peak_extra(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated and not yet freed while ``fn`` runs (its result is dropped)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    if not events:
        pytest.skip("this torch's profiler records no CPU memory events")
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak
