"""`fitserve plan`: the command line of the planner (rich tables, --explain, --json).

The lead wires ``add_plan_parser`` and ``run_plan`` into fitserve/cli/main.py; this module also runs
on its own: ``python -m fitserve.tools.planner.cli MODEL --gpu h100 ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from fitserve.ledger.errors import PlanError
from fitserve.ledger.units import parse_bytes, parse_tokens
from fitserve.tools.planner.report import ENGINE_DEFAULTS, MODEL_CONTEXT, PlanRequest, Section
from fitserve.tools.planner.sections_run import Plan, build_plan
from fitserve.tools.planner.speculative import check_speculative


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command to an argparse ``subparsers`` object and return it."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan", help="memory, speed and energy ledger for a model on a machine",
        description="Plan a model on a machine, line by line. Context suffixes k/m mean x1024.",
        epilog=_tools_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run_plan)
    return p


def _tools_epilog() -> str:
    from fitserve.tools.planner.sheet_index import TOOLS

    rows = "\n".join(f"  plan {name:<9} {help_}" for name, (_, help_) in TOOLS.items())
    return f"other planner sheets (each with --help, --json, --explain):\n{rows}"


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="catalog name, a config.json (or its folder), or a .gguf file")
    p.add_argument("--gpu", default="h100", help="accelerator from the catalog, or 'cpu'")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: --tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--context", default=None,
                   help="tokens per sequence; 128k = 131,072 (default: the model's own context, "
                        "a GGUF's context_length or a config's max_position_embeddings, as the "
                        "engine's --max-model-len defaults)")
    p.add_argument("--weights", default=None,
                   help="bf16, fp8, int8, int4-g128, Q4_K_M ... (default: the checkpoint's). "
                        "On cpu the engine's --weights: as-stored (the default: GGUF "
                        "Q4_0/Q4_1/Q8_0 held packed), int4, int8 (RTN at load), bf16, float32")
    p.add_argument("--kv", default=None,
                   help="KV format: bf16, f16, fp8 (a scale per layer), int8, int8-kc, "
                        "fp8_e4m3[-kc], fp8_e5m2[-kc] (the engine's --kv-cache-dtype X with "
                        "--kv-cache-scales token is X, channel-key is X-kc; default: model)")
    p.add_argument("--concurrency", type=int, default=1, help="sequences at once")
    # The engine's knobs: same names and defaults as `fitserve generate/serve` (EngineConfig).
    p.add_argument("--dtype", default=ENGINE_DEFAULTS.dtype,
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="model dtype, as the engine's --dtype (auto: bf16 on GPUs; on cpu bf16 "
                        "where the CPU has AVX512-BF16/AMX, else float32)")
    p.add_argument("--block-size", type=int, default=ENGINE_DEFAULTS.cache.block_size)
    p.add_argument("--num-kv-blocks", type=int, default=ENGINE_DEFAULTS.cache.num_kv_blocks,
                   help="fix the KV pool at this many blocks")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size, e.g. 512M or 2G (default: 1 GiB on cpu, what is left "
                        "on a GPU)")
    p.add_argument("--memory-utilization", type=float,
                   default=ENGINE_DEFAULTS.cache.gpu_memory_utilization)
    p.add_argument("--max-num-batched-tokens", default=str(ENGINE_DEFAULTS.scheduler.max_num_batched_tokens),
                   help="step token budget")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"default: the engine's {ENGINE_DEFAULTS.scheduler.max_num_seqs}, or --concurrency "
                        "if larger")
    p.add_argument("--workspace-gib", type=float, default=None,
                   help="workspace / CUDA-graph reserve (default 1 GiB on GPUs, 0 on cpu)")
    p.add_argument("--gpu-memory", default=None,
                   help="what-if: memory per device instead of the catalog's, e.g. 24G (binary "
                        "units, as --kv-cache-memory) or 24e9")
    p.add_argument("--gpu-bandwidth", default=None,
                   help="what-if: memory bandwidth per device in B/s, e.g. 1e12 or 1T (decimal)")
    # NOTE: kept so that old command lines still run; a context past the model's trained
    # maximum is always planned now, with a HYPOTHETICAL warning.
    p.add_argument("--allow-longer-context", action="store_true",
                   help="no longer needed: longer contexts are planned with a warning")
    p.add_argument("--share", type=int, default=1,
                   help="price KV sharing: this many sequences (n samples or beams) over one prompt")
    p.add_argument("--prompt-tokens", default=None,
                   help="with --share: the shared prompt's tokens (default: context - new tokens)")
    p.add_argument("--new-tokens", default=None,
                   help="with --share: tokens each sequence generates (default 0)")
    p.add_argument("--speculative", default=None, metavar="K,ALPHA,DRAFT_COST",
                   help="price speculative decoding: K draft tokens per verification, each "
                        "accepted with probability ALPHA, a draft step costing DRAFT_COST target "
                        "decode steps (0 for n-gram lookup), e.g. 4,0.7,0.05")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="a TPOT target: the step-time model's prompt tokens per step beside "
                        "--concurrency decodes, and (with --new-tokens) the request rate it sustains")
    p.add_argument("--input-len", type=int, default=128,
                   help="workload section: prompt tokens per request (vllm bench throughput's "
                        "--input-len; default 128, bench_engine.py's W2)")
    p.add_argument("--output-len", type=int, default=128,
                   help="workload section: tokens each request generates (default 128)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="workload section: requests at once for the batched line (default 32, "
                        "bench_engine.py's W2); the other line is one request alone")
    p.add_argument("--explain", action="store_true", help="show the arithmetic of each line")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    if args.share < 1:
        raise PlanError(f"--share must be >= 1 (sequences over one prompt), got {args.share}")
    ws = None if args.workspace_gib is None else int(args.workspace_gib * (1 << 30))
    return PlanRequest(
        model=args.model, gpu=args.gpu, gpus=args.gpus or args.tp, tp=args.tp,
        context=MODEL_CONTEXT if args.context is None else parse_tokens(args.context),
        context_text="" if args.context is None else args.context, weights=args.weights,
        kv=args.kv, concurrency=args.concurrency, block_size=args.block_size,
        memory_utilization=args.memory_utilization,
        max_num_batched_tokens=parse_tokens(args.max_num_batched_tokens),
        max_num_seqs=args.max_num_seqs, workspace_bytes=ws, dtype=args.dtype,
        kv_cache_memory_bytes=None if args.kv_cache_memory is None
        else parse_bytes(args.kv_cache_memory), num_kv_blocks=args.num_kv_blocks,
        gpu_memory_bytes=None if args.gpu_memory is None else _parse_size(args.gpu_memory),
        gpu_bandwidth=None if args.gpu_bandwidth is None else _parse_rate(args.gpu_bandwidth),
        share=args.share, new_tokens=0 if args.new_tokens is None else parse_tokens(args.new_tokens),
        prompt_tokens=None if args.prompt_tokens is None else parse_tokens(args.prompt_tokens),
        speculative=None if args.speculative is None else parse_speculative(args.speculative),
        slo_tpot_ms=args.slo_tpot_ms, input_len=args.input_len, output_len=args.output_len,
        batch_size=args.batch_size)


def parse_speculative(text: str) -> tuple[int, float, float]:
    """``--speculative K,ALPHA,DRAFT_COST``: "4,0.7,0.05" -> (4, 0.7, 0.05), validated (k an
    integer >= 1, 0 <= alpha <= 1, draft_cost >= 0); PlanError naming the flag otherwise."""
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) != 3:
            raise ValueError
        k, alpha, cost = int(parts[0]), float(parts[1]), float(parts[2])
    except ValueError:
        raise PlanError(f"--speculative takes K,ALPHA,DRAFT_COST: an integer and two numbers "
                        f"(e.g. 4,0.7,0.05), got {text!r}") from None
    try:
        check_speculative(k, alpha, cost)
    except PlanError as e:
        raise PlanError(f"--speculative {text}: {e}") from None
    return k, alpha, cost


def _parse_size(text: str) -> int:
    """Bytes: a plain number ("24e9", "24000000000") or a binary size as parse_bytes ("24G")."""
    try:
        return int(float(text))
    except (ValueError, OverflowError):
        return parse_bytes(text)


_RATE_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def _parse_rate(text: str) -> float:
    """Bytes per second with decimal units, as spec sheets quote them: "3.35T", "864G", "1e12"."""
    t = text.strip().lower().removesuffix("/s").removesuffix("b")
    try:
        if t and t[-1] in _RATE_UNITS:
            return float(t[:-1]) * _RATE_UNITS[t[-1]]
        return float(t)
    except ValueError:
        raise PlanError(f"not a bandwidth: {text!r} (e.g. 3.35T, 864G, 1e12 B/s)") from None


def print_sections(console: Any, sections: Sequence[Section], *, explain: bool) -> None:
    """Each section as a rich table (line, value, formula, --explain's arithmetic, and a miss
    column where a line misses), then its notes: `fitserve plan` and the toolbox sheets."""
    from rich.table import Table

    for sec in sections:
        table = Table(title=sec.title, title_justify="left", show_lines=False)
        table.add_column("line")
        table.add_column("value", justify="right")
        table.add_column("formula", style="dim")
        if explain:
            table.add_column("arithmetic", style="cyan")
        missing = any(line.miss for line in sec.lines)
        if missing:
            table.add_column("miss", style="red")
        for line in sec.lines:
            row = [line.name, f"MISS {line.shown}" if line.miss else line.shown, line.formula]
            row += [line.explain] if explain else []
            row += [line.miss] if missing else []
            table.add_row(*row, style="bold red" if line.miss else None)
        console.print(table)
        for note in sec.notes:
            console.print(f"  [dim]note:[/dim] {note}")


def render(plan: Plan, *, explain: bool) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    console.print(f"[bold]{plan.title}[/bold]")
    for w in plan.warnings:
        console.print(f"[bold yellow]{w}[/bold yellow]")
    print_sections(console, plan.sections, explain=explain)
    if plan.recommended_layout:
        console.print(f"[bold green]recommended layout: {plan.recommended_layout}[/bold green]")
    if plan.engine_cannot_run:
        console.print(f"[bold red]{escape(plan.engine_cannot_run)}[/bold red]", highlight=False)
    elif not plan.fits:
        console.print(f"[bold red]DOES NOT FIT[/bold red]: {escape(plan.verdict)}",
                      highlight=False)


def run_plan(args: argparse.Namespace) -> int:
    """Run ``fitserve plan``; returns the exit status.

    0: the plan fits. 1: it does not; every line is still printed (and in --json, with
    "fits": false, "shortfall_bytes", "misses" and "alternatives"), the verdict also on stderr.
    2: input that cannot be planned (unknown model or GPU, negative sizes, ...), with the reason.
    """
    try:
        plan = build_plan(request_from_args(args))
    except PlanError as e:
        print(f"fitserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(plan), indent=1, default=str))
    else:
        render(plan, explain=args.explain)
    if plan.engine_cannot_run:
        print(f"fitserve plan: {plan.engine_cannot_run}", file=sys.stderr)
        return 1
    if not plan.fits:
        print(f"fitserve plan: does not fit: {plan.verdict}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fitserve plan", description=__doc__, allow_abbrev=False)
    _add_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
