"""A canary replica group's traffic share, stage by stage, as ``fitserve plan canary`` plans it.

::

    stages  1% -> 5% -> 25% -> 100%   (plan canary --stages; --json: data.stages)
    request k of a stage goes to the canary iff floor((k + 1) f) > floor(k f)

so after k requests of a stage the canary has had exactly floor(k f) of them (f an exact
fraction of the stage's percent: Bresenham's line, no randomness). A stage below 100% ends
(``advance_by``) when both arms hold the plan's n requests ("requests": data.n_per_arm, the
gate the plan times at n / (min(f, 1 - f) R)), when the plan's time for it has passed ("time":
data.stage_s, from --traffic-rps), or only on a command ("command"); the last stage (100%) holds
until the canary is stopped. No Ray here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any


@dataclass
class CanarySplit:
    """Which requests go to the canary group; ``take()`` once per routed request."""

    group: str  # the canary's replica group (Serve deployment)
    stages: list[Fraction]  # shares in (0, 1], in order
    n_per_arm: int | None = None  # advance_by "requests": once both arms hold this many
    stage_seconds: list[float | None] | None = None  # advance_by "time": each stage's length
    advance_by: str | None = None  # "requests", "time" or "command" (None: requests if n_per_arm)
    clock: Callable[[], float] = time.monotonic
    stage: int = 0
    stage_started: float = field(default=0.0)
    canary: int = 0  # requests of the current stage sent to the canary
    baseline: int = 0  # and to the other groups
    history: list[dict[str, Any]] = field(default_factory=list)  # finished stages' counts

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a canary needs one or more stages")
        for s in self.stages:
            if not 0 < s <= 1:
                raise ValueError(f"canary stages must be in (0, 100] percent, got {float(s) * 100:g}")
        if self.n_per_arm is not None and self.n_per_arm < 1:
            raise ValueError(f"n_per_arm must be >= 1, got {self.n_per_arm}")
        if self.advance_by is None:
            self.advance_by = "requests" if self.n_per_arm is not None else "command"
        if self.advance_by not in ADVANCE_BY:
            raise ValueError(f"advance_by must be one of {ADVANCE_BY}, got {self.advance_by!r}")
        if self.advance_by == "requests" and self.n_per_arm is None:
            raise ValueError("advance_by 'requests' needs n_per_arm (plan canary's n per arm)")
        if self.advance_by == "time" and (self.stage_seconds is None or len(self.stage_seconds) != len(self.stages)):
            raise ValueError("advance_by 'time' needs stage_seconds, one per stage (plan canary --traffic-rps's stage_s)")
        self.stage_started = self.clock()

    @property
    def share(self) -> Fraction:
        return self.stages[self.stage]

    def take(self) -> bool:
        """True when this request goes to the canary (and counts it); may end the stage."""
        if self.advance_by == "time" and self.stage_seconds is not None:
            length = self.stage_seconds[self.stage]
            if length is not None and self.clock() - self.stage_started >= length:
                self.advance()
        k, f = self.canary + self.baseline, self.share
        to_canary = math.floor((k + 1) * f) > math.floor(k * f)
        if to_canary:
            self.canary += 1
        else:
            self.baseline += 1
        n = self.n_per_arm
        if self.advance_by == "requests" and n is not None and f < 1 and self.canary >= n and self.baseline >= n:
            self.advance()
        return to_canary

    def advance(self) -> bool:
        """Go to the next stage (False at the last one: it stays)."""
        if self.stage + 1 >= len(self.stages):
            return False
        self.history.append({"percent": float(self.share * 100), "canary": self.canary,
                             "baseline": self.baseline})
        self.stage += 1
        self.canary = self.baseline = 0
        self.stage_started = self.clock()
        return True

    def describe(self) -> dict[str, Any]:
        return {"group": self.group, "stage": self.stage, "percent": float(self.share * 100),
                "stages": [float(s * 100) for s in self.stages], "n_per_arm": self.n_per_arm,
                "advance_by": self.advance_by, "stage_seconds": self.stage_seconds,
                "canary": self.canary, "baseline": self.baseline, "history": self.history}


ADVANCE_BY = ("requests", "time", "command")


def canary_from_body(body: dict[str, Any], clock: Callable[[], float] = time.monotonic) -> CanarySplit:
    """``POST /fleet/canary``'s body: {group, stages: [percent...], n_per_arm?, stage_seconds?,
    advance_by?} or {group, plan: the JSON of ``fitserve plan canary --json`` (its data.stages,
    data.n_per_arm, data.stage_s), advance_by?}. advance_by defaults to "requests" where there is
    an n per arm, else "command"."""
    group = body.get("group")
    if not isinstance(group, str) or not group:
        raise ValueError("a canary needs 'group': the name of the replica group to send its share to")
    stages: Any = body.get("stages")
    n_per_arm: Any = body.get("n_per_arm")
    seconds: Any = body.get("stage_seconds")
    plan = body.get("plan")
    if plan is not None:
        data = plan.get("data") if isinstance(plan, dict) else None
        if not isinstance(data, dict) or "stages" not in data:
            raise ValueError("'plan' must be the output of fitserve plan canary --json (data.stages missing)")
        stages = data["stages"] if stages is None else stages
        n_per_arm = data.get("n_per_arm") if n_per_arm is None else n_per_arm
        seconds = data.get("stage_s") if seconds is None else seconds
    if not isinstance(stages, list) or not all(isinstance(s, int | float) and not isinstance(s, bool)
                                                for s in stages):
        raise ValueError(f"'stages' must be a list of percents, got {stages!r}")
    if n_per_arm is not None and (not isinstance(n_per_arm, int) or isinstance(n_per_arm, bool)):
        raise ValueError(f"'n_per_arm' must be an integer, got {n_per_arm!r}")
    if seconds is not None and (not isinstance(seconds, list) or not all(
            s is None or (isinstance(s, int | float) and not isinstance(s, bool) and s > 0) for s in seconds)):
        raise ValueError(f"'stage_seconds' must be a list of seconds > 0 (null for none), got {seconds!r}")
    advance_by = body.get("advance_by")
    # NOTE: the percent's decimal text, not its binary float: 5% is exactly 1/20
    return CanarySplit(group, [Fraction(str(s)) / 100 for s in stages], n_per_arm, seconds, advance_by, clock)
