"""What ``fitserve profile`` reports: latency percentiles, the per-shape step table, utilisation,
the summary JSON and the printed tables. Pure functions of the recorded times (no torch).

Latency, from each request's token times (arrival = when it was added):

    TTFT  first token - arrival                                  one value per request
    TPOT  (last token - first token) / (tokens - 1)              per request with >= 2 tokens
    ITL   token k - token k-1                                    one value per later token

Tokens emitted together in one step (speculative decoding) get ITL 0 after the first.
Percentiles interpolate linearly between order statistics (numpy's default).

Utilisation of the run:

    step_busy_share  = sum of step wall times / run wall time        (1: the loop never idles)
    cpu_utilization  = process CPU time / (run wall time x torch threads)

NOTE: OpenMP worker threads spin for a while before they sleep, so with several threads the CPU
utilisation stays near 100% even where the ops leave cores idle; it measures what the process
takes from the machine, not useful work. Run with one thread to see the loop's own share.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from fitserve.tools.profile.workloads import RequestTiming, RunResult
from fitserve.types import StepRecord


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between order statistics."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Percentiles:
    """p50 / p90 / p99 and the mean of ``n`` values (milliseconds)."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Percentiles:
        mean = statistics.fmean(values_ms) if values_ms else math.nan
        return cls(len(values_ms), mean, *(percentile(values_ms, q) for q in (50, 90, 99)))


def token_latencies(requests: Iterable[RequestTiming]) -> dict[str, list[float]]:
    """TTFT and TPOT (per request) and ITL (per token), in milliseconds."""
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    for r in requests:
        t = r.token_times
        if not t:
            continue
        ttft.append((t[0] - r.arrival) * 1e3)
        if len(t) >= 2:
            tpot.append((t[-1] - t[0]) / (len(t) - 1) * 1e3)
        itl.extend((b - a) * 1e3 for a, b in zip(t, t[1:], strict=False))
    return {"ttft_ms": ttft, "tpot_ms": tpot, "itl_ms": itl}


def latency_summary(requests: Iterable[RequestTiming]) -> dict[str, Percentiles]:
    """:func:`token_latencies` reduced to percentiles."""
    return {k: Percentiles.of(v) for k, v in token_latencies(requests).items()}


# ------------------------------------------------------------------------------ step shapes


def _bucket(n: int) -> str:
    """Power-of-two class of ``n``: "1", "2", "3-4", "5-8", "9-16", ..."""
    if n <= 2:
        return str(max(n, 0))
    hi = 1 << (n - 1).bit_length()
    return f"{hi // 2 + 1}-{hi}"


def step_kind(r: StepRecord) -> str:
    """prefill (prompt chunks only), decode (one-token chunks only) or mixed."""
    if r.num_prefill_tokens and r.num_decodes:
        return "mixed"
    return "prefill" if r.num_prefill_tokens else "decode"


@dataclass(frozen=True, slots=True)
class ShapeRow:
    """Steps of one shape class and their wall times."""

    kind: str
    new_tokens: str
    seqs: str
    kv_tokens_read: str
    count: int
    median_ms: float
    p90_ms: float
    median_forward_ms: float
    share_of_step_time: float


def shape_rows(steps: Sequence[StepRecord]) -> list[ShapeRow]:
    """Steps grouped by (kind, new_tokens, seqs, kv_tokens_read) power-of-two class."""
    groups: dict[tuple[str, str, str, str], list[StepRecord]] = {}
    for r in steps:
        key = (step_kind(r), _bucket(r.new_tokens), _bucket(r.seqs), _bucket(r.kv_tokens_read))
        groups.setdefault(key, []).append(r)
    total = sum(r.seconds for r in steps) or 1.0
    rows = []
    for key, rs in groups.items():
        ms = [r.seconds * 1e3 for r in rs]
        rows.append(ShapeRow(*key, len(rs), statistics.median(ms), percentile(ms, 90),
                             statistics.median(r.forward_seconds * 1e3 for r in rs),
                             sum(r.seconds for r in rs) / total))
    order = {"prefill": 0, "mixed": 1, "decode": 2}
    return sorted(rows, key=lambda r: (order[r.kind], -r.share_of_step_time))


def utilisation(run: RunResult) -> dict[str, float]:
    """Busy share of the step loop and CPU utilisation of the process (see module doc)."""
    wall = run.wall_s or math.nan
    busy = sum(r.seconds for r in run.steps)
    return {"wall_s": run.wall_s, "process_cpu_s": run.cpu_s, "sum_step_s": busy,
            "step_busy_share": busy / wall, "cpu_utilization": run.cpu_s / (wall * max(run.threads, 1)),
            "threads": run.threads}


def throughput(run: RunResult) -> dict[str, float]:
    """Generated tokens per second, and prompt + generated tokens per second."""
    out = sum(len(r.token_times) for r in run.requests)
    prompt = sum(r.prompt_tokens for r in run.requests)
    wall = run.wall_s or math.nan
    return {"output_tokens": out, "prompt_tokens": prompt, "output_tokens_per_s": out / wall,
            "total_tokens_per_s": (out + prompt) / wall, "steps": len(run.steps),
            "requests": len(run.requests), "rejected_by_slo": run.rejected}


# ---------------------------------------------------------------------------- files, tables


def to_jsonable(x: Any) -> Any:
    """Dataclasses as dicts, NaN/inf as None (JSON has neither), recursively."""
    if is_dataclass(x) and not isinstance(x, type):
        return to_jsonable(asdict(x))
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [to_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def write_csv(path: Path, rows: Sequence[Any], row_type: type) -> None:
    """Dataclass ``rows`` of ``row_type`` as CSV with a header (floats to 6 significant digits)."""
    names = [f.name for f in fields(row_type)]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        for row in rows:
            w.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in (getattr(row, n) for n in names)])


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain text table: columns padded to their widest cell, numbers right-aligned."""
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    for r in cells:
        lines.append("  ".join(c.rjust(w) if _numeric(c) else c.ljust(w)
                               for c, w in zip(r, widths, strict=True)))
    return "\n".join(lines)


def _cell(v: object) -> str:
    if isinstance(v, float):
        return "nan" if not math.isfinite(v) else f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _numeric(c: str) -> bool:
    try:
        float(c.rstrip("%"))
    except ValueError:
        return False
    return True


def latency_table(lat: dict[str, Percentiles]) -> str:
    """TTFT / TPOT / ITL percentiles as a table."""
    return format_table(["metric", "n", "mean", "p50", "p90", "p99"],
                        [(k, p.n, p.mean, p.p50, p.p90, p.p99) for k, p in lat.items()])


def shape_table(rows: Sequence[ShapeRow]) -> str:
    """The per-shape step table."""
    return format_table(
        ["kind", "new_tokens", "seqs", "kv_read", "steps", "median ms", "p90 ms", "fwd ms", "share"],
        [(r.kind, r.new_tokens, r.seqs, r.kv_tokens_read, r.count, r.median_ms, r.p90_ms,
          r.median_forward_ms, f"{r.share_of_step_time:.1%}") for r in rows])
