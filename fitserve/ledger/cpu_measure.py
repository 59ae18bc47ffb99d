"""This CPU's memory bandwidth and matmul FLOP/s: measured robustly, cached with the CPU they
were measured on, and measured again when the cache is stale or a quick probe disagrees.

A single best-of-5 copy taken while the host was busy once cached 9.5 GB/s for a CPU that
copies at 24.8, and every ``--gpu cpu`` speed line was then off by 2.6x. So:

    full measure   ``threads`` workers (the engine's decode runs on every core) each copy
                   their slice of 256 MiB, 7 times; runs slower than 1.25 x the best are
                   disturbed (another process took the cores) and dropped; the median of
                   the rest is the figure
    cache          $FITSERVE_HOME/hardware-cpu.json with the CPU model, thread count and time
    re-measure     when the CPU model or thread count differ, the figure is older than
                   ``STALE_AFTER_S``, or a quick probe (64 MiB, best of 3) is more than 25%
                   away from the cached figure
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

STALE_AFTER_S = 30 * 24 * 3600
PROBE_TOLERANCE = 0.25  # a probe this far from the cached figure triggers a full measure
GOOD_RUN_SLACK = 1.25  # runs within this factor of the best run count as undisturbed


@dataclass(frozen=True, slots=True)
class CpuFigures:
    """One measurement: copy bandwidth (read + write bytes/s) and float32 matmul FLOP/s."""

    mem_bytes_per_s: float
    flops: float
    cpu_model: str
    threads: int
    measured_at: float  # unix time
    runs_kept: int  # undisturbed copy runs behind the median

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.measured_at))
        return (f"{self.mem_bytes_per_s / 1e9:.1f} GB/s copy, {self.flops / 1e9:.0f} GFLOP/s "
                f"f32 matmul, {self.threads} threads, measured {when} on {self.cpu_model}")


def cpu_model() -> str:
    """/proc/cpuinfo's model name with family/model numbers (one name covers several CPUs)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return name


def default_threads() -> int:
    """Cores this process may run on (the engine's torch threads default to the same)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def good_median(seconds: list[float], slack: float = GOOD_RUN_SLACK) -> tuple[float, int]:
    """The median of the runs within ``slack`` x the fastest, and how many there were."""
    best = min(seconds)
    good = [s for s in seconds if s <= best * slack]
    return statistics.median(good), len(good)


def _timed_copies(nbytes: int, repeats: int, threads: int) -> list[float]:
    import numpy as np

    n = max(threads, nbytes // 8)
    src, dst = np.ones(n, dtype=np.float64), np.empty(n, dtype=np.float64)
    bounds = [(i * n // threads, (i + 1) * n // threads) for i in range(threads)]

    def part(i: int) -> None:  # numpy drops the GIL for a large copy: the slices run at once
        a, b = bounds[i]
        np.copyto(dst[a:b], src[a:b])

    out = []
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, range(threads)))  # warm-up: fault the pages in, start the threads
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(part, range(threads)))
            out.append(time.perf_counter() - t0)
    return out


def measure_copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 7,
                           threads: int | None = None) -> float:
    """Bytes/s of a parallel numpy copy (read + write = 2 x ``nbytes`` per run): the median
    of the undisturbed runs (``good_median``)."""
    t = threads or default_threads()
    seconds, _ = good_median(_timed_copies(nbytes, repeats, t))
    return 2 * (nbytes // 8) * 8 / seconds


def probe_copy_bandwidth(threads: int | None = None) -> float:
    """A quick check (~30 ms): best of 3 parallel copies of 64 MiB (past the last-level cache
    of the CPUs seen here)."""
    t = threads or default_threads()
    return 2 * (64 << 20) / min(_timed_copies(64 << 20, 3, t))


def measure_matmul_flops(n: int = 1024, repeats: int = 7) -> float:
    """FLOP/s of an n x n float32 numpy matmul (2 n^3 FLOPs): the median of the undisturbed
    runs."""
    import numpy as np

    a = np.ones((n, n), dtype=np.float32)
    b = np.ones((n, n), dtype=np.float32)
    a @ b  # warm-up (thread pool start)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        seconds.append(time.perf_counter() - t0)
    return 2 * n**3 / good_median(seconds)[0]


def measure_figures(threads: int | None = None) -> CpuFigures:
    """A full measurement of this CPU (~2 s)."""
    t = threads or default_threads()
    seconds, kept = good_median(_timed_copies(256 << 20, 7, t))
    return CpuFigures(2 * (256 << 20) / seconds, measure_matmul_flops(), cpu_model(), t,
                      time.time(), kept)


def cached_is_usable(cached: CpuFigures, *, now: float, model: str, threads: int,
                     probe: Callable[[], float]) -> tuple[bool, str]:
    """Whether the cached figures still describe this machine, and if not why."""
    if cached.cpu_model != model:
        return False, f"measured on another CPU ({cached.cpu_model})"
    if cached.threads != threads:
        return False, f"measured with {cached.threads} threads, this process has {threads}"
    if now - cached.measured_at > STALE_AFTER_S:
        return False, "older than 30 days"
    quick = probe()
    if abs(quick / cached.mem_bytes_per_s - 1) > PROBE_TOLERANCE:
        return False, (f"a quick probe read {quick / 1e9:.1f} GB/s against the cached "
                       f"{cached.mem_bytes_per_s / 1e9:.1f}")
    return True, "cached"
