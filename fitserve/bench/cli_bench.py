"""``fitserve bench``: load-test any OpenAI-compatible endpoint and report TTFT/TPOT/goodput.

Examples::

    fitserve bench --concurrency 8 --num-requests 64 --prompt-len fixed:128 --output-len fixed:64
    fitserve bench --request-rate 2 --duration 60 --prompt-len chat --slo-ttft-ms 500 --slo-tpot-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitserve.bench.workloads import Arrivals, LengthDist


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


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run one benchmark; write the JSON/PNG if asked; return the summary."""
    from tqdm.auto import tqdm

    from fitserve.bench.loadgen import RunLimits, Target, discover_model, run_load
    from fitserve.bench.report import SLO, summarize, write_json, write_png
    from fitserve.bench.workloads import make_workload

    arrivals = cfg.arrivals()
    prompt_len, output_len = LengthDist.parse(cfg.prompt_len), LengthDist.parse(cfg.output_len)
    model = cfg.model or asyncio.run(discover_model(cfg.base_url, cfg.api_key))
    target = Target(cfg.base_url, model, cfg.api, cfg.api_key, cfg.ignore_eos)
    workload = make_workload(cfg.warmup + cfg.num_requests, prompt_len, output_len, cfg.seed)
    bar = tqdm(total=cfg.num_requests, desc=cfg.label or "bench", unit="req", disable=not cfg.progress,
               file=sys.stderr)
    try:
        results, wall = asyncio.run(run_load(
            target, workload, arrivals, RunLimits(cfg.num_requests, cfg.duration_s, cfg.warmup),
            seed=cfg.seed, on_done=lambda _r: bar.update(1),
        ))
    finally:
        bar.close()
    meta = {
        "label": cfg.label, "base_url": cfg.base_url, "model": model, "api": cfg.api,
        "arrivals": {"mode": arrivals.mode, "rate": arrivals.rate, "concurrency": arrivals.concurrency},
        "prompt_len": str(prompt_len), "output_len": str(output_len), "warmup": cfg.warmup,
    }
    summary = summarize(results, wall, SLO(cfg.slo_ttft_ms, cfg.slo_tpot_ms), meta)
    if cfg.output_json is not None:
        write_json(summary, results, cfg.output_json)
    if cfg.output_png is not None:
        write_png(results, wall, cfg.output_png, title=f"{cfg.label or model} · {arrivals.mode}")
    return summary


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
    load.add_argument("--request-rate", type=float, default=None, help="open loop at R requests/s")
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
    p.add_argument("--label", default="")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from fitserve.bench.report import format_table

    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    cfg = BenchConfig(
        base_url=args.base_url, model=args.model, api=args.api, api_key=args.api_key,
        num_requests=args.num_requests, duration_s=args.duration, warmup=args.warmup,
        concurrency=args.concurrency, request_rate=args.request_rate, arrival=args.arrival,
        prompt_len=args.prompt_len, output_len=args.output_len, ignore_eos=args.ignore_eos,
        seed=args.seed, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        output_json=args.output_json, output_png=args.output_png, progress=args.progress,
        label=args.label,
    )
    import httpx

    try:
        summary = run_bench(cfg)
    except (OSError, httpx.HTTPError) as exc:  # connection refused & co.
        raise ValueError(f"cannot reach {cfg.base_url}: {exc}") from None
    print(format_table(summary))
    print(f"wrote {cfg.output_json} and {cfg.output_png}")
    return 0 if summary["completed"] else 1
