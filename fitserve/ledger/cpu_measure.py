"""This CPU's memory bandwidth and matmul FLOP/s: measured robustly, cached with the CPU they
were measured on, and measured again when the cache is stale or a quick probe disagrees.

A single best-of-5 copy taken while the host was busy once cached 9.5 GB/s for a CPU that
copies at 24.8, and every ``--gpu cpu`` speed line was then off by 2.6x. So:

    full measure   ``threads`` workers (the engine's decode runs on every core) each copy
                   their slice of 256 MiB, 7 times, then each sum (read) theirs, 7 times; runs
                   slower than 1.25 x the best are disturbed (another process took the cores)
                   and dropped; the median of the rest is each figure. The read rate is the
                   memory bandwidth the planner prices a step's weight and KV reads at (a
                   decode step reads; measured on the Xeon this was written on: read 30 GB/s,
                   copy 24.4, the engine's W1 streaming its weights at ~28)
    cache          $FITSERVE_HOME/hardware-cpu.json with the CPU model, thread count and time
    re-measure     when the CPU model or thread count differ, the figure is older than
                   ``STALE_AFTER_S``, or a quick probe (64 MiB, best of 3) is more than 25%
                   away from the cached figure
    engine rates   the matmul FLOP/s the engine's own ops reach per path (int8-activation
                   int4/int8, bf16, f32) and its per-step / per-layer overhead:
                   ``fitserve.engine.cpu_rates``, run in a subprocess (this module stays
                   torch-free: it takes the numbers that process prints)
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

STALE_AFTER_S = 30 * 24 * 3600
PROBE_TOLERANCE = 0.25  # a probe this far from the cached figure triggers a full measure
GOOD_RUN_SLACK = 1.25  # runs within this factor of the best run count as undisturbed


@dataclass(frozen=True, slots=True)
class CpuFigures:
    """One measurement: copy bandwidth (read + write bytes/s), read bandwidth (bytes summed per
    second; 0: not measured, the copy figure stands in), numpy float32 matmul FLOP/s and
    the engine's own rates (``measure_engine_rates``; empty where they could not be measured,
    ``engine_note`` says why)."""

    mem_bytes_per_s: float
    flops: float
    cpu_model: str
    threads: int
    measured_at: float  # unix time
    runs_kept: int  # undisturbed copy runs behind the median
    matmul_rows: tuple[int, ...] = ()  # the rows (M) each engine matmul rate was measured at
    # path -> at each K of matmul_k (K-major), the rate at each row count (one K: empty)
    matmul_flops: dict[str, list[float]] = field(default_factory=dict)
    attention_flops: float = 0.0  # the engine's paged decode attention (0: not measured)
    step_overhead_s: float = 0.0  # an engine decode step's fixed cost
    layer_overhead_s: float = 0.0  # and its fixed cost per decoder layer
    engine_note: str = ""  # why the engine rates are missing, if they are
    # per token: seconds per element of a layer's element-wise work (speed.elementwise_elements);
    # per sampled sequence: seconds besides its bytes and FLOPs, and per logit of the argmax
    elementwise_s: float = 0.0
    seq_overhead_s: float = 0.0
    logit_s: float = 0.0
    # the one-row linears' weight bytes/s per path at each K of gemv_k (EngineRates)
    gemv_k: tuple[int, ...] = ()
    gemv_bytes_per_s: dict[str, list[float]] = field(default_factory=dict)
    matmul_k: tuple[int, ...] = ()  # the K each row of matmul_flops was measured at
    attention_seq_s: float = 0.0  # decode attention's cost per (sequence, KV head, layer)
    attention_kv_s: float = 0.0  # and per KV head, key and dimension
    # the decode attention on the AMX-BF16 tile, which runs for models with at least
    # attention_tile_min_group query heads per KV head (0: never here): its query heads' FLOP/s
    # and its cost per KV head, key and dimension (EngineRates)
    attention_tile_flops: float = 0.0
    attention_tile_kv_s: float = 0.0
    attention_tile_min_group: int = 0
    read_bytes_per_s: float = 0.0

    @property
    def stream_bytes_per_s(self) -> float:
        """The bandwidth a step's reads are priced at: the read rate, else the copy's."""
        return self.read_bytes_per_s or self.mem_bytes_per_s

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.measured_at))
        rates = ", ".join(f"{p} {'/'.join(f'{r / 1e9:.0f}' for r in v)}"
                          for p, v in sorted(self.matmul_flops.items()))
        rows = "/".join(str(m) for m in self.matmul_rows)
        ks = f" x K = {'/'.join(str(k) for k in self.matmul_k)}" if self.matmul_k else ""
        engine = (f"; engine matmul GFLOP/s at M = {rows} rows{ks}: {rates}; decode attention "
                  f"{self.attention_flops / 1e9:.0f} GFLOP/s + "
                  f"{self.attention_seq_s * 1e9:.0f} ns per sequence and KV head + "
                  f"{self.attention_kv_s * 1e12:.2f} ps per KV head, key and dimension"
                  f"{describe_tile(self)}; step overhead "
                  f"{self.step_overhead_s * 1e3:.3f} ms + {self.layer_overhead_s * 1e6:.1f} us "
                  f"per layer + {self.seq_overhead_s * 1e6:.1f} us per sequence; element-wise "
                  f"{self.elementwise_s * 1e12:.0f} ps per element{describe_gemv(self)}"
                  if self.matmul_flops else
                  f"; engine rates not measured ({self.engine_note or 'unknown'})")
        read = f"{self.read_bytes_per_s / 1e9:.1f} GB/s read, " if self.read_bytes_per_s else ""
        return (f"{read}{self.mem_bytes_per_s / 1e9:.1f} GB/s copy, {self.flops / 1e9:.0f} GFLOP/s "
                f"numpy f32 matmul{engine}, {self.threads} threads, measured {when} on "
                f"{self.cpu_model}")


def describe_tile(r: CpuFigures | EngineRates) -> str:
    """' (AMX tile from G query heads per KV head: ...)' (empty where it does not run)."""
    if not r.attention_tile_min_group:
        return ""
    return (f" (on the AMX tile from {r.attention_tile_min_group} query heads per KV head: "
            f"{r.attention_tile_flops / 1e9:.0f} GFLOP/s + {r.attention_tile_kv_s * 1e12:.2f} ps "
            f"per KV head, key and dimension)")


def describe_gemv(r: CpuFigures | EngineRates) -> str:
    """'; one-row linears ... GB/s at K = ...' (empty where not measured)."""
    if not r.gemv_bytes_per_s:
        return ""
    ks = "/".join(str(k) for k in r.gemv_k)
    rates = ", ".join(f"{p} {'/'.join(f'{x / 1e9:.1f}' for x in v)}"
                      for p, v in sorted(r.gemv_bytes_per_s.items()))
    return f"; one-row linears' weight GB/s at K = {ks}: {rates}"


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


def _timed_copies(nbytes: int, repeats: int, threads: int, read_only: bool = False) -> list[float]:
    """Seconds of each of ``repeats`` runs in which ``threads`` workers each copy (or, with
    ``read_only``, sum: loads and no stores) their slice of ``nbytes``."""
    import numpy as np

    n = max(threads, nbytes // 8)
    src = np.ones(n, dtype=np.float64)
    dst = src if read_only else np.empty(n, dtype=np.float64)
    bounds = [(i * n // threads, (i + 1) * n // threads) for i in range(threads)]

    def part(i: int) -> None:  # numpy drops the GIL for a large copy / sum: the slices run at once
        a, b = bounds[i]
        if read_only:
            np.add.reduce(src[a:b])
        else:
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


def measure_read_bandwidth(nbytes: int = 256 << 20, repeats: int = 7,
                           threads: int | None = None) -> float:
    """Bytes/s of a parallel numpy sum (``nbytes`` read per run, nothing written): the median
    of the undisturbed runs: the rate a decode step's weight reads can reach, which need not
    be the copy figure's (a copy's stores are not limited by the cores' outstanding loads)."""
    t = threads or default_threads()
    seconds, _ = good_median(_timed_copies(nbytes, repeats, t, read_only=True))
    return (nbytes // 8) * 8 / seconds


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


ENGINE_RATES_MODULE = "fitserve.engine.cpu_rates"
ENGINE_RATES_TIMEOUT_S = 600  # a first run may compile the C++ kernels


@dataclass(frozen=True, slots=True)
class EngineRates:
    """``fitserve.engine.cpu_rates``' figures: matmul FLOP/s per path at each row count, and
    the fixed cost of a decode step and of each decoder layer in it."""

    matmul_rows: tuple[int, ...]
    matmul_flops: dict[str, list[float]]
    attention_flops: float
    step_overhead_s: float
    layer_overhead_s: float
    elementwise_s: float = 0.0  # per element of a layer's element-wise work, per token
    seq_overhead_s: float = 0.0  # per sampled sequence of a step
    logit_s: float = 0.0  # per logit of a sampled sequence (the greedy argmax)
    # weight bytes/s of the one-row linears per path at each of gemv_k (K); empty: not measured
    gemv_k: tuple[int, ...] = ()
    gemv_bytes_per_s: dict[str, list[float]] = field(default_factory=dict)
    # the K each row of matmul_flops was measured at (K-major; empty: one K), and decode
    # attention's fixed cost per (sequence, KV head, layer) beside its FLOPs
    matmul_k: tuple[int, ...] = ()
    attention_seq_s: float = 0.0
    attention_kv_s: float = 0.0  # decode attention per KV head, key and dimension
    # the decode attention on the AMX-BF16 tile (CpuFigures' fields of the same names)
    attention_tile_flops: float = 0.0
    attention_tile_kv_s: float = 0.0
    attention_tile_min_group: int = 0

    @classmethod
    def from_json(cls, text: str) -> EngineRates:
        """Parse the probe's JSON line; ValueError naming what is missing or wrong."""
        try:
            d = json.loads(text)
            rows = tuple(int(m) for m in d["matmul_rows"])
            rates = {str(p): [float(x) for x in v] for p, v in d["matmul_flops"].items()}
            out = cls(rows, rates, float(d["attention_flops"]), float(d["step_overhead_s"]),
                      float(d["layer_overhead_s"]), float(d.get("elementwise_s", 0.0)),
                      float(d.get("seq_overhead_s", 0.0)), float(d.get("logit_s", 0.0)),
                      tuple(int(k) for k in d.get("gemv_k", ())),
                      {str(p): [float(x) for x in v]
                       for p, v in d.get("gemv_bytes_per_s", {}).items()},
                      tuple(int(k) for k in d.get("matmul_k", ())),
                      float(d.get("attention_seq_s", 0.0)),
                      float(d.get("attention_kv_s", 0.0)),
                      float(d.get("attention_tile_flops", 0.0)),
                      float(d.get("attention_tile_kv_s", 0.0)),
                      int(d.get("attention_tile_min_group", 0)))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not the engine-rates JSON ({exc!r}): {text[:200]}") from None
        per_path = len(rows) * max(1, len(out.matmul_k))
        if "bf16" not in rates or any(len(v) != per_path for v in rates.values()) or min(
                [out.step_overhead_s, out.layer_overhead_s, out.attention_flops,
                 out.attention_seq_s, out.attention_kv_s, out.attention_tile_flops,
                 out.attention_tile_kv_s, out.attention_tile_min_group,
                 out.elementwise_s, out.seq_overhead_s, out.logit_s,
                 *(x for v in rates.values() for x in v)]) < 0 or any(
                len(v) != len(out.gemv_k) or min(v, default=1.0) <= 0
                for v in out.gemv_bytes_per_s.values()):
            raise ValueError(f"engine-rates JSON with mismatched or negative figures: {text[:200]}")
        return out


def measure_engine_rates(threads: int) -> EngineRates:
    """The engine's own matmul rates and step overhead: ``python -m fitserve.engine.cpu_rates``
    in a subprocess (torch stays out of this process), its JSON line parsed. RuntimeError
    naming the problem where it fails."""
    cmd = [sys.executable, "-m", ENGINE_RATES_MODULE, str(threads)]
    # NOTE: the subprocess imports the fitserve this module is part of (a worktree's, not
    # whatever the venv's editable install points at)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=ENGINE_RATES_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{ENGINE_RATES_MODULE} did not run: {exc}") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{ENGINE_RATES_MODULE} failed (exit {proc.returncode}): {tail}")
    try:
        return EngineRates.from_json(lines[-1])
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None


def measure_figures(threads: int | None = None, *,
                    engine: EngineRates | None = None) -> CpuFigures:
    """A full measurement of this CPU (~2 s of copies and numpy, then the engine's rates, a few
    seconds more; ``engine``: rates already measured on this CPU, kept instead)."""
    t = threads or default_threads()
    seconds, kept = good_median(_timed_copies(256 << 20, 7, t))
    read = measure_read_bandwidth(256 << 20, 7, t)
    bw, flops, at = 2 * (256 << 20) / seconds, measure_matmul_flops(), time.time()
    try:
        e = engine or measure_engine_rates(t)
    except RuntimeError as exc:
        return CpuFigures(bw, flops, cpu_model(), t, at, kept, engine_note=str(exc),
                          read_bytes_per_s=read)
    return CpuFigures(bw, flops, cpu_model(), t, at, kept, e.matmul_rows, e.matmul_flops,
                      e.attention_flops, e.step_overhead_s, e.layer_overhead_s,
                      elementwise_s=e.elementwise_s, seq_overhead_s=e.seq_overhead_s,
                      logit_s=e.logit_s, gemv_k=e.gemv_k, gemv_bytes_per_s=e.gemv_bytes_per_s,
                      matmul_k=e.matmul_k, attention_seq_s=e.attention_seq_s,
                      attention_kv_s=e.attention_kv_s, attention_tile_flops=e.attention_tile_flops,
                      attention_tile_kv_s=e.attention_tile_kv_s,
                      attention_tile_min_group=e.attention_tile_min_group,
                      read_bytes_per_s=read)


def reusable_engine_rates(cached: CpuFigures | None, *, now: float, model: str,
                          threads: int) -> EngineRates | None:
    """The cached engine rates where they still describe this CPU (same model and thread
    count, not stale): a bandwidth probe that disagrees re-measures the bandwidth, not these
    (they are compute, and take seconds to measure)."""
    if (cached is None or not cached.matmul_flops or cached.cpu_model != model
            or cached.threads != threads or now - cached.measured_at > STALE_AFTER_S):
        return None
    return EngineRates(tuple(cached.matmul_rows), dict(cached.matmul_flops),
                       cached.attention_flops, cached.step_overhead_s, cached.layer_overhead_s,
                       cached.elementwise_s, cached.seq_overhead_s, cached.logit_s,
                       tuple(cached.gemv_k), dict(cached.gemv_bytes_per_s),
                       tuple(cached.matmul_k), cached.attention_seq_s, cached.attention_kv_s,
                       cached.attention_tile_flops, cached.attention_tile_kv_s,
                       cached.attention_tile_min_group)


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
