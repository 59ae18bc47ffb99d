"""Ring all-reduce as index arithmetic: reduce-scatter then all-gather over a simulated ring.

p ranks, each holding a vector of n numbers, split into p chunks (when p does not divide n
the first n mod p chunks hold one more element). Rank r sends to rank r+1 (mod p)::

    reduce-scatter, step s = 0 .. p-2:  rank r sends chunk (r - s) mod p; the receiver adds it
                                        to its own copy. After p-1 steps rank r holds the
                                        whole sum of chunk (r + 1) mod p.
    all-gather,     step s = 0 .. p-2:  rank r sends chunk (r + 1 - s) mod p; the receiver
                                        overwrites its copy. After p-1 steps all hold all.

    p = 3, chunks a b c:   step 0: r0 sends a, r1 sends b, r2 sends c
                           step 1: r0 sends c (=c0+c2), r1 sends a, r2 sends b  -> r0 owns b ...

Each rank sends 2(p-1) chunks: every chunk but (r+1) mod p in the first phase and every chunk
but (r+2) mod p in the second, 2n - |chunk r+1| - |chunk r+2| elements, = 2(p-1)/p x n when p
divides n. Pure Python (no torch): the planner and its tests use it.
"""

from __future__ import annotations

from dataclasses import dataclass


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """[start, end) of each of the p chunks of n elements (the first n mod p one longer)."""
    if p < 1 or n < 0:
        raise ValueError(f"need p >= 1 ranks and n >= 0 elements, got p={p}, n={n}")
    base, extra = divmod(n, p)
    out, at = [], 0
    for i in range(p):
        size = base + (1 if i < extra else 0)
        out.append((at, at + size))
        at += size
    return out


@dataclass(frozen=True)
class RingResult:
    vectors: list[list[float]]  # every rank's vector afterwards
    sent: list[int]  # elements each rank sent
    steps: int  # communication steps (each a send to the next rank, all ranks at once)


def ring_allreduce(vectors: list[list[float]]) -> RingResult:
    """All-reduce (sum) ``vectors`` (one per rank, equal length) the way a ring does."""
    p = len(vectors)
    if p == 0:
        raise ValueError("no ranks")
    n = len(vectors[0])
    if any(len(v) != n for v in vectors):
        raise ValueError("every rank's vector must have the same length")
    data = [list(v) for v in vectors]
    bounds = chunk_bounds(n, p)
    sent = [0] * p
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(p - 1):
            # every rank sends at once: read all messages before anyone applies one
            msgs = []
            for r in range(p):
                c = (r - s) % p if phase == "reduce-scatter" else (r + 1 - s) % p
                lo, hi = bounds[c]
                msgs.append((r, c, data[r][lo:hi]))
                sent[r] += hi - lo
            for r, c, payload in msgs:
                dst = (r + 1) % p
                lo, _ = bounds[c]
                for i, x in enumerate(payload):
                    data[dst][lo + i] = data[dst][lo + i] + x if phase == "reduce-scatter" else x
    return RingResult(data, sent, 2 * (p - 1))


def ring_bytes_per_rank(n_bytes: float, p: int) -> float:
    """What each rank sends in a ring all-reduce of n_bytes: 2 (p - 1) / p x n_bytes."""
    return 0.0 if p <= 1 else 2 * (p - 1) / p * n_bytes
