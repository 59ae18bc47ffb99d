"""Shared pieces of the explain sheets: typed reads of the parsed flags (each check names its
flag), the accelerator and model look-ups, and number formats.

Every topic flag defaults to ``None`` so that a topic can tell "not given" from a value and
fill in its own default; ``fitserve.tools.sheets.explain`` refuses flags a topic does not use.
"""

from __future__ import annotations

import argparse
import math

from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import Hardware, get_hardware
from fitserve.ledger.units import parse_tokens
from fitserve.tools.planner.model_source import ModelEntry, resolve_model
from fitserve.tools.planner.report import Line

DEFAULT_GPU = "h100"
DEFAULT_MODEL = "Llama-3.1-8B"


def flag_name(dest: str) -> str:
    """The command-line spelling of an argparse ``dest``: "latency_ns" -> "--latency-ns"."""
    return "--" + dest.replace("_", "-")


def _given(args: argparse.Namespace, dest: str) -> object:
    return getattr(args, dest, None)


def opt_str(args: argparse.Namespace, dest: str, default: str) -> str:
    v = _given(args, dest)
    return default if v is None else str(v)


def opt_int(args: argparse.Namespace, dest: str, default: int, *, lo: int = 1,
            hi: int | None = None) -> int:
    """An integer flag in [lo, hi] (PlanError naming the flag otherwise)."""
    v = _given(args, dest)
    n = default if v is None else int(str(v))
    if n < lo or (hi is not None and n > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise PlanError(f"{flag_name(dest)} must be {bound}, got {n}")
    return n


def opt_float(args: argparse.Namespace, dest: str, default: float, *,
              max_value: float = math.inf, inclusive_max: bool = True) -> float:
    """A finite float flag > 0 (and <= / < ``max_value``)."""
    v = _given(args, dest)
    x = default if v is None else float(str(v))
    over = x > max_value if inclusive_max else x >= max_value
    if not (math.isfinite(x) and x > 0) or over:
        top = "" if math.isinf(max_value) else (
            f" and {'<=' if inclusive_max else '<'} {max_value:g}")
        raise PlanError(f"{flag_name(dest)} must be > 0{top} and finite, got {x:g}")
    return x


def opt_tokens(args: argparse.Namespace, dest: str, default: int) -> int:
    """A token count flag ("2048", "8k" = 8,192)."""
    v = _given(args, dest)
    if v is None:
        return default
    try:
        return parse_tokens(str(v))
    except PlanError as e:
        raise PlanError(f"{flag_name(dest)}: {e}") from None


def hardware(args: argparse.Namespace) -> Hardware:
    """The accelerator of ``--gpu`` (default h100); an unknown name is a PlanError."""
    return get_hardware(opt_str(args, "gpu", DEFAULT_GPU))


def model(args: argparse.Namespace, default: str = DEFAULT_MODEL) -> ModelEntry:
    """The model of ``--model`` (a catalog name, config.json or .gguf)."""
    return resolve_model(opt_str(args, "model", default))


def model_name(entry: ModelEntry) -> str:
    return entry.spec.name or entry.spec.architecture


def line(name: str, formula: str, value: float | int | str | None, shown: str,
         explain: str) -> Line:
    """A Line whose ``explain`` must be non-empty (every explain-sheet line shows its sums)."""
    if not explain:
        raise AssertionError(f"line {name!r} has no arithmetic")
    return Line(name, formula, value, shown, explain)


def fmt_rate(x: float, unit: str) -> str:
    """A rate with a decimal prefix: 3.865e12 -> "3.87 T<unit>/s"."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}/s"
    return f"{x:.3g} {unit}/s"


def fmt_flops(x: float) -> str:
    """FLOPs with a decimal prefix: 4.2e15 -> "4.20 PFLOP"."""
    for prefix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}FLOP"
    return f"{x:,.0f} FLOP"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"
