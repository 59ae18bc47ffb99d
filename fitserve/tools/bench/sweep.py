"""Goodput vs offered load: one open-loop run per Poisson rate, a table, JSON and a PNG.

A sweep runs the same workload at each rate in turn (a fresh :func:`run_load` each) and keeps,
per rate, the offered rate, the achieved request throughput and the **goodput**: requests per
second that meet both SLO targets (:meth:`SLO.met`), as offered rate x fraction good (see
:func:`rate_summary` for why not good / wall time). Requests the server turned away (HTTP 429
from an SLO-aware admission policy, 503 from a full queue) are counted as *rejected*, apart from
other failures, and are never good. The PNG plots goodput against offered load with the y = x
line where every offered request is good, so the knee of each curve is where it leaves y = x.

The JSON (:func:`write_sweep_json`) is::

    {"kind": "goodput-sweep",
     "meta": {"label", "model", "base_url", "api", "slo": {"ttft_ms", "tpot_ms"},
              "workload": {"prompt_len", "output_len", "ignore_eos", "arrival", "num_requests",
                           "duration_s", "warmup", "seed"}},
     "rates": [{"offered_rate", "request_throughput", "goodput", "goodput_wall", "good", "good_fraction",
                "rejected", "rejected_by_status", "failed_other", "ttft_ms", "tpot_ms", ...}]}
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fitserve.tools.bench.loadgen import RequestResult
from fitserve.tools.bench.report import SLO, summarize
from fitserve.tools.bench.workloads import BenchRequest, make_prompt

SWEEP_KIND = "goodput-sweep"
REJECT_STATUSES = (429, 503)  # "the server is busy": admission control, full queue


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2,4"`` -> ``[0.5, 1.0, 2.0, 4.0]``: finite rates > 0, no repeats, order kept."""
    rates: list[float] = []
    for part in text.split(","):
        item = part.strip()
        if not item:
            raise ValueError(f"{text!r}: an empty rate in the list (use e.g. 0.5,1,2,4)")
        try:
            rates.append(float(item))
        except ValueError:
            raise ValueError(f"{text!r}: {item!r} is not a number (use e.g. 0.5,1,2,4)") from None
    return check_rates(rates)


def check_rates(rates: Sequence[float]) -> list[float]:
    """``rates`` as floats if each is a finite number > 0 and none repeats, else a ValueError."""
    out: list[float] = []
    if not rates:
        raise ValueError("a sweep needs at least one request rate")
    for rate in rates:
        r = float(rate)
        if not math.isfinite(r) or r <= 0:
            raise ValueError(f"request rates must be finite numbers > 0 (req/s), got {rate!r}")
        if r in out:
            raise ValueError(f"request rate {r:g} appears twice")
        out.append(r)
    return out


def http_status(r: RequestResult) -> int | None:
    """The HTTP status of a request the server refused (``error`` = "HTTP 429: ..."), else None."""
    if r.error is None or not r.error.startswith("HTTP "):
        return None
    code = r.error[5:].split(":", 1)[0].strip()
    return int(code) if code.isdigit() else None


def rate_summary(results: list[RequestResult], duration_s: float, slo: SLO, offered_rate: float) -> dict[str, Any]:
    """One row of a sweep: :func:`summarize`'s fields plus the good and rejected counts.

    ``good_fraction`` is good / all recorded requests (rejected ones included), so a policy
    that turns requests away cannot look better than one that serves them late. ``goodput``
    is ``offered_rate x good_fraction`` req/s; ``goodput_wall`` is a single run's
    good / wall time (drain included) and ``request_throughput`` completed / wall time.

    NOTE: a run of D seconds of arrivals takes D + (the last request's latency) to finish, so
    good / wall sits ~e2e / D below the offered rate even when every request is good (15% for
    a 7 s request in a 40 s run), and the number of Poisson arrivals in D varies by
    ~1 / sqrt(rate D). offered x fraction has neither bias: it is y = x exactly when every
    request is good, and it is the rate of good requests in steady state.
    """
    row = summarize(results, duration_s, slo, {"offered_rate": offered_rate})
    statuses = [http_status(r) for r in results if not r.ok]
    by_status = {str(code): sum(1 for s in statuses if s == code) for code in REJECT_STATUSES}
    rejected = sum(by_status.values())
    good = sum(1 for r in results if slo.met(r))  # met() is False for every failed request
    row.update({
        "goodput": round(offered_rate * good / len(results), 4) if results else 0.0,
        "goodput_wall": row["goodput"],
        "good": good,
        "good_fraction": round(good / len(results), 4) if results else None,
        "rejected": rejected,
        "rejected_by_status": by_status,
        "failed_other": row["failed"] - rejected,
    })
    return row


def retext_workload(workload: list[BenchRequest], salt: str) -> list[BenchRequest]:
    """The same lengths with fresh prompt text (seeded by ``salt``).

    NOTE: each rate of a sweep gets its own prompt text; the lengths and the arrival pattern stay
    the seed's. Replaying identical prompts would turn every later rate into prefix-cache hits
    (prefill nearly free), flattering the high-rate end of the curve.
    """
    rng = random.Random(salt)  # str seeds are hashed with sha512: the same in every process
    return [BenchRequest(make_prompt(r.prompt_tokens, rng), r.prompt_tokens, r.max_tokens) for r in workload]


def sweep_label(sweep: dict[str, Any], fallback: str = "sweep") -> str:
    """The legend name of a sweep: its label, else its model, else ``fallback``."""
    meta = sweep.get("meta") or {}
    return str(meta.get("label") or meta.get("model") or fallback)


def measured_knee(sweep: dict[str, Any], fraction: float = 0.9) -> float | None:
    """The highest offered rate whose goodput is >= ``fraction`` of it (None if no rate is).

    With :func:`rate_summary`'s goodput that is: at least ``fraction`` of the requests good.
    """
    def good_enough(r: dict[str, Any]) -> bool:
        if r.get("good_fraction") is not None:  # exact, where goodput is rounded
            return bool(r["good_fraction"] >= fraction)
        return bool(r["goodput"] >= fraction * r["offered_rate"])

    ok = [r["offered_rate"] for r in sweep["rates"] if good_enough(r)]
    return max(ok) if ok else None


def write_sweep_json(sweep: dict[str, Any], path: Path) -> None:
    """Write a sweep (as :func:`fitserve.tools.bench.cli.run_sweep` returns it) as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sweep, indent=2))


def load_sweep(path: Path) -> dict[str, Any]:
    """Read :func:`write_sweep_json`'s file; anything else is a ValueError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the sweep {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a sweep JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != SWEEP_KIND or not isinstance(data.get("rates"), list):
        raise ValueError(f"{path} is not a goodput sweep (written by fitserve bench --request-rate R1,R2,...)")
    for row in data["rates"]:
        if not isinstance(row, dict) or not {"offered_rate", "goodput"} <= row.keys():
            raise ValueError(f"{path}: every rate needs offered_rate and goodput")
    return data


def write_goodput_png(sweeps: Sequence[dict[str, Any]], path: Path, knee: float | None = None,
                      title: str = "") -> None:
    """Goodput (req/s) vs offered load (req/s): one curve per sweep, the y = x line, the knee."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    if not sweeps:
        raise ValueError("write_goodput_png needs at least one sweep")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    top = 0.0
    for i, sweep in enumerate(sweeps):
        rows = sorted(sweep["rates"], key=lambda r: r["offered_rate"])
        xs = [r["offered_rate"] for r in rows]
        top = max([top, *xs])
        ax.plot(xs, [r["goodput"] for r in rows], marker="o", label=sweep_label(sweep, f"sweep {i + 1}"))
    ax.plot([0, top], [0, top], linestyle="--", color="gray", label="everything good (y = x)")
    if knee is not None and math.isfinite(knee):
        ax.axvline(knee, linestyle=":", color="red", label=f"predicted knee ({knee:.2f} req/s)")
    slo = (sweeps[0].get("meta") or {}).get("slo") or {}
    ax.set_title(title or f"goodput: TTFT <= {slo.get('ttft_ms')} ms and TPOT <= {slo.get('tpot_ms')} ms")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("goodput (req/s meeting both SLOs)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def format_sweep_table(sweep: dict[str, Any]) -> str:
    """A plain-text table: one line per rate."""
    slo = sweep["meta"]["slo"]
    head = (f"{'offered':>8}{'req/s':>8}{'goodput':>9}{'good':>7}{'reject':>7}{'errors':>7}"
            f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'KV util':>9}"
            f"{'KV frag':>9}")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    def frac(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    lines = [f"goodput sweep (goodput = offered x good fraction): TTFT <= {slo['ttft_ms']} ms, "
             f"TPOT <= {slo['tpot_ms']} ms; "
             "rates in req/s, latencies in ms", head, "-" * len(head)]
    for r in sweep["rates"]:
        lines.append(
            f"{r['offered_rate']:>8.2f}{r['request_throughput']:>8.2f}{r['goodput']:>9.2f}"
            f"{frac(r['good_fraction']):>7}{r['rejected']:>7}{r['failed_other']:>7}"
            f"{ms(r['ttft_ms']['p50']):>10}{ms(r['ttft_ms']['p99']):>10}"
            f"{ms(r['tpot_ms']['p50']):>10}{ms(r['tpot_ms']['p99']):>10}"
            + _kv_cells(r.get("kv")))
    return "\n".join(lines)


def _kv_cells(kv: dict[str, Any] | None) -> str:
    """Mean KV utilisation and fragmentation of one rate's run ('-' without fitserve gauges);
    a fragmentation >= 5% is marked '!'."""
    if kv is None:
        return f"{'-':>9}{'-':>9}"
    flag = "!" if kv["fragmentation_flag"] else ""
    return f"{kv['utilization_mean']:>9.1%}{format(kv['fragmentation'], '.1%') + flag:>9}"
