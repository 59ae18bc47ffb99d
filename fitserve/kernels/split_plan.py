"""How many splits of the key axis a split-KV decode kernel uses: the wave-efficiency rule.

The rule and its picture are in fitserve/tools/labs/split_kv.py (the float reference of the split
decode); the Triton paged decode kernel (fitserve/kernels/triton/decode.py) sizes its grid with it.
"""

from __future__ import annotations

import math


def wave_efficiency(work_items: int, num_workers: int) -> float:
    """Fraction of worker slots busy over all waves: items / (workers * waves)."""
    waves = math.ceil(work_items / num_workers)
    return work_items / (num_workers * waves)


def choose_num_splits(num_workers: int, batch: int, num_kv_heads: int, num_kv_blocks: int,
                      max_splits: int = 128, slack: float = 0.85) -> int:
    """Number of KV splits for decode by the wave-efficiency rule (see module docstring).

    Args:
        num_workers: parallel workers (SMs on a GPU, cores on a CPU).
        batch, num_kv_heads: work items without splitting are batch * num_kv_heads.
        num_kv_blocks: key tiles of the longest sequence (ceil(S_max / block_n)).
        max_splits: upper bound on P.
        slack: choose the smallest P within this fraction of the best efficiency.
    """
    items = batch * num_kv_heads
    if items >= 0.8 * num_workers or num_kv_blocks <= 1:
        return 1
    cap = max(1, min(max_splits, num_workers, num_kv_blocks))

    def eligible(p: int) -> bool:
        return p == 1 or math.ceil(num_kv_blocks / p) != math.ceil(num_kv_blocks / (p - 1))

    effs = {p: wave_efficiency(items * p, num_workers) for p in range(1, cap + 1) if eligible(p)}
    best = max(effs.values())
    return min(p for p, e in effs.items() if e >= slack * best)
