"""One KV-cache group: the layers of one attention kind, their own pool and block tables.
Torch-free.

A model whose layers all attend the same way (Llama: every layer full; Mistral: every layer
windowed) has one group. A hybrid model (Gemma 2/3: ``ModelSpec.layer_types`` mixes "sliding"
and "full") has two, as vLLM v1's hybrid KV cache manager has one ``SingleTypeKVCacheManager``
per group. Every group sees the same token positions and block size, so one block index ``i``
means tokens ``[i * bs, (i + 1) * bs)`` in every group, and one hash chain keys every group's
prefix cache; only the physical block ids differ.

A windowed group holds only the blocks its window can still read. A query at position ``p``
sees keys ``p - window + 1 .. p``; once the request has ``c`` computed tokens, its next query
sits at ``c`` or later, so blocks wholly before ``c - window + 1`` are dead. They go back to
the pool, and their table slots point at the group's *null block* (id 0, held by the group
forever, never written), which the kernels may read but the window mask always hides::

    window 5, block_size 4, 14 computed tokens, next query at 14 sees keys 10 .. 14
    positions   0..3 | 4..7 | 8..11 | 12..15
    table       [ 0  ,  0   ,  6    ,  9  ]     blocks 0 and 1 freed (0 = the null block)

NOTE: a null block instead of dropping the table's head keeps ``slot(p) = table[p // bs] * bs
+ p % bs`` and every attention backend unchanged; reading one zero block a sequence is what
padding a batch's tables already costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fitserve.kv.block_pool import BlockPool
from fitserve.kv.prefix_hash import BlockHash

NULL_BLOCK = 0
"""The block id a windowed group's dropped table slots point at (never handed to a request)."""


@dataclass(frozen=True, slots=True)
class KVGroup:
    """What one group is: its attention kind, its window, its pool size, and its layers.

    ``num_blocks`` counts the whole pool; a windowed group's null block is one of them.
    """

    kind: str  # "full" or "sliding"
    num_blocks: int
    window: int | None = None
    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("full", "sliding"):
            raise ValueError(f"a KV group is 'full' or 'sliding', got {self.kind!r}")
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError(f"a {self.kind} group needs window {'set' if self.kind == 'sliding' else 'None'}, "
                             f"got {self.window}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {self.window}")
        if self.num_blocks < (2 if self.window else 1):
            raise ValueError(f"a {self.kind} group needs at least {2 if self.window else 1} blocks "
                             f"(a windowed pool keeps one as its null block), got {self.num_blocks}")


@dataclass(frozen=True, slots=True)
class GroupStats:
    """One group's pool at one moment (the dashboard's per-group line)."""

    kind: str
    window: int | None
    num_layers: int
    num_blocks: int  # usable: a windowed pool's null block left out
    used_blocks: int
    free_blocks: int
    # table slots the window has released since start (a block shared by k tables counts k
    # times: each release is one reference back to the pool); 0 for a full group
    window_freed_blocks: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupTables:
    """The block tables of every request in one group, over that group's own pool."""

    def __init__(self, group: KVGroup, block_size: int) -> None:
        self.group = group
        self.window: int | None = group.window
        self.block_size = block_size
        self.pool = BlockPool(group.num_blocks)
        self.null_block: int | None = None
        if self.window is not None:
            (self.null_block,) = self.pool.allocate(1)
            assert self.null_block == NULL_BLOCK
        self.tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # leading table slots already cache_blocks'd
        self.window_freed_blocks = 0  # remove_skipped's releases since start

    # ---------------------------------------------------------------- counts

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: the pool less the null block."""
        return self.pool.num_blocks - (self.null_block is not None)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests (the null block not counted)."""
        return self.pool.num_used_blocks - (self.null_block is not None)

    def stats(self) -> GroupStats:
        return GroupStats(self.group.kind, self.window, len(self.group.layers),
                          self.num_usable_blocks, self.num_used_blocks, self.pool.num_free_blocks,
                          self.window_freed_blocks)

    def live(self, table: Sequence[int]) -> list[int]:
        """The table's real blocks (null slots left out)."""
        if self.null_block is None:
            return list(table)
        return [b for b in table if b != self.null_block]

    def first_live_slot(self, num_computed: int) -> int:
        """Index of the first table slot the next query (at ``num_computed`` or later) can read."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def blocks_needed(self, request_id: str, num_tokens: int, num_computed: int = 0) -> int:
        """New blocks the request's table needs to cover ``num_tokens`` slots (a slot before the
        window of a query at ``num_computed`` needs none: it is the null block)."""
        table = self.tables.get(request_id, ())
        want = _cdiv(num_tokens, self.block_size)
        return max(0, want - max(len(table), self.first_live_slot(num_computed)))

    # ---------------------------------------------------------------- the window

    def remove_skipped(self, request_id: str, num_computed: int) -> int:
        """Free the blocks no query at ``num_computed`` or later can read (vLLM's
        ``SlidingWindowManager.remove_skipped_blocks``); their slots become the null block.
        Returns how many were freed; 0 for a full group."""
        table = self.tables.get(request_id)
        if self.window is None or not table:
            return 0
        end = min(self.first_live_slot(num_computed), len(table))
        dead: list[int] = []
        for i in range(end - 1, -1, -1):  # stop at the first null: everything before is null
            if table[i] == self.null_block:
                break
            dead.append(table[i])
            table[i] = NULL_BLOCK
        # NOTE: oldest first, so the prefix cache evicts the oldest window blocks first.
        self.pool.decref(reversed(dead))
        self.window_freed_blocks += len(dead)
        return len(dead)

    # ---------------------------------------------------------------- prefix hits

    def longest_hit(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """The blocks of the longest cached prefix of at most ``max_blocks`` blocks this group
        can start a request from; nothing is changed.

        Full group: the leading run of cached hashes. Windowed group (vLLM's
        ``SlidingWindowManager.find_longest_cache_hit``): a hit of ``h`` blocks needs only the
        blocks the next query's window reads, the last ``ceil((window - 1) / bs)`` before
        ``h``; the others are null. Searching right to left, the first run that long ends the
        longest hit; none: the leading run (shorter than a window, so the whole prefix)::

            window 9 (2 blocks of 4), cached   h0  .   h2  h3  h4  .
            hit of 5 blocks: [null, null, null, b3, b4]       (h2 is not even needed)
        """
        n = min(max_blocks, len(block_hashes))
        if self.window is None:
            hits: list[int] = []
            for h in block_hashes[:n]:
                b = self.pool.lookup(h)
                if b is None:
                    break
                hits.append(b)
            return hits
        need = max(1, _cdiv(self.window - 1, self.block_size))
        found: list[int | None] = [None] * n
        run = 0
        for i in range(n - 1, -1, -1):
            b = self.pool.lookup(block_hashes[i])
            if b is None:
                run = 0
                continue
            found[i] = b
            run += 1
            if run >= need:
                return [NULL_BLOCK] * i + [x for x in found[i : i + run] if x is not None]
        # no run as long as a window: only a leading run (the whole prefix is cached) counts
        return [b for b in found[:run] if b is not None] if run else []
