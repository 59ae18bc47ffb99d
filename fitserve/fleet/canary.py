"""A canary replica group's traffic share, stage by stage, as ``fitserve plan canary`` plans it.

::

    stages  1% -> 5% -> 25% -> 100%   (plan canary --stages; --json: data.stages)
    request k of a stage goes to the canary iff floor((k + 1) f) > floor(k f)

so after k requests of a stage the canary has had exactly floor(k f) of them (f an exact
fraction of the stage's percent: Bresenham's line, no randomness). A stage below 100% ends when
both arms hold the plan's n requests (data.n_per_arm: the gate the plan times at
n / (min(f, 1 - f) R)), or on a command; the last stage (100%) holds until the rollout is
stopped or replaced. No Ray here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any


@dataclass
class CanarySplit:
    """Which requests go to the canary group; ``take()`` once per routed request."""

    group: str  # the canary's replica group (Serve deployment)
    stages: list[Fraction]  # shares in (0, 1], in order
    n_per_arm: int | None = None  # advance once both arms hold this many (None: by command only)
    stage: int = 0
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

    @property
    def share(self) -> Fraction:
        return self.stages[self.stage]

    def take(self) -> bool:
        """True when this request goes to the canary (and counts it); may end the stage."""
        k, f = self.canary + self.baseline, self.share
        to_canary = math.floor((k + 1) * f) > math.floor(k * f)
        if to_canary:
            self.canary += 1
        else:
            self.baseline += 1
        n = self.n_per_arm
        if n is not None and f < 1 and self.canary >= n and self.baseline >= n:
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
        return True

    def describe(self) -> dict[str, Any]:
        return {"group": self.group, "stage": self.stage, "percent": float(self.share * 100),
                "stages": [float(s * 100) for s in self.stages], "n_per_arm": self.n_per_arm,
                "canary": self.canary, "baseline": self.baseline, "history": self.history}


def canary_from_body(body: dict[str, Any]) -> CanarySplit:
    """``POST /fleet/canary``'s body: {group, stages: [percent...], n_per_arm?} or {group, plan:
    the JSON of ``fitserve plan canary --json`` (its data.stages and data.n_per_arm)}."""
    group = body.get("group")
    if not isinstance(group, str) or not group:
        raise ValueError("a canary needs 'group': the name of the replica group to send its share to")
    stages: Any = body.get("stages")
    n_per_arm: Any = body.get("n_per_arm")
    plan = body.get("plan")
    if plan is not None:
        data = plan.get("data") if isinstance(plan, dict) else None
        if not isinstance(data, dict) or "stages" not in data:
            raise ValueError("'plan' must be the output of fitserve plan canary --json (data.stages missing)")
        stages = data["stages"] if stages is None else stages
        n_per_arm = data.get("n_per_arm") if n_per_arm is None else n_per_arm
    if not isinstance(stages, list) or not all(isinstance(s, int | float) and not isinstance(s, bool)
                                                for s in stages):
        raise ValueError(f"'stages' must be a list of percents, got {stages!r}")
    if n_per_arm is not None and (not isinstance(n_per_arm, int) or isinstance(n_per_arm, bool)):
        raise ValueError(f"'n_per_arm' must be an integer, got {n_per_arm!r}")
    # NOTE: the percent's decimal text, not its binary float: 5% is exactly 1/20
    return CanarySplit(group, [Fraction(str(s)) / 100 for s in stages], n_per_arm)
