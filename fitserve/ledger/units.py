"""Token counts with k/m suffixes (x1024) and human-readable byte figures."""

from __future__ import annotations

import re

from fitserve.ledger.errors import PlanError

# NOTE: contexts use binary suffixes, as model cards do: "128k" = 128 x 1024 = 131,072 tokens.
TOKEN_SUFFIXES = {"": 1, "k": 1024, "m": 1024 * 1024}
_TOKENS_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_tokens(text: str) -> int:
    """Parse "4096", "128k" (131,072) or "1m" (1,048,576); k and m mean x1024 and x1024^2."""
    m = _TOKENS_RE.match(text)
    if m is None:
        raise PlanError(f"cannot read token count {text!r}: use digits with an optional k or m (x1024)")
    value = float(m.group(1)) * TOKEN_SUFFIXES[m.group(2).lower()]
    if value != int(value) or value <= 0:
        raise PlanError(f"token count {text!r} must be a positive whole number of tokens")
    return int(value)


_BYTE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """A byte size as the engine's --kv-cache-memory reads it: "512M", "2G", "1.5GiB", "1024"
    (binary units: K = 1024)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in _BYTE_UNITS:
            return int(float(t[:-1]) * _BYTE_UNITS[t[-1]])
        return int(t)
    except ValueError:
        raise PlanError(f"not a size: {text!r} (e.g. 512M, 2G)") from None


def fmt_bytes(n: float) -> str:
    """Bytes with binary units: 1536 -> "1.50 KiB"."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_count(n: float) -> str:
    """Counts with decimal units, as parameter counts are published: 8.03e9 -> "8.03 B"."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.2f} us"
