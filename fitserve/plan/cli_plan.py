"""`fitserve plan`: the command line of the planner (rich tables, --explain, --json).

The lead wires ``add_plan_parser`` and ``run_plan`` into fitserve/cli.py; this module also runs
on its own: ``python -m fitserve.plan.cli_plan MODEL --gpu h100 ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from fitserve.plan.errors import PlanError
from fitserve.plan.report import ENGINE_DEFAULTS, PlanRequest
from fitserve.plan.sections_run import Plan, build_plan
from fitserve.plan.units import parse_bytes, parse_tokens


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command to an argparse ``subparsers`` object and return it."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan", help="memory, speed and energy ledger for a model on a machine",
        description="Plan a model on a machine, line by line. Context suffixes k/m mean x1024.")
    _add_arguments(p)
    p.set_defaults(func=run_plan)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="catalog name, a config.json (or its folder), or a .gguf file")
    p.add_argument("--gpu", default="h100", help="accelerator from the catalog, or 'cpu'")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: --tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--context", default="8k", help="tokens per sequence; 128k = 131,072")
    p.add_argument("--weights", default=None,
                   help="bf16, fp8, int8, int4-g128, Q4_K_M ... (default: the checkpoint's; "
                        "on cpu the engine's --dtype, as the engine dequantizes on load)")
    p.add_argument("--kv", default=None, help="KV dtype: bf16, f16, fp8, int8 (default: model)")
    p.add_argument("--concurrency", type=int, default=1, help="sequences at once")
    # The engine's knobs: same names and defaults as `fitserve generate/serve` (EngineConfig).
    p.add_argument("--dtype", default=ENGINE_DEFAULTS.dtype,
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="model dtype, as the engine's --dtype (auto: bf16 on GPUs; on cpu bf16 "
                        "where the CPU has AVX512-BF16/AMX, else float32)")
    p.add_argument("--block-size", type=int, default=ENGINE_DEFAULTS.block_size)
    p.add_argument("--num-kv-blocks", type=int, default=ENGINE_DEFAULTS.num_kv_blocks,
                   help="fix the KV pool at this many blocks")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size, e.g. 512M or 2G (default: 1 GiB on cpu, what is left "
                        "on a GPU)")
    p.add_argument("--memory-utilization", type=float,
                   default=ENGINE_DEFAULTS.gpu_memory_utilization)
    p.add_argument("--max-num-batched-tokens", default=str(ENGINE_DEFAULTS.max_num_batched_tokens),
                   help="step token budget")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"default: the engine's {ENGINE_DEFAULTS.max_num_seqs}, or --concurrency "
                        "if larger")
    p.add_argument("--workspace-gib", type=float, default=None,
                   help="workspace / CUDA-graph reserve (default 1 GiB on GPUs, 0 on cpu)")
    p.add_argument("--allow-longer-context", action="store_true",
                   help="plan past the model's maximum context (labelled hypothetical)")
    p.add_argument("--explain", action="store_true", help="show the arithmetic of each line")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    ws = None if args.workspace_gib is None else int(args.workspace_gib * (1 << 30))
    return PlanRequest(
        model=args.model, gpu=args.gpu, gpus=args.gpus or args.tp, tp=args.tp,
        context=parse_tokens(args.context), context_text=args.context, weights=args.weights,
        kv=args.kv, concurrency=args.concurrency, block_size=args.block_size,
        memory_utilization=args.memory_utilization,
        max_num_batched_tokens=parse_tokens(args.max_num_batched_tokens),
        max_num_seqs=args.max_num_seqs, workspace_bytes=ws,
        allow_longer_context=args.allow_longer_context, dtype=args.dtype,
        kv_cache_memory_bytes=None if args.kv_cache_memory is None
        else parse_bytes(args.kv_cache_memory), num_kv_blocks=args.num_kv_blocks)


def render(plan: Plan, *, explain: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{plan.title}[/bold]")
    for w in plan.warnings:
        console.print(f"[bold yellow]{w}[/bold yellow]")
    for sec in plan.sections:
        table = Table(title=sec.title, title_justify="left", show_lines=False)
        table.add_column("line")
        table.add_column("value", justify="right")
        table.add_column("formula", style="dim")
        if explain:
            table.add_column("arithmetic", style="cyan")
        for line in sec.lines:
            row = [line.name, line.shown, line.formula]
            table.add_row(*(row + [line.explain] if explain else row))
        console.print(table)
        for note in sec.notes:
            console.print(f"  [dim]note:[/dim] {note}")
    if plan.recommended_layout:
        console.print(f"[bold green]recommended layout: {plan.recommended_layout}[/bold green]")


def run_plan(args: argparse.Namespace) -> int:
    """Run ``fitserve plan``; returns the exit status (2 on bad input, with the reason)."""
    try:
        plan = build_plan(request_from_args(args))
    except PlanError as e:
        print(f"fitserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(plan), indent=1, default=str))
    else:
        render(plan, explain=args.explain)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fitserve plan", description=__doc__)
    _add_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
