"""KV-cache utilisation and fragmentation of a fitserve server over one bench run.

While the load runs, a thread scrapes the server's ``/metrics`` (beside ``/v1``) every
``interval_s``: blocks used, blocks in the pool and the unused share of the allocated slots
(``fitserve_kv_fragmentation_ratio``: (allocated - used slots) / allocated, only the last block
of a sequence can be partly filled). Per run::

    utilisation   = mean over samples of used / total          (and its peak)
    fragmentation = sum(frag_i x used_i) / sum(used_i)          unused slots / allocated slots
                    over the run, each sample weighted by the blocks it held (and its peak)

A run whose fragmentation is >= FLAG_FRACTION (5%) is flagged: its block size wastes memory
for its lengths (vLLM's 16-token blocks waste < 16 slots per sequence). Another server
(no fitserve gauges) gives ``None``.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

FLAG_FRACTION = 0.05
METRICS = ("fitserve_kv_blocks_used", "fitserve_kv_blocks_total",
           "fitserve_kv_fragmentation_ratio")


@dataclass(frozen=True, slots=True)
class KVSample:
    used_blocks: float
    total_blocks: float
    fragmentation: float


def parse_sample(text: str) -> KVSample | None:
    """One sample from a Prometheus exposition (None: the fitserve KV gauges are absent)."""
    vals: dict[str, float] = {}
    for name in METRICS:
        found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        if not found:
            return None
        vals[name] = sum(float(v) for v in found)
    return KVSample(*(vals[n] for n in METRICS))


def kv_summary(samples: list[KVSample]) -> dict[str, Any] | None:
    """The run's utilisation and fragmentation (module docstring); None without samples."""
    if not samples:
        return None
    util = [s.used_blocks / s.total_blocks if s.total_blocks else 0.0 for s in samples]
    held = sum(s.used_blocks for s in samples)
    frag = sum(s.fragmentation * s.used_blocks for s in samples) / held if held else 0.0
    return {
        "samples": len(samples),
        "utilization_mean": round(sum(util) / len(util), 4),
        "utilization_peak": round(max(util), 4),
        "fragmentation": round(frag, 4),
        "fragmentation_peak": round(max(s.fragmentation for s in samples), 4),
        "fragmentation_flag": frag >= FLAG_FRACTION,
    }


def format_kv(kv: dict[str, Any] | None) -> str:
    """One line for the terminal report."""
    if kv is None:
        return "KV: no fitserve KV gauges at /metrics (another server, or metrics not reachable)"
    flag = (f"  FLAG: fragmentation >= {FLAG_FRACTION:.0%}" if kv["fragmentation_flag"] else "")
    return (f"KV: utilisation {kv['utilization_mean']:.1%} mean, {kv['utilization_peak']:.1%} "
            f"peak; fragmentation {kv['fragmentation']:.2%} of allocated slots unused "
            f"({kv['fragmentation_peak']:.2%} peak, {kv['samples']} samples){flag}")


@dataclass
class KVMonitor:
    """Scrapes ``metrics_url`` every ``interval_s`` on a thread between start() and stop()."""

    metrics_url: str
    headers: dict[str, str] = field(default_factory=dict)
    interval_s: float = 0.25
    samples: list[KVSample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> KVMonitor:
        self._thread = threading.Thread(target=self._loop, name="kv-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any] | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return kv_summary(self.samples)

    def _loop(self) -> None:
        import httpx

        with httpx.Client(headers=self.headers, timeout=5.0) as client:
            while True:
                try:
                    s = parse_sample(client.get(self.metrics_url).text)
                except httpx.HTTPError:
                    s = None
                if s is not None:
                    self.samples.append(s)
                if self._stop.wait(self.interval_s):
                    return


def metrics_url(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port/metrics``."""
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"
