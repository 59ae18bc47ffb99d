"""Speculative decoding economics on the roofline: tokens per step, cost, and where it stops.

A draft proposes k tokens per sequence; the target model verifies all k + 1 positions in one
step. Each draft token is accepted independently with probability alpha, so a sequence gains

    E(alpha, k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)   (k + 1 at alpha=1)

tokens per verification. At batch B, from the planner's roofline (``speed.decode_step``):

    T_decode(B) = plain decode step: B tokens
    T_verify(B) = one step of B x (k + 1) tokens: weights read once, (k + 1)x the FLOPs,
                  each sequence's KV read once
    T_draft(B)  = k x draft_cost x T_decode(B)     (draft_cost: one draft step / one target step)

    speedup(B) = [E / (T_verify(B) + T_draft(B))] / [1 / T_decode(B)]

While the step is memory-bound T_verify ~ T_decode and speculation pays about E / (1 + k x
draft_cost); once the (k + 1)x FLOPs make the verification compute-bound, T_verify grows
towards (k + 1) x T_decode and the speedup falls below 1: the crossover batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.flops import flops_per_token
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.speed import StepTime, decode_step, smallest_batch
from fitserve.ledger.weights import WeightBytes

SPEEDUP_BATCHES = (1, 4, 16, 32, 64, 128, 256)
MAX_CROSSOVER_BATCH = 4096


def check_speculative(k: int, alpha: float, draft_cost: float) -> None:
    """Raise PlanError, naming the value, unless k >= 1 (an int), 0 <= alpha <= 1 and
    0 <= draft_cost < inf."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PlanError(f"speculative k (draft tokens per verification) must be an integer "
                        f">= 1, got {k!r}")
    if not 0.0 <= alpha <= 1.0:  # NaN fails this too
        raise PlanError(f"speculative alpha (acceptance rate per draft token) must be in "
                        f"[0, 1], got {alpha!r}")
    if not 0.0 <= draft_cost < math.inf:
        raise PlanError(f"speculative draft_cost (draft step / target decode step) must be "
                        f">= 0 and finite, got {draft_cost!r}")


@dataclass(frozen=True)
class Speculation:
    """k draft tokens per verification, each accepted with probability ``alpha``; one draft
    step costs ``draft_cost`` target decode steps at the same batch (0: n-gram lookup)."""

    k: int
    alpha: float
    draft_cost: float

    def __post_init__(self) -> None:
        check_speculative(self.k, self.alpha, self.draft_cost)


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens a sequence gains per verification: (1 - alpha^(k+1)) / (1 - alpha), k + 1 at
    alpha = 1 (the accepted prefix of k drafts, plus the target's own next token)."""
    check_speculative(k, alpha, 0.0)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def extra_flops_fraction(alpha: float, k: int) -> float:
    """Verification FLOPs per generated token over plain decode's, less one:
    (k + 1) / E(alpha, k) - 1 (k + 1 positions computed, E kept; the draft's FLOPs excluded)."""
    return (k + 1) / expected_tokens_per_step(alpha, k) - 1.0


def verify_step(spec: ModelSpec, hw: Hardware, wb: WeightBytes, *, batch: int, k: int,
                context: int, kv_dtype: str, weights_fmt: str) -> StepTime:
    """One verification step of ``batch`` sequences x (k + 1) positions on one rank.

        t_memory  = (weight bytes read by B(k+1) tokens + B x KV bytes of ``context``) / bw
        t_compute = B(k+1) x flops_per_token(context) / peak        (decode_step at B(k+1))

    ``.batch`` of the result counts token positions, B x (k + 1).
    """
    # NOTE: decode_step at B(k+1) tokens gives the weights read (MoE: the experts B(k+1)
    # tokens touch, more than B tokens do), the FLOPs and the all-reduce; only the KV is read
    # once per sequence, so it comes from decode_step at B. The k + 1 positions are priced at
    # ``context`` (not context + i) and the KV they write is left out, as decode_step does.
    wide = decode_step(spec, hw, wb, batch=batch * (k + 1), context=context, kv_dtype=kv_dtype,
                       weights_fmt=weights_fmt)
    kv = decode_step(spec, hw, wb, batch=batch, context=context, kv_dtype=kv_dtype,
                     weights_fmt=weights_fmt).kv_bytes
    return StepTime(wide.batch, context, wide.weight_bytes, kv, wide.flops,
                    (wide.weight_bytes + kv) / hw.mem_bytes_per_s, wide.t_compute, wide.t_comm)


def speedup_from_times(t_decode: float, t_verify: float, sp: Speculation) -> float:
    """E / (t_verify + k x draft_cost x t_decode) tokens/s over 1 / t_decode (per sequence)."""
    t_round = t_verify + sp.k * sp.draft_cost * t_decode
    return expected_tokens_per_step(sp.alpha, sp.k) * t_decode / t_round


@dataclass(frozen=True)
class SpeculativePoint:
    """One batch size: plain decode step, verification step, and speculation's speedup."""

    batch: int
    t_decode: float
    t_verify: float
    verify_bound: str  # "memory" or "compute"
    speedup: float


def speculative_point(spec: ModelSpec, hw: Hardware, wb: WeightBytes, sp: Speculation, *,
                      batch: int, context: int, kv_dtype: str,
                      weights_fmt: str) -> SpeculativePoint:
    """T_decode(B), T_verify(B) and speedup(B) (see the module docstring)."""
    dec = decode_step(spec, hw, wb, batch=batch, context=context, kv_dtype=kv_dtype,
                      weights_fmt=weights_fmt)
    ver = verify_step(spec, hw, wb, batch=batch, k=sp.k, context=context, kv_dtype=kv_dtype,
                      weights_fmt=weights_fmt)
    return SpeculativePoint(batch, dec.seconds, ver.seconds, ver.bound,
                            speedup_from_times(dec.seconds, ver.seconds, sp))


def speculative_speedup(spec: ModelSpec, hw: Hardware, wb: WeightBytes, sp: Speculation, *,
                        batch: int, context: int, kv_dtype: str, weights_fmt: str) -> float:
    """Tokens/s with speculation over without, at ``batch`` sequences of ``context`` tokens:
    E(alpha, k) x T_decode(B) / (T_verify(B) + k x draft_cost x T_decode(B))."""
    return speculative_point(spec, hw, wb, sp, batch=batch, context=context, kv_dtype=kv_dtype,
                             weights_fmt=weights_fmt).speedup


def crossover_batch(spec: ModelSpec, hw: Hardware, wb: WeightBytes, sp: Speculation, *,
                    context: int, kv_dtype: str, weights_fmt: str,
                    max_batch: int = MAX_CROSSOVER_BATCH) -> int | None:
    """Smallest batch where speculation stops paying (speedup < 1); None if it pays at every
    batch up to ``max_batch``. Doubles from 1, then bisects to the exact integer."""
    # NOTE: the bisection is exact where speedup(B) only falls with B. Dense models: it does,
    # T_verify / T_decode only grows (1 while both are memory-bound, up to k + 1 once both are
    # compute-bound). MoE need not: k + 1 positions per sequence touch more experts than one,
    # so the speedup can dip below 1 at small batches and recover once the batch touches every
    # expert (SpeculativeEconomics.pays_again_at); the answer is then a batch where it stops.
    def stops(b: int) -> bool:
        return speculative_speedup(spec, hw, wb, sp, batch=b, context=context, kv_dtype=kv_dtype,
                                   weights_fmt=weights_fmt) < 1.0

    return smallest_batch(stops, max_batch)


@dataclass(frozen=True)
class SpeculativeEconomics:
    """Speculative decoding priced on the roofline for one model, machine and context."""

    k: int
    alpha: float
    draft_cost: float
    context: int
    expected_tokens: float  # E(alpha, k) per verification
    draft_cost_per_verify: float  # k x draft_cost, in target decode steps
    extra_flops_fraction: float  # (k + 1) / E - 1 of plain decode's FLOPs per token
    flops_per_token: int  # plain decode, whole model, at ``context``
    extra_flops_per_token: float
    points: tuple[SpeculativePoint, ...]
    crossover_batch: int | None  # smallest batch with speedup < 1; None: pays up to max_batch
    max_batch: int
    pays_again_at: int | None = None  # a listed batch past the crossover with speedup >= 1 (MoE)

    @property
    def speedups(self) -> tuple[tuple[int, float], ...]:
        """(batch, speedup) at each batch of ``points``."""
        return tuple((p.batch, p.speedup) for p in self.points)


def speculative_economics(spec: ModelSpec, hw: Hardware, wb: WeightBytes, sp: Speculation, *,
                          context: int, kv_dtype: str, weights_fmt: str,
                          batches: tuple[int, ...] = SPEEDUP_BATCHES,
                          max_batch: int = MAX_CROSSOVER_BATCH) -> SpeculativeEconomics:
    """Every figure of the plan's speculative section (see SpeculativeEconomics)."""
    points = tuple(speculative_point(spec, hw, wb, sp, batch=b, context=context,
                                     kv_dtype=kv_dtype, weights_fmt=weights_fmt) for b in batches)
    extra = extra_flops_fraction(sp.alpha, sp.k)
    f = flops_per_token(spec, context).total
    cross = crossover_batch(spec, hw, wb, sp, context=context, kv_dtype=kv_dtype,
                            weights_fmt=weights_fmt, max_batch=max_batch)
    again = None if cross is None else next(
        (p.batch for p in points if p.batch > cross and p.speedup >= 1.0), None)
    return SpeculativeEconomics(sp.k, sp.alpha, sp.draft_cost, context,
                                expected_tokens_per_step(sp.alpha, sp.k), sp.k * sp.draft_cost,
                                extra, f, extra * f, points, cross, max_batch, again)
