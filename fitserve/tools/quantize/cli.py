"""`fitserve quantize`: write a quantized safetensors folder that the engine and the planner load.

    fitserve quantize MODEL [--method rtn|awq|gptq] [--bits 4|8] [--group-size 32|64|128]
                      [--sym] [--calib FILE] -o OUT [--force]

    fitserve quantize smollm2-135m -o smollm2-int4              # RTN int4-g32-asym (= --weights int4)
    fitserve quantize smollm2-135m --method gptq --group-size 128 --calib text.txt -o out-gptq
    fitserve generate --model out-gptq "Hello"                   # held as stored, packed
    fitserve plan out-gptq --gpu cpu                             # the bytes the engine holds

Defaults: --method rtn, --bits 4, --group-size 32 for int4 (the engine's RTN-at-load layout)
and per channel for int8, asymmetric int4 unless --sym. --calib is required by awq and gptq
and ignored (with a warning) by rtn. Every bad argument exits 2 with a message naming it,
before any model is read; an existing non-empty OUT is refused unless --force (which replaces
only the checkpoint's own files). The folder format: ``fitserve.loading.checkpoint``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

# NOTE: fitserve.tools.quantize.methods' METHODS / CALIBRATED (a unit test checks they agree), spelled
# here so that building the CLI parser imports no torch (methods.py does).
METHODS = ("rtn", "awq", "gptq")
CALIBRATED = ("awq", "gptq")


def add_quantize_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``quantize`` sub-command to an argparse ``subparsers`` object and return it."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "quantize", help="write a quantized safetensors folder (rtn, awq, gptq) the engine loads",
        description="Quantize a model's linear projections into the engine's packed int4/int8 "
                    "layouts (embedding and lm_head: RTN int8 per channel) and write a "
                    "safetensors folder that `fitserve generate/serve/plan` read as stored.")
    p.add_argument("model", help="a .gguf file, a Hugging Face folder, or a known name")
    p.add_argument("--method", default="rtn", choices=METHODS)
    p.add_argument("--bits", type=int, default=4, choices=[4, 8])
    p.add_argument("--group-size", type=int, default=None,
                   help="columns per scale: 32, 64 or 128 (int4 default 32; int8 default: one "
                        "scale per output channel)")
    p.add_argument("--sym", action="store_true",
                   help="symmetric int4 (no per-group min; int8 is always symmetric)")
    p.add_argument("--calib", default=None,
                   help="calibration text file (UTF-8), required by awq and gptq")
    p.add_argument("--calib-seq-len", type=int, default=512,
                   help="calibration tokens per sequence (at most)")
    p.add_argument("--calib-max-seqs", type=int, default=16,
                   help="calibration sequences: the text's first ones")
    p.add_argument("--damp", type=float, default=0.01,
                   help="gptq: dampening, a fraction of mean(diag H) added to H's diagonal")
    p.add_argument("--no-act-order", dest="act_order", action="store_false",
                   help="gptq: quantize columns left to right (default: by descending diag H)")
    p.add_argument("--awq-grid", type=int, default=20, help="awq: points of the scale search")
    p.add_argument("-o", "--output", required=True, help="the folder to write")
    p.add_argument("--force", action="store_true",
                   help="write into an existing non-empty folder (replacing its checkpoint files)")
    p.set_defaults(func=run_quantize)
    return p


def _check_args(args: argparse.Namespace) -> tuple[Path, str | None]:
    """Validate everything before a model is read: (model path, calibration text or None)."""
    from fitserve.loading import resolve_model_path
    from fitserve.loading.checkpoint import check_output
    from fitserve.tools.quantize.methods import target_formats

    group = args.group_size if args.group_size is not None or args.bits == 8 else 32
    target_formats(args.bits, group, args.sym)  # ValueError names the bad bits / group size
    args.group_size = group
    if args.method in CALIBRATED and not args.calib:
        raise ValueError(f"--method {args.method} needs calibration text: pass --calib FILE")
    if args.damp <= 0 or args.awq_grid < 1 or args.calib_seq_len < 16 or args.calib_max_seqs < 1:
        raise ValueError("--damp must be > 0, --awq-grid >= 1, --calib-seq-len >= 16 and "
                         "--calib-max-seqs >= 1")
    text = None
    if args.calib and args.method not in CALIBRATED:
        print(f"fitserve quantize: warning: --calib is ignored by --method {args.method} "
              "(round to nearest uses no calibration data)", file=sys.stderr)
    elif args.calib:
        from fitserve.tools.quantize.calibration import read_calibration_text

        try:
            text = read_calibration_text(args.calib)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--calib {args.calib}: cannot read it as UTF-8 text: {exc}") from exc
    path = resolve_model_path(args.model)  # ModelLoadError (a ValueError) names a missing model
    check_output(Path(args.output), force=args.force, source=path)
    return path, text


def run_quantize(args: argparse.Namespace) -> int:
    """Run `fitserve quantize` (ValueError for bad input: cli.main prints it and exits 2)."""
    import torch

    from fitserve.loading import load_model
    from fitserve.loading.checkpoint import prepare_output, write_checkpoint
    from fitserve.quant.convert import held_bytes
    from fitserve.tools.quantize.methods import quantize_loaded

    path, text = _check_args(args)
    print(f"fitserve quantize: loading {path}", file=sys.stderr)
    loaded = load_model(path, dtype=torch.float32, weights="as-stored")
    print(f"fitserve quantize: {args.method} int{args.bits}, group "
          f"{args.group_size or 'per channel'}", file=sys.stderr)
    result = quantize_loaded(
        loaded, method=args.method, bits=args.bits, group_size=args.group_size,
        symmetric=args.sym, calib_text=text, calib_name=Path(args.calib).name if text else None,
        seq_len=args.calib_seq_len, max_seqs=args.calib_max_seqs, damp=args.damp,
        act_order=args.act_order, grid=args.awq_grid)
    out = Path(args.output)
    prepare_output(out, force=args.force)
    write_checkpoint(out, spec=result.spec, weights=result.weights,
                     quantization_config=result.metadata, tokenizer=loaded.tokenizer,
                     source=path, generation_defaults=loaded.generation_defaults)
    counts: dict[str, int] = {}
    for fmt in result.metadata["formats"].values():
        counts[fmt] = counts.get(fmt, 0) + 1
    total = sum(held_bytes(t) for t in result.weights.values())
    shown = ", ".join(f"{n} x {f}" for f, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    print(f"fitserve quantize: wrote {out} ({shown}; {total:,} B of weights held)",
          file=sys.stderr)
    print(out)
    return 0
