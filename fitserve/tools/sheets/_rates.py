"""Small shared pieces of the fleet, canary and capacity sheets: input checks that name their
flag, bandwidth units, ``name=value`` lists, durations in words, and the TTFT side of the
capacity sheet's steady state (prompt chunks beside the decodes within the TPOT target)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fitserve.ledger.errors import PlanError
from fitserve.ledger.speed import MAX_BATCH, smallest_batch
from fitserve.ledger.step_time import StepTimeModel

# NOTE: bandwidths are decimal, as link and storage vendors quote them: 1 Gb/s = 10^9 bit/s
# = 1.25 x 10^8 B/s; 1 GB/s = 10^9 B/s. --model-bytes spells its unit out (GB or GiB,
# ledger.units.parse_size); --chunk is binary (64M = 64 MiB).
GBIT_S = 1e9 / 8  # bytes per second in one gigabit per second
GBYTE_S = 1e9  # bytes per second in one gigabyte per second


def positive(flag: str, value: float) -> float:
    """``value`` if it is a finite number > 0, else a PlanError naming ``flag``."""
    if not (math.isfinite(value) and value > 0):
        raise PlanError(f"{flag} must be > 0 and finite, got {value:g}")
    return float(value)


def non_negative(flag: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise PlanError(f"{flag} must be >= 0 and finite, got {value:g}")
    return float(value)


def count(flag: str, value: int) -> int:
    """A whole count >= 1."""
    if value < 1:
        raise PlanError(f"{flag} must be >= 1, got {value}")
    return value


def open_fraction(flag: str, value: float) -> float:
    """A probability strictly between 0 and 1."""
    if not (math.isfinite(value) and 0.0 < value < 1.0):
        raise PlanError(f"{flag} must be strictly between 0 and 1, got {value:g}")
    return float(value)


def assignments(flag: str, text: str) -> dict[str, float]:
    """``"h100=2.5,b200=6"`` -> {"h100": 2.5, "b200": 6.0} (names lower-cased)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, val = part.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError(part)
            out[name.strip().lower()] = float(val)
        except ValueError:
            raise PlanError(f"{flag}: cannot read {part!r}; write NAME=NUMBER, comma-separated "
                            f"(e.g. h100=2.5,b200=6)") from None
    if not out:
        raise PlanError(f"{flag} is empty; write NAME=NUMBER, comma-separated")
    return out


def number_list(flag: str, text: str) -> list[float]:
    """``"1,5,25,100"`` -> [1.0, 5.0, 25.0, 100.0]."""
    try:
        vals = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise PlanError(f"{flag}: cannot read {text!r}; write numbers separated by commas") from None
    if not vals:
        raise PlanError(f"{flag} is empty")
    return vals


def fmt_duration(s: float) -> str:
    """Seconds in the unit a person reads them in: "42.1 s", "12.5 min", "3.20 h", "2.1 days"."""
    if math.isinf(s):
        return "never"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.2f} h"
    return f"{s / 86400:.1f} days"


def fmt_rate(bytes_per_s: float) -> str:
    """A bandwidth in both units: "25.0 GB/s (200 Gb/s)"."""
    return f"{bytes_per_s / GBYTE_S:,.3g} GB/s ({bytes_per_s / GBIT_S:,.4g} Gb/s)"


def cheapest_mix(rates: dict[str, float], cost: dict[str, float], need: float
                 ) -> tuple[dict[str, int], str]:
    """Units (replicas) per option to cover ``need`` (a rate), each option of ``rates[x]`` at
    ``cost[x]``, by a stated rule, and the rule's arithmetic in words.

    Rule: as many units of the option with the lowest cost per rate as fit wholly inside the
    need, then the remainder on whichever option covers it cheapest. The first part costs no
    more than the optimum, the remainder less than one unit of the best option, so the mix
    costs at most one such unit more than the optimum.
    """
    best = min(rates, key=lambda x: (cost[x] / rates[x], x))
    n = math.floor(need / rates[best] + 1e-9)
    mix = {best: n}
    rem = need - n * rates[best]
    how = (f"{best} has the lowest $ per req/s: floor({need:,.4f} / {rates[best]:,.4f}) = "
           f"{n:,} replicas")
    if rem > 1e-9:
        options = {x: math.ceil(rem / r - 1e-9) for x, r in rates.items()}
        pick = min(options, key=lambda x: (options[x] * cost[x], x != best, x))
        mix[pick] = mix.get(pick, 0) + options[pick]
        how += (f"; the remaining {rem:,.4f} req/s on the cheapest cover: {options[pick]} x "
                f"{pick} (${options[pick] * cost[pick]:,.2f}/h)")
    return {k: v for k, v in mix.items() if v}, how


@dataclass(frozen=True)
class Workload:
    prompt: int  # P
    new: int  # O
    tpot: float  # T, seconds
    ttft: float  # seconds
    steps_max: int  # prompt chunk steps the TTFT target leaves: floor(TTFT / T) - 1


def chunk_cap(m: StepTimeModel, w: Workload, b: int) -> int:
    """Prompt tokens a step may take beside ``b`` decodes at mean context P + O/2."""
    return m.max_new_tokens(w.tpot, new_tokens=b, seqs=b,
                            kv_tokens_read=round(b * (w.prompt + w.new / 2)))


def ttft_at(m: StepTimeModel, w: Workload, b: int) -> float:
    """(1 + ceil(P / cap(B))) x T; infinite when no prompt token fits beside the decodes."""
    cap = chunk_cap(m, w, b)
    return math.inf if cap < 1 else (1 + math.ceil(w.prompt / cap)) * w.tpot


def ttft_limit(m: StepTimeModel, w: Workload) -> tuple[int | None, bool]:
    """(largest B meeting TTFT or None if none fails up to MAX_BATCH, met at B = 0)."""
    def fails(b: int) -> bool:
        return ttft_at(m, w, b) > w.ttft + 1e-12

    if fails(0):
        return 0, False
    first = smallest_batch(fails, MAX_BATCH)
    return (None if first is None else first - 1), True
