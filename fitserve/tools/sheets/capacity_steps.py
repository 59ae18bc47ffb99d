"""The capacity sheet's rates for one step model, and the step model of an MoE replica whose
weight read depends on the tokens a step carries (fitserve.ledger.moe)."""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.step_time import StepTimeModel, predicted_knee, roofline_step_model
from fitserve.tools.sheets._rates import Workload, ttft_limit


@dataclass(frozen=True)
class Rates:
    """The closed forms of the capacity sheet's docstring for one step model."""

    h: float
    k: float
    tpot: float
    kv: float
    b_ttft: int | None
    ttft: float | None
    ttft_met: bool

    def limits(self) -> dict[str, float]:
        out = {"TPOT": self.tpot, "KV pool": self.kv}
        if self.ttft is not None:
            out["TTFT"] = self.ttft
        return out

    def step_tokens(self, w: Workload) -> int:
        """Tokens a steady-state step carries at this capacity: lambda (P + O) t."""
        rate = max(0.0, min(self.limits().values()))
        if rate <= 0 or rate * self.k >= 1:
            return 1
        return max(1, round(rate * (w.prompt + w.new) * self.h / (1 - rate * self.k)))


def rates(m: StepTimeModel, w: Workload, kv_seqs: int) -> Rates:
    p, o = w.prompt, w.new
    h = m.a + m.c + m.d * p
    k = m.b * (p + o) + m.c * o + m.d * o * (p + o / 2)
    b_ttft, met = ttft_limit(m, w)
    return Rates(h, k, predicted_knee(m, prompt_tokens=p, output_tokens=o, tpot_s=w.tpot),
                  kv_seqs / (o * h + kv_seqs * k), b_ttft,
                  None if b_ttft is None else b_ttft / (o * h + b_ttft * k), met)


def step_model(spec: ModelSpec, hw: Hardware, weights: str, kv: str, tp: int, w: Workload,
                kv_seqs: int) -> tuple[StepTimeModel, Rates]:
    """The roofline step model and its rates. An MoE model's weight read depends on the
    tokens a step carries (the experts they touch), which depends on the rate: the fixed
    point n = tokens per step at the capacity of the model built for n-token steps.

    NOTE: more tokens touch more experts, so the rate falls and the step's tokens with it:
    n -> tokens(n) is decreasing and the fixed point unique; bisection on whole tokens."""
    def at(n: int) -> tuple[StepTimeModel, Rates]:
        m = roofline_step_model(spec, hw, weight_fmt=weights, kv_dtype=kv, tp=tp, step_tokens=n)
        return m, rates(m, w, kv_seqs)

    lo, (m, r) = 1, at(1)
    if not spec.num_experts or r.step_tokens(w) <= 1:
        return m, r
    hi = r.step_tokens(w)  # tokens(hi) <= tokens(1) = hi
    while hi - lo > 1:  # invariant: tokens(lo) >= lo, tokens(hi) <= hi
        mid = (lo + hi) // 2
        if at(mid)[1].step_tokens(w) >= mid:
            lo = mid
        else:
            hi = mid
    return at(hi)
