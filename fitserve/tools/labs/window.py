"""Sliding-window tile counting: how many key tiles are skipped, fully visible, or need a mask.

A query tile holds rows at positions [p0, p1]; a key tile holds keys [k0, k1]. With window w
(a query at p sees keys p-w+1 .. p; w = None means plain causal):

    skipped : k0 > p1  or  k1 < p0 - w + 1        no pair visible, tile never loaded
    full    : k1 <= p0 and k0 >= p1 - w + 1        every pair visible, no mask applied
    masked  : otherwise                            loaded, masked elementwise

    L = 12, tiles 4 x 4, w = 5         key tile:  0      1      2
    q tile 0 (p 0..3)                            masked skip   skip
    q tile 1 (p 4..7)                            masked masked skip
    q tile 2 (p 8..11)                           skip   masked masked

For one query tile the visible key tiles form one contiguous index range and so do the full
ones, so the count is O(1) per query tile. Work is taken as proportional to visited tiles
(full + masked); the predicted speedup of a window over causal is the ratio of visited tiles,
shown next to the naive ratio L / w and the exact ratio of visible (query, key) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TileCounts:
    """Key-tile classification summed over all query tiles of one head."""

    skipped: int
    full: int
    masked: int
    loaded_keys: int = 0    # sum over query tiles of keys in the visited key tiles (K/V reads)
    loaded_area: int = 0    # sum over query tiles of rows x loaded keys (score entries computed)

    @property
    def visited(self) -> int:
        """Tiles that are loaded and multiplied."""
        return self.full + self.masked

    @property
    def total(self) -> int:
        """All (query tile, key tile) pairs."""
        return self.skipped + self.full + self.masked


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def count_key_tiles(num_queries: int, num_keys: int, block_m: int, block_n: int,
                    window: int | None = None) -> TileCounts:
    """Exact tile counts for T queries at the end of L keys (bottom-right, causal, window)."""
    n_tiles_k = _cdiv(num_keys, block_n)
    w = num_keys + num_queries + 1 if window is None else window  # NOTE: "infinite" window
    offset = num_keys - num_queries
    skipped = full = masked = loaded_keys = loaded_area = 0
    for i0 in range(0, num_queries, block_m):
        p0 = offset + i0
        p1 = offset + min(i0 + block_m, num_queries) - 1
        lo_key, hi_key = max(0, p0 - w + 1), min(p1, num_keys - 1)
        if hi_key < lo_key:
            skipped += n_tiles_k
            continue
        first, last = lo_key // block_n, hi_key // block_n       # visible key-tile range
        visible = last - first + 1
        # full tiles: k0 >= p1 - w + 1 and k1 <= p0, where tile t ends at min((t+1)n, L) - 1
        f_first = _cdiv(max(0, p1 - w + 1), block_n)
        f_last = n_tiles_k - 1 if p0 >= num_keys - 1 else (p0 + 1) // block_n - 1
        n_full = max(0, min(f_last, last) - max(f_first, first) + 1)
        full += n_full
        masked += visible - n_full
        skipped += n_tiles_k - visible
        keys = min((last + 1) * block_n, num_keys) - first * block_n
        loaded_keys += keys
        loaded_area += keys * (p1 - p0 + 1)
    return TileCounts(skipped, full, masked, loaded_keys, loaded_area)


def brute_force_key_tiles(num_queries: int, num_keys: int, block_m: int, block_n: int,
                          window: int | None = None) -> TileCounts:
    """Tile counts by checking every pair (test oracle for :func:`count_key_tiles`)."""
    w = num_keys + num_queries + 1 if window is None else window
    offset = num_keys - num_queries
    counts = {"skipped": 0, "full": 0, "masked": 0, "loaded_keys": 0, "loaded_area": 0}
    for i0 in range(0, num_queries, block_m):
        rows = range(offset + i0, offset + min(i0 + block_m, num_queries))
        for j0 in range(0, num_keys, block_n):
            cols = range(j0, min(j0 + block_n, num_keys))
            vis = [p - w + 1 <= j <= p for p in rows for j in cols]
            key = "full" if all(vis) else ("masked" if any(vis) else "skipped")
            counts[key] += 1
            if any(vis):
                counts["loaded_keys"] += len(cols)
                counts["loaded_area"] += len(cols) * len(rows)
    return TileCounts(**counts)


@dataclass(frozen=True, slots=True)
class WindowSpeedup:
    """Predicted speedup of a sliding window over plain causal attention for one prefill."""

    causal: TileCounts
    windowed: TileCounts
    naive_ratio: float      # L / w
    pair_ratio: float       # visible pairs causal / visible pairs windowed

    @property
    def tile_ratio(self) -> float:
        """Visited tiles causal / visited tiles windowed (what a tiled kernel realises)."""
        return self.causal.visited / max(1, self.windowed.visited)


def visible_pairs(seq_len: int, window: int | None) -> int:
    """Number of visible (query, key) pairs of a causal prefill of L tokens, optionally windowed."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


def predict_window_speedup(seq_len: int, window: int, block_m: int, block_n: int
                           ) -> WindowSpeedup:
    """Tile-count prediction vs the naive L / w ratio for a prefill of ``seq_len`` tokens."""
    return WindowSpeedup(
        causal=count_key_tiles(seq_len, seq_len, block_m, block_n, None),
        windowed=count_key_tiles(seq_len, seq_len, block_m, block_n, window),
        naive_ratio=seq_len / window,
        pair_ratio=visible_pairs(seq_len, None) / visible_pairs(seq_len, window),
    )
