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


_SI = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_IEC = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")


def parse_size(text: str, flag: str) -> int:
    """A byte size with its unit spelled out: "500GB" = 500 x 10^9 B (SI, as vendors and the
    question "a 500 GB model" mean it), "500GiB" = 500 x 2^30 B, "500e9" or "1024" (bytes, "B"
    optional). A bare K/M/G/T is refused with both readings: it means GiB to the engine's
    --kv-cache-memory but GB to most people asking.
    """
    m = _SIZE_RE.match(text.strip().lower())
    unit = m.group(2) if m else ""
    if m is not None and unit in ("k", "m", "g", "t", "p"):
        num = float(m.group(1))
        si, iec = num * _SI[unit + "b"], num * _IEC[unit + "ib"]
        raise PlanError(f"{flag} {text}: a bare {unit.upper()} is ambiguous; write "
                        f"{m.group(1)}{unit.upper()}B ({si:,.0f} B) or {m.group(1)}"
                        f"{unit.upper()}iB ({iec:,.0f} B)")
    scale = {"": 1, "b": 1, **_SI, **_IEC}.get(unit) if m else None
    if m is None or scale is None:
        raise PlanError(f"{flag}: not a size: {text!r} (e.g. 500GB, 465.66GiB, 500e9)")
    value = float(m.group(1)) * scale
    if value != int(value):
        raise PlanError(f"{flag} {text}: not a whole number of bytes ({value:g})")
    return int(value)


def fmt_bytes_both(n: float) -> str:
    """Decimal and binary side by side: 500e9 -> "500.00 GB = 465.66 GiB"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit} = {fmt_bytes(n)}"
    return fmt_bytes(n)


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
