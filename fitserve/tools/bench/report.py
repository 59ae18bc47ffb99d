"""Summaries of a load run: throughput, latency percentiles, SLO goodput; JSON and a PNG."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitserve.tools.bench.loadgen import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class SLO:
    """A request is "good" when its TTFT and its TPOT are both within these bounds (ms)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft is None:
            return False
        if self.ttft_ms is not None and r.ttft * 1000 > self.ttft_ms:
            return False
        tpot = r.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        "mean": round(1000 * sum(values) / len(values), 2) if values else None,
    }
    for q in PERCENTILES:
        p = percentile(values, q)
        out[f"p{q}"] = None if p is None else round(1000 * p, 2)
    return out


def summarize(results: list[RequestResult], duration_s: float, slo: SLO, meta: dict[str, Any]) -> dict[str, Any]:
    """Everything the JSON report holds (latencies in ms, throughputs per second)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if slo.met(r)]
    dur = max(duration_s, 1e-9)
    return {
        **meta,
        "duration_s": round(duration_s, 3),
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "request_throughput": round(len(ok) / dur, 4),
        "output_token_throughput": round(out_tokens / dur, 2),
        "input_token_throughput": round(sum(r.prompt_tokens for r in ok) / dur, 2),
        "total_output_tokens": out_tokens,
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itls]),
        "e2e_ms": _stats_ms([r.e2e for r in ok if r.e2e is not None]),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "goodput": round(len(good) / dur, 4),
        "slo_attainment": round(len(good) / len(results), 4) if results else None,
    }


def write_json(summary: dict[str, Any], results: list[RequestResult], path: Path) -> None:
    per_request = [
        {"start": round(r.start, 4), "ok": r.ok, "error": r.error, "prompt_tokens": r.prompt_tokens,
         "output_tokens": r.output_tokens, "ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot}
        for r in results
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": summary, "requests": per_request}, indent=2))


def write_png(results: list[RequestResult], duration_s: float, path: Path, title: str = "") -> None:
    """Latency CDFs (TTFT, ITL, e2e) and output tokens/s over time, in one figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    series = [
        ("TTFT", [1000 * r.ttft for r in ok if r.ttft is not None]),
        ("inter-token latency", [1000 * x for r in ok for x in r.itls]),
        ("end-to-end latency", [1000 * r.e2e for r in ok if r.e2e is not None]),
    ]
    for ax, (name, values) in zip(axes.flat, series, strict=False):
        values.sort()
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    ax = axes.flat[3]
    bins = max(1, math.ceil(duration_s))
    counts = [0] * bins
    for r in ok:
        for t in r.chunk_times:
            counts[min(bins - 1, max(0, int(t)))] += 1
    ax.plot(range(bins), counts, drawstyle="steps-post")
    ax.set_title("output tokens/s over time (content chunks)")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def format_table(summary: dict[str, Any]) -> str:
    """A plain-text report for the terminal."""
    lines = [
        f"requests: {summary['completed']} ok, {summary['failed']} failed in {summary['duration_s']:.1f} s",
        f"throughput: {summary['request_throughput']:.3f} req/s, "
        f"{summary['output_token_throughput']:.1f} output tok/s",
        f"{'metric':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        cells = "".join(f"{'-' if s[c] is None else format(s[c], '.1f'):>10}" for c in ("mean", "p50", "p90", "p99"))
        lines.append(f"{key[:-3]:<10}{cells}")
    slo = summary["slo"]
    lines.append(f"goodput: {summary['goodput']:.3f} req/s meeting TTFT<={slo['ttft_ms']} ms, "
                 f"TPOT<={slo['tpot_ms']} ms (attainment {summary['slo_attainment']})")
    if "kv" in summary:
        from fitserve.tools.bench.kv_monitor import format_kv

        lines.append(format_kv(summary["kv"]))
    for e in summary["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)
