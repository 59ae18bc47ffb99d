"""A latency-bandwidth (alpha-beta) model of all-reduce algorithms, and which one wins.

For p ranks, a message of n bytes, per-rank link bandwidth B (one direction), a fixed cost per
collective call ``c`` (launch and synchronisation: the catalog's ``link_latency_s``) and a
latency per communication step ``a`` (one hop across the link)::

    ring       c + 2 (p - 1) a + 2 (p - 1) / p * n / B   bandwidth-optimal, 2 (p - 1) steps
    one-shot   c +           a + (p - 1)     * n / B   every rank sends its whole vector to
                                                        the p - 1 others, all sum locally
    tree       c + 2 ceil(log2 p) (a + n / B)           reduce up a binary tree, broadcast down

Small messages are latency-bound: one-shot takes 1 step where the ring takes 2 (p - 1), so it
wins below a crossover size; large messages are bandwidth-bound and the ring's 2 (p - 1) / p
factor wins (vLLM's custom all-reduce and NCCL's LL/tree protocols act on the same trade-off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fitserve.ledger.errors import PlanError

ALGORITHMS = ("ring", "one-shot", "tree")
# NOTE: an assumption, not a sheet figure: about a microsecond per hop over NVLink-class links
# (NCCL's measured small-message latency per ring step is of this order).
DEFAULT_HOP_LATENCY_S = 1e-6


@dataclass(frozen=True)
class AllReduceCost:
    algorithm: str
    seconds: float
    steps: int  # communication steps (hops in sequence)
    wire_bytes: float  # what each rank sends


def _terms(algorithm: str, p: int) -> tuple[int, float]:
    """(steps, bytes sent per rank per byte of message) of ``algorithm`` on p ranks."""
    if algorithm == "ring":
        return 2 * (p - 1), 2 * (p - 1) / p
    if algorithm == "one-shot":
        return 1, float(p - 1)
    if algorithm == "tree":
        depth = math.ceil(math.log2(p))
        return 2 * depth, float(2 * depth)
    raise PlanError(f"unknown all-reduce algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def allreduce_cost(algorithm: str, nbytes: float, p: int, *, bandwidth: float,
                   call_latency_s: float, hop_latency_s: float = DEFAULT_HOP_LATENCY_S
                   ) -> AllReduceCost:
    if p < 1:
        raise PlanError(f"an all-reduce needs at least 1 rank, got {p}")
    if p == 1:
        return AllReduceCost(algorithm, 0.0, 0, 0.0)
    if bandwidth <= 0:
        raise PlanError(f"link bandwidth must be positive, got {bandwidth}")
    steps, factor = _terms(algorithm, p)
    if algorithm == "tree":  # each level moves the whole message over one link
        seconds = call_latency_s + steps * (hop_latency_s + nbytes / bandwidth)
    else:
        seconds = call_latency_s + steps * hop_latency_s + factor * nbytes / bandwidth
    return AllReduceCost(algorithm, seconds, steps, factor * nbytes)


def best_allreduce(nbytes: float, p: int, *, bandwidth: float, call_latency_s: float,
                   hop_latency_s: float = DEFAULT_HOP_LATENCY_S) -> AllReduceCost:
    """The fastest of ALGORITHMS for this message (ties go to the earlier one)."""
    costs = [allreduce_cost(a, nbytes, p, bandwidth=bandwidth, call_latency_s=call_latency_s,
                            hop_latency_s=hop_latency_s) for a in ALGORITHMS]
    return min(costs, key=lambda c: c.seconds)


def crossover_bytes(a: str, b: str, p: int, *, bandwidth: float,
                    hop_latency_s: float = DEFAULT_HOP_LATENCY_S) -> float | None:
    """The message size at which algorithms ``a`` and ``b`` take the same time (both are
    linear in n), or None when they never cross for n > 0."""
    def line(alg: str) -> tuple[float, float]:  # seconds = intercept + slope * n
        one = allreduce_cost(alg, 1.0, p, bandwidth=bandwidth, call_latency_s=0.0,
                             hop_latency_s=hop_latency_s)
        zero = allreduce_cost(alg, 0.0, p, bandwidth=bandwidth, call_latency_s=0.0,
                              hop_latency_s=hop_latency_s)
        return zero.seconds, one.seconds - zero.seconds

    (ia, sa), (ib, sb) = line(a), line(b)
    if sa == sb:
        return None
    n = (ib - ia) / (sa - sb)
    return n if n > 0 else None
