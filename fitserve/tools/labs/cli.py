"""``fitserve kernels --explain SHAPE``: print bytes, FLOPs and tile counts for one shape.

SHAPE is comma-separated key=value pairs (defaults in brackets):

    b [1]  hq [32]  hkv [hq]  t (queries) [1]  s (keys) [t]  d [128]  w (window) [none]
    dtype (bf16|fp16|fp32) [bf16]  bm [64]  bn [64]  causal (0|1) [1]  workers [132]  bs [16]

    fitserve kernels --explain b=1,hq=32,hkv=8,t=4096,s=4096,d=128,w=1024
    fitserve kernels --explain b=8,hq=9,hkv=3,t=1,s=32768,d=64,workers=132
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from fitserve.tools.labs.counters import AttnShape, KernelCounts, all_counts, paged_forward
from fitserve.tools.labs.gqa import gqa_intensity
from fitserve.tools.labs.rmsnorm import rmsnorm_bytes
from fitserve.tools.labs.split_kv import choose_num_splits
from fitserve.tools.labs.window import count_key_tiles, predict_window_speedup

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
_DEFAULTS: dict[str, int] = {"b": 1, "hq": 32, "t": 1, "d": 128, "bm": 64, "bn": 64,
                             "causal": 1, "workers": 132, "bs": 16}


def parse_shape(text: str) -> dict[str, Any]:
    """Parse ``k=v,k=v`` into a dict with defaults filled in (raises ValueError on bad input)."""
    vals: dict[str, Any] = dict(_DEFAULTS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got {part!r}")
        key = key.strip().lower()
        if key == "dtype":
            if value not in _DTYPE_BYTES:
                raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}")
            vals[key] = value
        elif key in {*_DEFAULTS, "hkv", "s", "w"}:
            vals[key] = int(value)
        else:
            raise ValueError(f"unknown key {key!r}")
    vals.setdefault("hkv", vals["hq"])
    vals.setdefault("s", vals["t"])
    vals.setdefault("dtype", "bf16")
    vals.setdefault("w", None)
    if vals["t"] > vals["s"]:
        raise ValueError("t (queries) must be <= s (keys)")
    return vals


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _row(c: KernelCounts) -> str:
    return (f"  {c.name:<24} {_fmt_bytes(c.bytes_read):>12} {_fmt_bytes(c.bytes_written):>12} "
            f"{c.flops_executed / 1e9:>12.3f} {c.flops_useful / 1e9:>12.3f} {c.intensity:>9.1f}")


def explain(vals: dict[str, Any]) -> str:
    """The text ``--explain`` prints."""
    shape = AttnShape(vals["b"], vals["hq"], vals["hkv"], vals["t"], vals["s"], vals["d"],
                      _DTYPE_BYTES[vals["dtype"]], bool(vals["causal"]), vals["w"])
    n_blocks = math.ceil(shape.kv_len / vals["bn"])
    splits = choose_num_splits(vals["workers"], shape.batch, shape.num_kv_heads, n_blocks)
    lines = [f"shape: {shape}", "",
             f"  {'kernel':<24} {'read':>12} {'written':>12} {'GFLOP exec':>12} "
             f"{'GFLOP useful':>12} {'FLOP/B':>9}"]
    for c in all_counts(shape, block_m=vals["bm"], block_n=vals["bn"], num_splits=splits):
        lines.append(_row(c))
    lines.append(_row(paged_forward(shape, vals["bs"], vals["bm"], vals["bn"])))
    g = gqa_intensity(shape.q_len, shape.group, shape.kv_len, shape.head_dim, shape.dtype_bytes)
    lines += ["", f"GQA packing (G={shape.group}): {g.intensity_folded:.1f} FLOP/B folded vs "
              f"{g.intensity_per_head:.1f} FLOP/B one query head at a time"]
    if shape.q_len == 1:
        lines.append(f"split-KV: {splits} split(s) for {vals['workers']} workers, "
                     f"{shape.batch * shape.num_kv_heads} work items, {n_blocks} key blocks")
    if shape.causal:
        tc = count_key_tiles(shape.q_len, shape.kv_len, vals["bm"], vals["bn"], shape.window)
        lines.append(f"key tiles ({vals['bm']}x{vals['bn']}): skipped {tc.skipped}, "
                     f"full {tc.full}, masked {tc.masked} of {tc.total}")
    if shape.window is not None and shape.q_len == shape.kv_len:
        sp = predict_window_speedup(shape.kv_len, shape.window, vals["bm"], vals["bn"])
        lines.append(f"window {shape.window} vs causal: predicted {sp.tile_ratio:.2f}x from tile "
                     f"counts, {sp.pair_ratio:.2f}x from pairs, naive L/w = {sp.naive_ratio:.2f}x")
    hidden = shape.num_heads * shape.head_dim
    rb = rmsnorm_bytes(shape.batch * shape.q_len, hidden, shape.dtype_bytes)
    lines.append(f"rmsnorm (hidden {hidden}): fused {_fmt_bytes(rb.fused)} vs eager "
                 f"{_fmt_bytes(rb.eager)} ({rb.ratio:.1f}x)")
    return "\n".join(lines)


def add_kernels_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``kernels`` on an argparse subparsers object; returns the new parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "kernels", help="attention kernel counters (bytes, FLOPs, tiles)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--explain", metavar="SHAPE", required=True,
                   help="b=..,hq=..,hkv=..,t=..,s=..,d=..[,w=..,dtype=..,bm=..,bn=..]")
    p.set_defaults(func=run_kernels)
    return p


def run_kernels(args: argparse.Namespace) -> int:
    """Entry point for ``fitserve kernels``; returns the process exit code."""
    try:
        vals = parse_shape(args.explain)
    except ValueError as exc:
        print(f"fitserve kernels: bad SHAPE: {exc}", file=sys.stderr)
        return 2
    print(explain(vals))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="fitserve", allow_abbrev=False)
    add_kernels_parser(_parser.add_subparsers(dest="command", required=True))
    _args = _parser.parse_args()
    sys.exit(_args.func(_args))
