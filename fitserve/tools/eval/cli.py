"""`fitserve eval`: a candidate model against a reference on held-out text, or a sensitivity sweep.

    fitserve eval --weights int4 --reference-weights float32              # SmolLM2, shipped text
    fitserve eval --weights int4 --compare int8 --compare kv-cache-dtype=int8 --json
    fitserve eval --sweep matrix --weights float32 --max-tokens 256

The primary candidate is ``--model`` with ``--weights`` / ``--quantization`` / ``--dtype`` /
``--kv-cache-dtype`` / ``--kv-cache-scales`` (the engine's flags); each ``--compare SPEC`` adds
another candidate that differs in the keys SPEC names (``int8`` = ``weights=int8``; or
``key=value,...``), scored on the same tokens, and gets a paired "noise"/"real" verdict against
the primary one. ``--reference`` defaults to ``--model``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fitserve.ledger.formats import ENGINE_KV_CACHE_DTYPES, ENGINE_WEIGHT_CHOICES, KV_CACHE_SCALES

_DTYPES = ["auto", "float32", "bfloat16", "float16"]


def add_eval_parser(sub: Any) -> None:
    """Register ``fitserve eval`` on an argparse subparsers object."""
    p = sub.add_parser("eval", help="KL / flips / perplexity of a (quantized) model against a "
                       "reference on held-out text, with bootstrap CIs; or a sensitivity sweep",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="the candidate: a .gguf, an HF folder "
                   "or a known name")
    p.add_argument("--weights", default="auto", choices=list(ENGINE_WEIGHT_CHOICES))
    p.add_argument("--quantization", default=None, choices=["int4", "int8"])
    p.add_argument("--dtype", default="auto", choices=_DTYPES)
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(ENGINE_KV_CACHE_DTYPES))
    p.add_argument("--kv-cache-scales", default="auto", choices=list(KV_CACHE_SCALES))
    p.add_argument("--activation-quant", default="auto", choices=["auto", "int8", "none"],
                   help="what packed int4/int8 weights multiply (the engine's flag)")
    p.add_argument("--reference", default=None, help="the reference model (default: --model)")
    p.add_argument("--reference-weights", default="auto", choices=list(ENGINE_WEIGHT_CHOICES))
    p.add_argument("--reference-activation-quant", default="auto",
                   choices=["auto", "int8", "none"],
                   help="the reference's --activation-quant (none: W4A16 for a packed file)")
    p.add_argument("--reference-dtype", default=None, choices=_DTYPES,
                   help="the reference's dtype (default: --dtype)")
    p.add_argument("--compare", action="append", default=[], metavar="SPEC",
                   help="one more candidate: a --weights choice (int8) or key=value,... with "
                   "keys model, weights, quantization, dtype, kv-cache-dtype, kv-cache-scales, "
                   "activation-quant, "
                   "label; repeatable; each gets a noise/real verdict against the primary one")
    p.add_argument("--text", default=None, help="a UTF-8 file, or a shipped text: persuasion "
                   "(default, Austen), ecclesiastes (KJV)")
    p.add_argument("--max-tokens", type=int, default=1024, help="score the first N tokens")
    p.add_argument("--window", type=int, default=1024,
                   help="tokens per window (each scored from an empty KV cache)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print every metric and CI as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write per-position KL")
    b = p.add_argument_group("bootstrap")
    b.add_argument("--block-len", type=int, default=64, help="block bootstrap block (tokens)")
    b.add_argument("--resamples", type=int, default=2000)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--confidence", type=float, default=0.95)
    b.add_argument("--horizon", type=int, default=32, help="greedy agreement cap (tokens)")
    s = p.add_argument_group("sensitivity sweep (quantizes --model's own dense weights)")
    s.add_argument("--sweep", default=None, choices=["matrix", "layer", "type"])
    s.add_argument("--sweep-format", default="int4-g128-asym",
                   help="RTN format of each unit (a packed format of the formats table)")
    s.add_argument("--mix-sizes", default="2,4,8", help="top-k mixes measured, e.g. 2,4,8")
    s.add_argument("--sweep-top", type=int, default=10, help="units printed")
    s.add_argument("--big-model", default="Llama-3.3-70B", help="catalog model to price for")
    s.add_argument("--gpu", default="h100", help="catalog accelerator to price on")
    s.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    p.set_defaults(func=cmd_eval)


def _bootstrap(args: argparse.Namespace) -> Any:
    from fitserve.tools.eval.eval import BootstrapConfig
    from fitserve.tools.eval.eval_run import EvalError

    if args.block_len < 1 or args.resamples < 10 or not 0 < args.confidence < 1:
        raise EvalError("--block-len must be >= 1, --resamples >= 10, --confidence in (0, 1)")
    if args.horizon < 1:
        raise EvalError(f"--horizon must be at least 1, got {args.horizon}")
    return BootstrapConfig(args.block_len, args.resamples, args.seed, args.confidence)


def _check_plot(path: str | None) -> None:
    from pathlib import Path

    from fitserve.tools.eval.eval_run import EvalError

    if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
        raise EvalError(f"--plot {path}: its folder does not exist")


def cmd_eval(args: argparse.Namespace) -> int:
    """Run ``fitserve eval`` (or its sweep) and print a table or JSON."""
    from fitserve.tools.eval.eval_run import ModelChoice, derive, run_eval

    cfg = _bootstrap(args)
    _check_plot(args.plot)
    primary = ModelChoice(args.model, args.weights, args.quantization, args.dtype,
                          args.kv_cache_dtype, args.kv_cache_scales, args.activation_quant)
    if args.sweep is not None:
        return _cmd_sweep(args, primary, cfg)
    reference = ModelChoice(args.reference or args.model, args.reference_weights, None,
                            args.reference_dtype or args.dtype,
                            activation_quant=args.reference_activation_quant, label="")
    candidates = [primary, *(derive(primary, spec) for spec in args.compare)]
    run = run_eval(reference, candidates, text=args.text, max_tokens=args.max_tokens,
                   window=args.window, chunk_size=args.chunk_size, device=args.device)
    report = build_report(run, cfg, args.horizon)
    if args.plot:
        plot_kl(run, args.plot)
        report["plot"] = args.plot
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def build_report(run: Any, cfg: Any, horizon: int) -> dict[str, Any]:
    """JSON-ready report of an EvalRun: every candidate's metrics with CIs, and the verdicts
    of the primary candidate (the first) against each other one."""
    from fitserve.tools.eval.eval import compare, summarize

    sums = [summarize(s, cfg, horizon) for s in run.stats]
    names = [c.name() for c in run.candidates]
    comparisons = []
    for i in range(1, len(run.stats)):
        verdicts = compare(run.stats[0], run.stats[i], cfg, horizon)
        comparisons.append({"a": names[0], "b": names[i],
                            "metrics": {k: v.as_dict() for k, v in verdicts.items()}})
    return {
        "text": run.text_name, "num_tokens": run.num_tokens,
        "num_positions": run.num_tokens - 1, "window": run.window,
        "bootstrap": {"method": "circular block bootstrap, percentile interval",
                      "block_len": cfg.block_len, "resamples": cfg.resamples, "seed": cfg.seed,
                      "confidence": cfg.confidence},
        "reference": {**run.reference.as_dict(), "ppl": sums[0].ppl_ref.as_dict()},
        "candidates": [{**c.as_dict(), **s.as_dict()} for c, s in zip(run.candidates, sums,
                                                                        strict=True)],
        "comparisons": comparisons,
    }


def _iv(d: dict[str, float], fmt: str) -> str:
    return f"{d['mean']:{fmt}} [{d['lo']:{fmt}}, {d['hi']:{fmt}}]"


def format_report(r: dict[str, Any]) -> str:
    """The report as a readable table."""
    b, ref = r["bootstrap"], r["reference"]
    h = r["candidates"][0]["agreement_horizon"]
    lines = [f"fitserve eval: {r['num_positions']} positions of {r['text']} (windows of "
             f"{r['window']} tokens)",
             f"reference: {ref['model']} {ref['name']}, perplexity {_iv(ref['ppl'], '.3f')}",
             f"{b['confidence']:.0%} CIs: circular block bootstrap, blocks of {b['block_len']} "
             f"tokens, {b['resamples']} resamples, seed {b['seed']}", "",
             f"{'candidate':<28} {'KL nats/token':<30} {'top-1 flip':<24} {'perplexity':<26} "
             f"agreement@{h}"]
    for c in r["candidates"]:
        lines.append(f"{c['name'][:28]:<28} {_iv(c['kl'], '.5f'):<30} "
                     f"{_iv(c['flip_rate'], '.2%'):<24} {_iv(c['ppl'], '.3f'):<26} "
                     f"{_iv(c['agreement'], '.1f')}")
    for cmp in r["comparisons"]:
        lines += ["", f"{cmp['a']}  minus  {cmp['b']} (paired by position):"]
        for name, m in cmp["metrics"].items():
            fmt = "+.2%" if name == "flip_rate" else "+.5f"
            lines.append(f"  {name:<10} {_iv(m['diff'], fmt):<40} {m['verdict']}")
    return "\n".join(lines)


def plot_kl(run: Any, path: str) -> None:
    """PNG of per-position KL of each candidate (thin: raw; thick: 64-token moving mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for choice, stats in zip(run.candidates, run.stats, strict=True):
        kl = stats.kl.float()
        k = min(64, len(kl))
        smooth = torch.nn.functional.avg_pool1d(kl.view(1, 1, -1), k, 1).flatten()
        line, = ax.plot(kl.numpy(), lw=0.5, alpha=0.35)
        ax.plot(range(k - 1, len(kl)), smooth.numpy(), lw=1.8, color=line.get_color(),
                label=f"{choice.name()} (mean {float(stats.kl.mean()):.4g})")
    for w in range(run.window, run.num_tokens - 1, run.window):
        ax.axvline(w, color="grey", ls="--", lw=0.6)
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel("position (predicting token position + 1)")
    ax.set_ylabel("KL(reference || candidate), nats")
    ax.set_title(f"per-position KL vs {run.reference.name()} on {run.text_name.split(' ')[0]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mix_sizes(text: str) -> tuple[int, ...]:
    from fitserve.tools.eval.eval_run import EvalError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise EvalError(f"--mix-sizes {text!r}: not a comma-separated list of integers") from None


def _cmd_sweep(args: argparse.Namespace, base: Any, cfg: Any) -> int:
    """``--sweep``: the model's own dense weights, one unit at a time (see quant.sensitivity)."""
    from dataclasses import replace

    from fitserve.ledger.formats import weight_format
    from fitserve.runner.placement import resolve_device
    from fitserve.tools.eval.eval_run import (
        EvalError,
        check_choice,
        encode_text,
        load_scorer,
        read_text,
        resolve_window,
    )
    from fitserve.tools.eval.sensitivity import format_sweep, run_sweep, sweep_dict

    packed = base.quantization or base.weights
    if packed not in ("auto", "float32", "bf16", "float16"):
        raise EvalError(f"--sweep quantizes dense weights itself: --weights {packed} holds them "
                        "packed (use float32 or bf16)")
    try:
        if weight_format(args.sweep_format).packed is None:
            raise EvalError(f"--sweep-format {args.sweep_format} is not a packed format")
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    if base.weights == "auto":
        dense = {"auto": "float32", "float32": "float32", "bfloat16": "bf16", "float16": "float16"}
        base = replace(base, weights=dense[base.dtype])
    check_choice(base)
    mixes = _mix_sizes(args.mix_sizes)
    body, _ = read_text(args.text)
    scorer = load_scorer(base, resolve_device(args.device), args.window)
    tokens = encode_text(body, [scorer], args.max_tokens)
    quiet = args.json

    def progress(i: int, n: int, name: str) -> None:
        if not quiet:
            print(f"\r  unit {i + 1}/{n} {name:<20}", end="", file=sys.stderr, flush=True)

    result = run_sweep(scorer.model, scorer.spec, tokens, granularity=args.sweep,
                       fmt=args.sweep_format, window=resolve_window(args.window, [scorer]),
                       chunk_size=args.chunk_size, mix_sizes=mixes, cfg=cfg, progress=progress,
                       big_model=args.big_model, gpu=args.gpu, mfu=args.mfu)
    if not quiet:
        print(file=sys.stderr)
    print(json.dumps(sweep_dict(result), indent=2) if args.json
          else format_sweep(result, args.sweep_top))
    return 0
