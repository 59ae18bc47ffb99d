"""Bytes read/written and FLOPs of each kernel for a given attention shape.

Conventions: "bytes" are HBM (main memory) bytes, element size b for Q/K/V/O/dO, fp32 (4) for
intermediate scores/probabilities, LSE and partial results. FLOPs count matmuls only
(2 per multiply-add): QK^T and PV are 2*D each per computed (query, key) entry, so the forward
is 4*D per entry, the backward (S recompute, dV, dP, dQ, dK) 10*D per entry. "useful" FLOPs count
visible (query, key) pairs only; "executed" FLOPs count every entry of every loaded tile.

Naive attention per query head (no GQA sharing):

    read Q, K, V   write S (fp32 M x N)   read S  write P   read P   write O
                    `--- the O(M*N) traffic tiled kernels avoid ---'

Tiled forward per KV head (GQA-folded): Q read once, O and LSE written once, and each query tile
loads the K/V tiles it visits. "re-read" counts those loads (what the kernel does); "ideal" counts
each visible key once (what an unbounded on-chip memory would allow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fitserve.tools.labs.gqa import group_size
from fitserve.tools.labs.window import count_key_tiles, visible_pairs

F32 = 4


@dataclass(frozen=True, slots=True)
class AttnShape:
    """One attention call: B sequences of T queries against L keys (bottom-right, causal)."""

    batch: int
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype_bytes: int = 2
    causal: bool = True
    window: int | None = None

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return group_size(self.num_heads, self.num_kv_heads)

    def visible(self) -> int:
        """Visible (query, key) pairs per head and sequence."""
        t, n = self.q_len, self.kv_len
        if not self.causal:
            return t * n
        all_pairs = visible_pairs(n, self.window)
        return all_pairs - visible_pairs(n - t, self.window) if n > t else all_pairs


@dataclass(frozen=True, slots=True)
class KernelCounts:
    """Traffic and work of one kernel invocation."""

    name: str
    bytes_read: int
    bytes_written: int
    flops_executed: int
    flops_useful: int

    @property
    def bytes_total(self) -> int:
        """Read + written."""
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """Executed FLOPs per byte moved."""
        return self.flops_executed / max(1, self.bytes_total)


def _qo_bytes(s: AttnShape) -> int:
    return s.batch * s.num_heads * s.q_len * s.head_dim * s.dtype_bytes


def naive_forward(s: AttnShape) -> KernelCounts:
    """Materialised S and P, K/V read per query head."""
    heads = s.batch * s.num_heads
    mn = s.q_len * s.kv_len
    kv = heads * 2 * s.kv_len * s.head_dim * s.dtype_bytes
    read = _qo_bytes(s) + kv + heads * 2 * mn * F32            # Q, K, V, S, P
    written = _qo_bytes(s) + heads * 2 * mn * F32               # O, S, P
    return KernelCounts("naive", read, written, heads * 4 * s.head_dim * mn,
                        heads * 4 * s.head_dim * s.visible())


def tiled_forward(s: AttnShape, block_m: int = 64, block_n: int = 64, *, reread: bool = True,
                  gqa_fold: bool = True) -> KernelCounts:
    """Online-softmax forward; ``reread`` K/V per query tile; ``gqa_fold`` shares K/V loads."""
    win = s.window if s.causal else None
    if s.causal:
        tiles = count_key_tiles(s.q_len, s.kv_len, block_m, block_n, win)
        loaded_keys, area = tiles.loaded_keys, tiles.loaded_area
        first_key = 0 if win is None else max(0, s.kv_len - s.q_len - win + 1)
        ideal_keys = s.kv_len - first_key
    else:
        n_qt = math.ceil(s.q_len / block_m)
        loaded_keys, area, ideal_keys = n_qt * s.kv_len, s.q_len * s.kv_len, s.kv_len
    kv_readers = s.batch * (s.num_kv_heads if gqa_fold else s.num_heads)
    keys = loaded_keys if reread else ideal_keys
    kv = kv_readers * 2 * keys * s.head_dim * s.dtype_bytes
    heads = s.batch * s.num_heads
    name = f"tiled{'' if reread else '-ideal'}{'' if gqa_fold else '-unfolded'}"
    return KernelCounts(name, _qo_bytes(s) + kv, _qo_bytes(s) + heads * s.q_len * F32,
                        heads * 4 * s.head_dim * area, heads * 4 * s.head_dim * s.visible())


def tiled_backward(s: AttnShape, block_m: int = 64, block_n: int = 64) -> KernelCounts:
    """Recomputation backward: K/V once per key tile, Q/dO/LSE/D and dQ (fp32) per visited tile."""
    fwd = tiled_forward(s, block_m, block_n)
    heads = s.batch * s.num_heads
    area = fwd.flops_executed // (4 * s.head_dim * heads)
    # NOTE: approximate: each visited tile re-reads its query rows; area / block_n is the
    # number of row loads when tiles are full (ragged edge tiles make it a slight overcount).
    row_loads = math.ceil(area / max(1, min(block_n, s.kv_len)))
    per_row = 2 * s.head_dim * s.dtype_bytes + 2 * F32 + 2 * s.head_dim * F32  # Q,dO,LSE,D,dQ rw
    kv = s.batch * s.num_kv_heads * 2 * s.kv_len * s.head_dim * s.dtype_bytes  # GQA-folded
    pre = 2 * _qo_bytes(s)                                        # D = rowsum(dO * O)
    read = pre + kv + heads * row_loads * per_row
    written = heads * s.q_len * F32 + 2 * kv + _qo_bytes(s)       # D, dK, dV, dQ (final cast)
    return KernelCounts("tiled-backward", read, written, heads * 10 * s.head_dim * area,
                        heads * 10 * s.head_dim * s.visible())


def split_kv_decode(s: AttnShape, num_splits: int) -> KernelCounts:
    """Split-KV decode (T = 1): K/V once per KV head, partial (O, LSE) fp32 written and merged."""
    keys = s.kv_len if s.window is None else min(s.kv_len, s.window)
    kv = s.batch * s.num_kv_heads * 2 * keys * s.head_dim * s.dtype_bytes
    heads = s.batch * s.num_heads
    partial = heads * num_splits * (s.head_dim + 1) * F32
    flops = heads * 4 * s.head_dim * keys * s.q_len
    return KernelCounts(f"split-kv(P={num_splits})", _qo_bytes(s) + kv + partial,
                        partial + _qo_bytes(s), flops, heads * 4 * s.head_dim * s.visible())


def paged_forward(s: AttnShape, block_size: int, block_m: int = 64, block_n: int = 64
                  ) -> KernelCounts:
    """Tiled forward plus the block-table reads (int32, one per page per loaded key tile)."""
    base = tiled_forward(s, block_m, block_n)
    tiles = count_key_tiles(s.q_len, s.kv_len, block_m, block_n, s.window)
    loaded_keys = tiles.loaded_keys if s.causal else math.ceil(s.q_len / block_m) * s.kv_len
    pages = s.batch * s.num_kv_heads * math.ceil(loaded_keys / block_size) * F32
    return KernelCounts("paged", base.bytes_read + pages, base.bytes_written,
                        base.flops_executed, base.flops_useful)


def rope_counts(tokens: int, heads: int, head_dim: int, dtype_bytes: int = 2) -> KernelCounts:
    """Fused RoPE: read x and an int32 position per token, write x; 6 FLOPs per pair."""
    elems = tokens * heads * head_dim
    return KernelCounts("rope", elems * dtype_bytes + tokens * F32, elems * dtype_bytes,
                        3 * elems, 3 * elems)


def all_counts(s: AttnShape, *, block_m: int = 64, block_n: int = 64, num_splits: int = 1
               ) -> list[KernelCounts]:
    """The counters ``fitserve kernels --explain`` prints for one shape."""
    rows = [naive_forward(s), tiled_forward(s, block_m, block_n),
            tiled_forward(s, block_m, block_n, reread=False),
            tiled_forward(s, block_m, block_n, gqa_fold=False),
            tiled_backward(s, block_m, block_n)]
    if s.q_len == 1:
        rows.append(split_kv_decode(s, num_splits))
    return rows
