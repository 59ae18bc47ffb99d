"""``fitserve bench``: load-test any OpenAI-compatible endpoint and report TTFT/TPOT/goodput.

Examples::

    fitserve bench --concurrency 8 --num-requests 64 --prompt-len fixed:128 --output-len fixed:64
    fitserve bench --request-rate 2 --duration 60 --prompt-len chat --slo-ttft-ms 500 --slo-tpot-ms 50

A comma list of rates is a goodput sweep: one Poisson run per rate (``--num-requests`` and
``--duration`` per rate), a table of goodput vs offered load, the sweep's JSON and a PNG of
goodput vs offered load; ``--overlay`` draws earlier sweeps' JSON on the same plot::

    fitserve bench --request-rate 0.5,1,2,4 --duration 30 --num-requests 1000 \\
        --slo-ttft-ms 1000 --slo-tpot-ms 100 --label fcfs --output-json fcfs.json --output-png fcfs.png
    fitserve bench --request-rate 0.5,1,2,4 --duration 30 --num-requests 1000 \\
        --slo-ttft-ms 1000 --slo-tpot-ms 100 --label slo --output-json slo.json \\
        --output-png goodput.png --overlay fcfs.json --knee 2.6
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fitserve.tools.bench.workloads import Arrivals, LengthDist


@dataclass(slots=True)
class BenchConfig:
    """Everything one bench run needs (the CLI flags, as a record usable from scripts)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    api: str = "completions"
    api_key: str | None = None
    num_requests: int = 100
    duration_s: float | None = None
    warmup: int = 2
    concurrency: int | None = None
    request_rate: float | None = None
    arrival: str = "poisson"
    prompt_len: str = "fixed:128"
    output_len: str = "fixed:64"
    ignore_eos: bool = True
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    output_json: Path | None = None
    output_png: Path | None = None
    progress: bool = True
    label: str = ""

    def arrivals(self) -> Arrivals:
        if self.request_rate is not None:
            if self.request_rate <= 0:
                raise ValueError("--request-rate must be > 0")
            return Arrivals(self.arrival, rate=self.request_rate)
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        return Arrivals("concurrency", concurrency=self.concurrency or 1)


@dataclass(slots=True)
class _Prepared:
    """What one or more load runs of a config share: the endpoint, the workload, the lengths."""

    target: Any  # loadgen.Target (imported lazily: httpx is only needed to run)
    model: str
    workload: list[Any]  # workloads.BenchRequest
    prompt_len: LengthDist
    output_len: LengthDist


def _prepare(cfg: BenchConfig) -> _Prepared:
    from fitserve.tools.bench.loadgen import Target, discover_model
    from fitserve.tools.bench.workloads import make_workload

    prompt_len, output_len = LengthDist.parse(cfg.prompt_len), LengthDist.parse(cfg.output_len)
    model = cfg.model or asyncio.run(discover_model(cfg.base_url, cfg.api_key))
    target = Target(cfg.base_url, model, cfg.api, cfg.api_key, cfg.ignore_eos)
    workload = make_workload(cfg.warmup + cfg.num_requests, prompt_len, output_len, cfg.seed)
    return _Prepared(target, model, workload, prompt_len, output_len)


def _run_once(cfg: BenchConfig, prep: _Prepared, arrivals: Arrivals, workload: list[Any],
              desc: str) -> tuple[list[Any], float, dict[str, Any] | None]:
    """One load run; returns (RequestResult list, wall seconds, the server's KV utilisation
    and fragmentation over the run from its /metrics, None if it has no fitserve gauges)."""
    from tqdm.auto import tqdm

    from fitserve.tools.bench.kv_monitor import KVMonitor, metrics_url
    from fitserve.tools.bench.loadgen import RunLimits, run_load

    bar = tqdm(total=cfg.num_requests, desc=desc, unit="req", disable=not cfg.progress, file=sys.stderr)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    monitor = KVMonitor(metrics_url(cfg.base_url), headers).start()
    try:
        results, wall = asyncio.run(run_load(
            prep.target, workload, arrivals, RunLimits(cfg.num_requests, cfg.duration_s, cfg.warmup),
            seed=cfg.seed, on_done=lambda _r: bar.update(1),
        ))
    finally:
        kv = monitor.stop()
        bar.close()
    return results, wall, kv


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run one benchmark; write the JSON/PNG if asked; return the summary."""
    from fitserve.tools.bench.report import SLO, summarize, write_json, write_png

    arrivals = cfg.arrivals()
    prep = _prepare(cfg)
    results, wall, kv = _run_once(cfg, prep, arrivals, prep.workload, cfg.label or "bench")
    meta = {
        "label": cfg.label, "base_url": cfg.base_url, "model": prep.model, "api": cfg.api,
        "arrivals": {"mode": arrivals.mode, "rate": arrivals.rate, "concurrency": arrivals.concurrency},
        "prompt_len": str(prep.prompt_len), "output_len": str(prep.output_len), "warmup": cfg.warmup,
    }
    summary = summarize(results, wall, SLO(cfg.slo_ttft_ms, cfg.slo_tpot_ms), meta)
    summary["kv"] = kv
    if cfg.output_json is not None:
        write_json(summary, results, cfg.output_json)
    if cfg.output_png is not None:
        write_png(results, wall, cfg.output_png, title=f"{cfg.label or prep.model} · {arrivals.mode}")
    return summary


def run_sweep(cfg: BenchConfig, rates: Sequence[float], *, overlays: Sequence[dict[str, Any]] = (),
              knee: float | None = None) -> dict[str, Any]:
    """Run ``cfg``'s workload once per open-loop rate (req/s); write the JSON/PNG if asked.

    Each rate is a fresh :func:`run_load` with ``cfg.num_requests`` / ``cfg.duration_s``, the
    same seed (so the same lengths and the same Poisson gap pattern, scaled by 1 / rate) and
    its own prompt text (see :func:`sweep.retext_workload`). ``cfg.request_rate`` is ignored.
    The PNG also draws ``overlays`` (earlier sweeps) and a vertical line at ``knee`` (req/s).
    Returns ``{"kind", "meta", "rates": [per-rate row]}`` (see :mod:`fitserve.tools.bench.sweep`).
    """
    from fitserve.tools.bench.report import SLO
    from fitserve.tools.bench.sweep import (
        SWEEP_KIND,
        check_rates,
        rate_summary,
        retext_workload,
        write_goodput_png,
        write_sweep_json,
    )

    rates = check_rates(rates)
    slo = SLO(cfg.slo_ttft_ms, cfg.slo_tpot_ms)
    prep = _prepare(cfg)
    rows = []
    for i, rate in enumerate(rates):
        arrivals = replace(cfg, request_rate=rate).arrivals()
        workload = prep.workload if i == 0 else retext_workload(prep.workload, f"{cfg.seed}/{i}")
        results, wall, kv = _run_once(cfg, prep, arrivals, workload,
                                      f"{cfg.label or 'bench'} @ {rate:g} req/s")
        rows.append({**rate_summary(results, wall, slo, rate), "kv": kv})
    sweep = {
        "kind": SWEEP_KIND,
        "meta": {
            "label": cfg.label, "model": prep.model, "base_url": cfg.base_url, "api": cfg.api,
            "slo": {"ttft_ms": cfg.slo_ttft_ms, "tpot_ms": cfg.slo_tpot_ms},
            "workload": {
                "prompt_len": str(prep.prompt_len), "output_len": str(prep.output_len),
                "ignore_eos": cfg.ignore_eos, "arrival": cfg.arrival, "num_requests": cfg.num_requests,
                "duration_s": cfg.duration_s, "warmup": cfg.warmup, "seed": cfg.seed,
            },
        },
        "rates": rows,
    }
    if cfg.output_json is not None:
        write_sweep_json(sweep, cfg.output_json)
    if cfg.output_png is not None:
        write_goodput_png([sweep, *overlays], cfg.output_png, knee=knee)
    return sweep


def add_bench_parser(subparsers: Any) -> None:
    """Register ``fitserve bench`` on the CLI's subparsers."""
    p = subparsers.add_parser("bench", help="load-test an OpenAI-compatible endpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the endpoint's /v1 URL")
    p.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--duration", type=float, default=None, help="stop starting requests after this many s")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first and not recorded")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop with C clients (default 1)")
    load.add_argument("--request-rate", type=_rates_arg, default=None, metavar="R[,R2,...]",
                      help="open loop at R requests/s; a comma list sweeps the rates (goodput vs load)")
    p.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    p.add_argument("--prompt-len", default="fixed:128", help="fixed:N | uniform:LO:HI | chat[:MEDIAN:MAX]")
    p.add_argument("--output-len", default="fixed:64", help="fixed:N | uniform:LO:HI | chat[:MEDIAN:MAX]")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop early (output lengths then vary)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--output-json", type=Path, default=Path("bench-result.json"))
    p.add_argument("--output-png", type=Path, default=Path("bench-result.png"))
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--label", default="", help="the run's name (a sweep's legend entry)")
    p.add_argument("--overlay", type=Path, nargs="+", default=[], metavar="SWEEP.json",
                   help="a sweep: also plot these earlier sweeps' goodput curves")
    p.add_argument("--knee", type=float, default=None, metavar="REQ_PER_S",
                   help="a sweep: draw a vertical 'predicted knee' line at this rate")
    p.set_defaults(func=_cmd_bench)


def _rates_arg(text: str) -> list[float]:
    from fitserve.tools.bench.sweep import parse_rates

    try:
        return parse_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cmd_bench(args: argparse.Namespace) -> int:
    from fitserve.tools.bench.report import format_table

    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    rates: list[float] = args.request_rate or []
    if len(rates) < 2 and (args.overlay or args.knee is not None):
        raise ValueError("--overlay and --knee draw a goodput sweep: give --request-rate 2+ rates (R1,R2,...)")
    cfg = BenchConfig(
        base_url=args.base_url, model=args.model, api=args.api, api_key=args.api_key,
        num_requests=args.num_requests, duration_s=args.duration, warmup=args.warmup,
        concurrency=args.concurrency, request_rate=rates[0] if len(rates) == 1 else None,
        arrival=args.arrival, prompt_len=args.prompt_len, output_len=args.output_len,
        ignore_eos=args.ignore_eos, seed=args.seed, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms, output_json=args.output_json, output_png=args.output_png,
        progress=args.progress, label=args.label,
    )
    if len(rates) > 1:
        return _cmd_sweep(cfg, rates, args.overlay, args.knee)
    import httpx

    try:
        summary = run_bench(cfg)
    except (OSError, httpx.HTTPError) as exc:  # connection refused & co.
        raise ValueError(f"cannot reach {cfg.base_url}: {exc}") from None
    print(format_table(summary))
    print(f"wrote {cfg.output_json} and {cfg.output_png}")
    return 0 if summary["completed"] else 1


def _cmd_sweep(cfg: BenchConfig, rates: list[float], overlay_paths: list[Path], knee: float | None) -> int:
    import httpx

    from fitserve.tools.bench.sweep import format_sweep_table, load_sweep

    overlays = [load_sweep(p) for p in overlay_paths]  # fail on a bad file before the long run
    try:
        sweep = run_sweep(cfg, rates, overlays=overlays, knee=knee)
    except (OSError, httpx.HTTPError) as exc:  # connection refused & co.
        raise ValueError(f"cannot reach {cfg.base_url}: {exc}") from None
    print(format_sweep_table(sweep))
    for row in sweep["rates"]:
        for e in row["errors"]:
            print(f"error at {row['offered_rate']:g} req/s: {e}")
    print(f"wrote {cfg.output_json} and {cfg.output_png}")
    return 0 if any(row["completed"] for row in sweep["rates"]) else 1
