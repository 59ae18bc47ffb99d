"""``fitserve profile``: run a workload on the engine offline and report where the time goes.

Examples::

    fitserve profile --workload W1 --output-dir prof-w1
    fitserve profile --num-prompts 8 --input-len 512 --output-len 64 --trace-steps 16
    fitserve profile --workload calibrate            # fit and save the step-time model
    fitserve profile --workload W2 --json > w2.json

Writes into ``--output-dir``: ``trace.json`` (torch.profiler, opens in ui.perfetto.dev),
``ops.csv``, ``ops_by_shape.csv``, ``shapes.csv`` and ``summary.json`` (everything; ``--json``
prints it instead of the tables). ``--workload calibrate`` writes ``summary.json``,
``steps.csv`` and ``step_model.json`` there, and saves the model under
``$FITSERVE_HOME/step-models`` for ``--scheduling-policy slo``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitserve.engine.args import add_engine_args, engine_config_from_args

if TYPE_CHECKING:
    from fitserve.engine.calibrate import Calibration
    from fitserve.engine.core import Engine
    from fitserve.tools.profile.workloads import Workload

WORKLOADS = ("W1", "W2", "calibrate")
CUSTOM_DEFAULTS = {"num_prompts": 1, "input_len": 32, "output_len": 128}
TOP_OPS_PRINTED = 15


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v
    return parse


def add_profile_parser(subparsers: Any) -> None:
    """Register ``fitserve profile`` on the CLI's subparsers."""
    p = subparsers.add_parser("profile", help="profile the engine on a workload; fit the step-time model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="W1: 1 x 32-token prompt x 128 tokens; W2: 32 x 128 x 128; calibrate: time a "
                        "sweep of step shapes and fit t = a + b*new_tokens + c*seqs + d*kv_tokens_read "
                        "(default: the --num-prompts/--input-len/--output-len workload)")
    p.add_argument("--num-prompts", type=_count(1), default=None, help="requests (default 1)")
    p.add_argument("--input-len", type=_count(1), default=None, help="prompt tokens each (default 32)")
    p.add_argument("--output-len", type=_count(1), default=None, help="new tokens each (default 128)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths then vary)")
    p.add_argument("--output-dir", type=Path, default=Path("fitserve-profile"))
    p.add_argument("--trace-steps", type=_count(0), default=24,
                   help="engine steps in the profiled window (0: no trace and no op tables)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    p.add_argument("--quick", action="store_true", help="calibrate: the short sweep (as at engine start)")
    p.add_argument("--json", action="store_true", help="print summary.json to stdout instead of tables")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    p.set_defaults(func=_cmd_profile)


def resolve_workload(args: argparse.Namespace) -> Workload | None:
    """The workload the flags name (None: calibrate); mixing --workload with the custom flags
    is an error naming them."""
    from fitserve.tools.profile.workloads import NAMED_WORKLOADS, Workload

    custom = {k: getattr(args, k) for k in CUSTOM_DEFAULTS if getattr(args, k) is not None}
    if args.workload is not None and custom:
        flags = ", ".join("--" + k.replace("_", "-") for k in custom)
        raise ValueError(f"{flags} describe a custom workload; leave out --workload {args.workload}")
    if args.workload == "calibrate":
        return None
    if args.workload is not None:
        w = NAMED_WORKLOADS[args.workload]
        return w if args.ignore_eos else Workload(w.name, w.num_prompts, w.input_len, w.output_len, False)
    v = {**CUSTOM_DEFAULTS, **custom}
    return Workload("custom", v["num_prompts"], v["input_len"], v["output_len"], args.ignore_eos)


def prepare_output_dir(path: Path) -> Path:
    """Create ``path`` and check that files can be written there (a ValueError naming it if not)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".fitserve-profile-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--output-dir {path} is not a writable directory: {exc.strerror or exc}") from None
    return path


def engine_info(engine: Engine) -> dict[str, Any]:
    """What the numbers depend on: model, formats, limits, device, threads, CPU."""
    import torch

    from fitserve.engine.calibrate import cpu_model_name

    cfg = engine.config
    loaded = getattr(engine, "loaded", None)
    return {"model": str(loaded.path) if loaded is not None else cfg.model,
            "name": engine.spec.name, "weights": engine.weights_choice,
            "dtype": str(engine.dtype).removeprefix("torch."), "kv_cache_dtype": cfg.cache.kv_cache_dtype,
            "block_size": cfg.cache.block_size, "max_num_seqs": cfg.scheduler.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "max_model_len": engine.max_model_len, "num_kv_blocks": engine.pool.num_blocks,
            "enable_prefix_caching": cfg.cache.enable_prefix_caching,
            "device": str(engine.device), "threads": torch.get_num_threads(), "cpu": cpu_model_name()}


def _cmd_profile(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    workload = resolve_workload(args)
    out_dir = prepare_output_dir(args.output_dir)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from fitserve.engine.core import Engine

    print(f"loading {args.model} ...", file=sys.stderr)
    engine = Engine(engine_config_from_args(args))
    if workload is None:
        summary, text = profile_calibration(engine, out_dir, quick=args.quick)
    else:
        summary, text = profile_workload(engine, workload, out_dir, trace_steps=args.trace_steps,
                                         seed=args.seed)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1) if args.json else text)
    return 0


def profile_workload(engine: Engine, workload: Workload, out_dir: Path, *, trace_steps: int,
                     seed: int) -> tuple[dict[str, Any], str]:
    """Warm-up, the timed run, the profiled window; write the CSV and trace files; the
    summary (JSON-ready) and the printed tables."""
    from fitserve.tools.profile import report
    from fitserve.tools.profile.trace import OpRow, OpShapeRow, profile_window
    from fitserve.tools.profile.workloads import random_prompts, run_workload, warm_up

    prompts = random_prompts(workload.num_prompts, workload.input_len, engine.spec.vocab_size, seed)
    print(f"profiling {workload.describe()} ...", file=sys.stderr)
    warm_up(engine)
    engine.reset_prefix_cache()
    run = run_workload(engine, workload, prompts)
    lat = report.latency_summary(run.requests)
    shapes = report.shape_rows(run.steps)
    report.write_csv(out_dir / "shapes.csv", shapes, report.ShapeRow)
    files = ["shapes.csv", "summary.json"]
    trace = None
    if trace_steps:
        trace = profile_window(engine, workload, prompts, trace_steps, out_dir / "trace.json")
        report.write_csv(out_dir / "ops.csv", trace.ops, OpRow)
        report.write_csv(out_dir / "ops_by_shape.csv", trace.ops_by_shape, OpShapeRow)
        files += ["trace.json", "ops.csv", "ops_by_shape.csv"]
    method = (f"one untimed warm-up run (2 x 16-token prompts, 4 new tokens), then the timed run: every "
              f"request added at once, each token stamped when its step returns; step times are whole "
              f"Engine.step wall times (engine.step_log), grouped by power-of-two shape class with "
              f"medians and p90s; {run.threads} torch threads (torch.get_num_threads()); "
              + (f"trace and op tables from a separate profiled pass over the first {trace.steps} steps "
                 f"of the same workload (profiler overhead kept out of the timings)" if trace else
                 "no profiled pass (--trace-steps 0)"))
    summary: dict[str, Any] = {
        "kind": "fitserve-profile", "version": 1, "workload": workload, "engine": engine_info(engine),
        "method": method, "latency_ms": lat, "utilisation": report.utilisation(run),
        "throughput": report.throughput(run), "steps_by_shape": shapes,
        "trace": None if trace is None else {"path": trace.trace_path, "steps": trace.steps,
                                             "step_records": trace.step_records,
                                             "top_ops": trace.ops[:TOP_OPS_PRINTED]},
        "output_dir": out_dir, "files": files,
    }
    summary = report.to_jsonable(summary)
    return summary, _workload_text(summary, shapes, lat, trace)


def _workload_text(summary: dict[str, Any], shapes: list[Any], lat: dict[str, Any], trace: Any) -> str:
    from fitserve.tools.profile import report
    u, t = summary["utilisation"], summary["throughput"]
    parts = [f"fitserve profile: {summary['workload']['name']} on {summary['engine']['name']} "
             f"({summary['engine']['weights']}, {summary['engine']['dtype']}, "
             f"{summary['engine']['threads']} threads, {summary['engine']['cpu']})",
             f"method: {summary['method']}", "",
             "per-token latency (ms)", report.latency_table(lat), "",
             "steps by shape", report.shape_table(shapes), "",
             f"run: {u['wall_s']:.2f} s wall, {t['steps']} steps, {t['output_tokens_per_s']:.1f} output "
             f"tok/s; step_busy_share {u['step_busy_share']:.1%}, cpu_utilization "
             f"{u['cpu_utilization']:.1%} of {u['threads']} threads"]
    if trace is not None:
        parts += ["", f"top ops by self CPU time ({trace.steps} profiled steps)",
                  report.format_table(["op", "calls", "self ms", "ms/step", "share"],
                                      [(r.op, r.calls, r.self_cpu_ms, r.self_cpu_ms_per_step,
                                        f"{r.share:.1%}") for r in trace.ops[:TOP_OPS_PRINTED]])]
    parts += ["", f"files in {summary['output_dir']}: " + ", ".join(summary["files"])]
    return "\n".join(parts)


def profile_calibration(engine: Engine, out_dir: Path, *, quick: bool) -> tuple[dict[str, Any], str]:
    """Calibrate the step-time model, save it for this engine and into ``out_dir``; the
    summary (JSON-ready) and the printed text."""
    from fitserve.engine.calibrate import calibration_meta, run_calibration, save_calibration
    from fitserve.ledger.step_time import save_step_model

    print(f"calibrating the step-time model ({'quick' if quick else 'full'} sweep) ...", file=sys.stderr)
    t0 = time.perf_counter()
    cal = run_calibration(engine, quick=quick)
    saved = save_calibration(engine, cal)
    save_step_model(cal.model, out_dir / "step_model.json", error=cal.error, meta=calibration_meta(engine, cal))
    _write_steps_csv(out_dir / "steps.csv", cal)
    from fitserve.tools.profile import report
    summary: dict[str, Any] = report.to_jsonable({
        "kind": "fitserve-profile-calibrate", "version": 1, "engine": engine_info(engine),
        "method": "a sweep of step shapes (prompt chunks, decode batches at short and long context, "
                  "chunks after a cached prefix, decodes plus a chunk) after an untimed warm-up; every "
                  "4th step held out; non-negative least squares on relative error of whole step times",
        "model": cal.model.to_dict(), "describe": cal.model.describe(), "held_out_error": cal.error,
        "fitted_steps": len(cal.fitted), "held_out_steps": len(cal.held_out),
        "calibration_seconds": cal.seconds, "wall_s": time.perf_counter() - t0, "quick": quick,
        "saved_to": saved, "output_dir": out_dir, "files": ["steps.csv", "step_model.json", "summary.json"],
    })
    text = "\n".join([
        f"step-time model of {summary['engine']['name']} ({summary['engine']['threads']} threads, "
        f"{summary['engine']['cpu']}), {len(cal.fitted)} steps fitted in {cal.seconds:.1f} s:",
        f"  {cal.model.describe()}", f"  held out: {cal.error.describe()}", f"  saved to {saved}"])
    return summary, text


def _write_steps_csv(path: Path, cal: Calibration) -> None:
    import csv

    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["new_tokens", "seqs", "kv_tokens_read", "seconds", "predicted_seconds", "held_out"])
        for held, samples in ((False, cal.fitted), (True, cal.held_out)):
            for s in samples:
                w.writerow([s.shape.new_tokens, s.shape.seqs, s.shape.kv_tokens_read, f"{s.seconds:.6g}",
                            f"{cal.model.predict_shape(s.shape):.6g}", int(held)])
