"""Goodput vs offered load: `fitserve serve` with FCFS scheduling and with SLO-aware scheduling.

    .venv/bin/python benchmarks/bench_slo.py [--rates 0.5,1,2,3,4] [--duration 40] \\
        [--slo-ttft-ms 1000] [--slo-tpot-ms 100] [--prompt-len 128] [--output-len 64] \\
        [--policies fcfs,slo] [--slo-action reject] [--out-dir bench-slo-results]

What it does: starts `fitserve serve` on 127.0.0.1 once per policy (the default model, the same
flags each time; `--scheduling-policy fcfs`, then `--scheduling-policy slo --slo-ttft-ms T1
--slo-tpot-ms T2 --slo-action A`), and on each runs the same open-loop Poisson sweep: for every
rate, `--duration` seconds of requests of fixed prompt and output lengths (ignore_eos, greedy),
a fresh load run per rate (`fitserve bench --request-rate R1,R2,...`, see fitserve.tools.bench.sweep).

What it measures, per rate and policy: the **goodput**, requests per second that met both
targets (TTFT <= T1 and TPOT <= T2; offered rate x the fraction of requests that did, so the
drain after the last arrival does not count against it), that fraction, how many requests the
slo server turned away (HTTP 429 with Retry-After: predicted to miss their TTFT; never good),
and TTFT/TPOT p99.

How to read it: below capacity both policies serve everything and goodput = offered load (the
y = x line of the PNG). Past the knee FCFS admits every request, queues grow, TTFT and then TPOT
blow past the targets and its goodput *falls* with load; the SLO policy rejects the requests it
predicts would miss, so the ones it admits stay within target and its goodput should stay near
the knee instead of collapsing. The predicted knee is `fitserve.ledger.step_time.predicted_knee`
of the step-time model the slo server uses (measured first by `fitserve profile --workload
calibrate` with the servers' engine flags, or `--step-model`); the measured knee is the highest offered rate at which FCFS
goodput is >= 90% of the offered load. Their agreement is a check of the step-time model.

Outputs in --out-dir: one sweep JSON per policy (`fitserve bench --overlay` reads them), the
combined `bench-slo.json`, `goodput.png` with all curves and the predicted knee, server logs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

from bench_serving import _free_port, _server

from fitserve.tools.bench.cli import BenchConfig, run_sweep
from fitserve.tools.bench.sweep import measured_knee, parse_rates, write_goodput_png

POLICIES = ("fcfs", "slo")


def cpu_description() -> str:
    """CPU model, torch's ISA level and the AMX / AVX-512 flags of /proc/cpuinfo."""
    import torch

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    isa = [f for f in sorted(flags) if f.startswith(("amx", "avx512"))]
    return (f"CPU: {model}; {torch.get_num_threads()} torch threads; "
            f"torch ISA: {torch.backends.cpu.get_cpu_capability()}; "
            f"amx/avx512 flags: {' '.join(isa) or 'none'}")


def predicted_knee_of(path: Path, args: argparse.Namespace) -> float | None:
    """``predicted_knee`` of the step-time model in ``path`` for this benchmark's requests."""
    from fitserve.ledger.errors import PlanError
    from fitserve.ledger.step_time import load_step_model, predicted_knee

    try:
        model = load_step_model(path)
    except PlanError as exc:
        print(f"no predicted knee: {exc}", file=sys.stderr)
        return None
    print(f"step-time model {path}: {model.describe()}")
    return predicted_knee(model, prompt_tokens=args.prompt_len, output_tokens=args.output_len,
                          tpot_s=args.slo_tpot_ms / 1000)


def calibrate(args: argparse.Namespace) -> Path:
    """Measure the step-time model the slo server will use: `fitserve profile --workload
    calibrate` with the servers' engine flags; prints its held-out error; returns the file."""
    import subprocess

    out = args.out_dir / "calibrate"
    cmd = [sys.executable, "-m", "fitserve.cli", "profile", "--workload", "calibrate", "--model", args.model,
           "--max-model-len", str(args.max_model_len), "--output-dir", str(out), *args.serve_arg]
    print("calibrating:", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    summary = json.loads((out / "summary.json").read_text())
    err = summary["held_out_error"]
    print(f"held-out error of the step-time model ({summary['held_out_steps']} steps): median "
          f"{err['median_rel']:.1%}, p90 {err['p90_rel']:.1%}, max {err['max_rel']:.1%}", flush=True)
    return out / "step_model.json"


def server_command(policy: str, port: int, args: argparse.Namespace) -> list[str]:
    """`fitserve serve` for one policy; every other flag is the same for all policies."""
    cmd = [sys.executable, "-m", "fitserve.cli", "serve", "--port", str(port), "--model", args.model,
           "--max-model-len", str(args.max_model_len), "--log-level", "warning",
           "--scheduling-policy", policy, *args.serve_arg]
    if policy == "slo":
        cmd += ["--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}",
                "--slo-action", args.slo_action, "--step-model", str(args.step_model)]
    return cmd


def run_policy(policy: str, rates: list[float], args: argparse.Namespace) -> dict[str, Any]:
    """Start the server for ``policy`` and sweep the rates on it."""
    port = _free_port()
    out_json = args.out_dir / f"{policy}.json"
    # NOTE: enough requests that --duration, not --num-requests, ends each rate's run
    most = max(int(max(rates) * args.duration * 2) + 20, args.min_requests)
    cfg = BenchConfig(
        base_url=f"http://127.0.0.1:{port}/v1", model=None, num_requests=most, duration_s=args.duration,
        warmup=args.warmup, arrival="poisson", prompt_len=f"fixed:{args.prompt_len}",
        output_len=f"fixed:{args.output_len}", ignore_eos=True, seed=args.seed,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, output_json=out_json,
        output_png=args.out_dir / f"{policy}.png", label=policy,
    )
    with _server(server_command(policy, port, args), f"http://127.0.0.1:{port}/health",
                 args.out_dir / f"{policy}.log"):
        return run_sweep(cfg, rates)  # writes its JSON (an --overlay input) and its own PNG


def comparison_table(sweeps: dict[str, dict[str, Any]]) -> str:
    """rate | goodput | good % | rejected | TTFT p99 | TPOT p99, each metric once per policy."""
    metrics = [("goodput", "goodput", "{:.2f}"), ("good%", "good_fraction", "{:.0%}"),
               ("rejected", "rejected", "{}"), ("TTFT p99", "ttft_ms", "{:.0f}"),
               ("TPOT p99", "tpot_ms", "{:.0f}")]
    cols = [(f"{name} {title}", name, key, fmt) for title, key, fmt in metrics for name in sweeps]
    widths = [max(len(head) + 2, 9) for head, *_ in cols]
    head = f"{'rate':>6}" + "".join(f"{c[0]:>{w}}" for c, w in zip(cols, widths, strict=True))
    lines = ["rates in req/s (goodput: req/s meeting both targets), latencies in ms", head, "-" * len(head)]
    by_rate = {name: {r["offered_rate"]: r for r in s["rates"]} for name, s in sweeps.items()}
    for rate in sorted({rate for rows in by_rate.values() for rate in rows}):
        cells = []
        for (_, name, key, fmt), w in zip(cols, widths, strict=True):
            row = by_rate[name].get(rate)
            v = None if row is None else row[key]
            if isinstance(v, dict):
                v = v["p99"]  # ttft_ms / tpot_ms percentiles
            cells.append(f"{'-' if v is None else fmt.format(v):>{w}}")
        lines.append(f"{rate:>6.2f}" + "".join(cells))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=parse_rates, default=parse_rates("0.5,1,2,3,4"), help="req/s, comma list")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests per rate")
    p.add_argument("--warmup", type=int, default=2, help="unrecorded requests before each rate")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--slo-action", choices=["reject", "deprioritize"], default="reject")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list of fcfs | priority | slo")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more `fitserve serve` flag for every server (repeat; e.g. --serve-arg=--dtype=float32)")
    p.add_argument("--step-model", type=Path, default=None,
                   help="step-time model JSON the slo server uses and the predicted knee comes "
                        "from (default: measured first with fitserve profile --workload calibrate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("bench-slo-results"))
    args = p.parse_args()
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if not policies or any(x not in ("fcfs", "priority", "slo") for x in policies):
        p.error(f"--policies: a comma list of fcfs, priority, slo; got {args.policies!r}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(cpu_description())
    print(f"{args.model}: prompt {args.prompt_len} tokens, {args.output_len} output tokens (ignore_eos), "
          f"Poisson arrivals for {args.duration:g} s per rate; SLO TTFT <= {args.slo_ttft_ms:g} ms, "
          f"TPOT <= {args.slo_tpot_ms:g} ms", flush=True)

    if args.step_model is None:
        args.step_model = calibrate(args)
    knee = predicted_knee_of(args.step_model, args)
    print(f"predicted knee at TPOT {args.slo_tpot_ms:g} ms: "
          f"{'n/a' if knee is None else f'{knee:.2f} req/s'}", flush=True)
    sweeps: dict[str, dict[str, Any]] = {}
    for policy in policies:
        sweeps[policy] = run_policy(policy, args.rates, args)
    step_model = args.step_model
    reference = "fcfs" if "fcfs" in sweeps else policies[0]
    measured = measured_knee(sweeps[reference])

    write_goodput_png(list(sweeps.values()), args.out_dir / "goodput.png", knee=knee)
    (args.out_dir / "bench-slo.json").write_text(json.dumps({
        "cpu": cpu_description(), "predicted_knee": knee, "measured_knee": measured,
        "measured_knee_policy": reference, "step_model": None if step_model is None else str(step_model),
        "sweeps": sweeps,
    }, indent=2))
    print()
    print(comparison_table(sweeps))
    print(f"predicted knee: {'n/a' if knee is None else f'{knee:.2f} req/s'}; measured knee ({reference}, "
          f"goodput >= 90% of offered): {'none' if measured is None else f'{measured:g} req/s'}")
    print(f"wrote {args.out_dir / 'bench-slo.json'} and {args.out_dir / 'goodput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
