"""Per-request block tables over a :class:`BlockPool`, with exact accounting. Torch-free.

A request's block table maps its token positions to physical slots::

    block_size = 4, request of 10 tokens (positions 0..9)

    positions   0 1 2 3 | 4 5 6 7 | 8 9 . .
    table       [   7   ,    2    ,   5   ]     slot(p) = table[p // 4] * 4 + p % 4
    used slots  10, allocated slots 3 * 4 = 12, unused (internal fragmentation) 2

Only the last block of a table can be partly filled, so a request wastes < block_size slots.

Prefix caching (vLLM's automatic prefix caching): once a request's full blocks are computed, the
caller registers them (:meth:`cache_blocks`) under their chained hashes
(:mod:`fitserve.kv.prefix_hash`). A later request looks its own hashes up
(:meth:`get_computed_blocks`) and starts its table with the blocks found (``allocate(...,
computed_blocks=...)``): those tokens are not computed again. A freed cached block stays
cached, evictable, until the pool needs it::

    block_size 4    A = [a0 .. a9] computed, registered: blocks 7 (h0), 2 (h1); 5 is partial
    B = [a0 .. a7, b8 .. b12]  hashes h0, h1, h(b8..b11)  ->  hits [7, 2]: 8 tokens cached
    B's table       [7, 2, new, new]          ref(7) = ref(2) = 2, B computes from position 8

Copy-on-write: :meth:`fork` shares every block of the parent's table, the partly filled last
one included. Before a request writes a block that another table still holds, it gets a private
copy (:meth:`allocate_for_write`): a new block, a (src, dst) copy for the runner when the block
holds earlier tokens, and one reference less on the shared one. The last holder left writes in
place, so n sharers of a partial block cost n - 1 copies::

    block_size 4, P = [p0 .. p5] computed; fork -> C       P: [3, 8]   C: [3, 8]   ref(8) = 2
    P writes p6 (block 8, slot 2)   ref(8) = 2 -> copy      P: [3, 9]   copy 8 -> 9, ref(8) = 1
    C writes c6 (block 8, slot 2)   ref(8) = 1 -> in place  C: [3, 8]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fitserve.kv.block_pool import BlockPool
from fitserve.kv.prefix_hash import BlockHash


@dataclass(slots=True)
class KVStats:
    """A snapshot of the pool, counting each physical block once even when shared.

    For a block shared by several requests (fork / prefix cache), its used slots are the most
    any holder uses in it: holders of one block see the same tokens, so the slots are counted
    once and never more than ``block_size``.

    ``free_blocks`` includes the evictable cached blocks: they hold a reusable prefix but are
    taken (evicted) as soon as an allocation needs them, so they are as good as free.
    """

    num_blocks: int
    used_blocks: int
    free_blocks: int
    allocated_slots: int  # used_blocks * block_size
    used_slots: int  # slots holding (or reserved for) a token
    fragmentation: float  # (allocated_slots - used_slots) / allocated_slots; 0.0 when empty
    # Prefix cache, in tokens like vLLM's prefix_cache_queries / prefix_cache_hits: since start,
    # the tokens of every admitted request (a preempted one again when it is readmitted) and,
    # of those, the tokens found cached. 0 with caching off.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    shared_blocks: int = 0  # held blocks in more than one table (forks, beams, prefix hits)
    cached_blocks: int = 0  # blocks registered under a prefix hash, held or evictable
    evictable_cached_blocks: int = 0  # cached blocks nobody holds (counted in free_blocks)
    # blocks ever handed out (BlockPool.num_touched_blocks): on CPU the runner's cache is backed
    # lazily, so this many blocks of the pool are resident, the rest costs no memory yet
    touched_blocks: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the pool and every request's block table.

    ``enable_caching=False`` turns the prefix cache off: lookups find nothing and
    :meth:`cache_blocks` registers nothing, so blocks are never shared except by :meth:`fork`.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size: int = block_size
        self.enable_caching: bool = enable_caching
        self.pool: BlockPool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._used_slots: dict[str, int] = {}  # tokens the request's table is sized for
        self._num_registered: dict[str, int] = {}  # leading table blocks already cache_blocks'd
        self.prefix_cache_queries: int = 0
        self.prefix_cache_hits: int = 0

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` holds a block table (possibly empty)."""
        return request_id in self._tables

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs for its table to cover ``num_tokens`` slots."""
        have = len(self._tables.get(request_id, ()))
        return max(0, _cdiv(num_tokens, self.block_size) - have)

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """The cached blocks of the longest cached prefix of a ``num_tokens``-token sequence
        whose full blocks hash to ``block_hashes``; nothing is changed (see :meth:`allocate`).

        At most ``(num_tokens - 1) // block_size`` blocks, so at least the last token is left
        to compute: its forward pass gives the logits to sample from::

            block_size 4, 8 tokens, both blocks cached   ->  1 block (4 tokens) returned:
            the cap (8 - 1) // 4 = 1 leaves t4 .. t7 to recompute; with 9 tokens: 2 blocks
        """
        if not self.enable_caching or num_tokens < 1:
            return []
        limit = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        hits: list[int] = []
        for h in block_hashes[:limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup: ``num_tokens`` queried, ``num_hit_tokens`` hit."""
        if not 0 <= num_hit_tokens <= num_tokens:
            raise ValueError(f"hit {num_hit_tokens} of {num_tokens} tokens")
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate(self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Grow the request's table to cover ``num_tokens`` slots; all-or-nothing.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, only for a request with no
        blocks yet) start the table: each gets one more reference, an evictable one leaves the
        free list, and only the rest of the table is newly allocated.

        Returns False, with nothing changed, if the pool lacks the blocks. On success records
        ``num_tokens`` as the request's used slots (the table never shrinks).
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        hits = list(computed_blocks)
        if hits:
            if self._tables.get(request_id):
                raise ValueError(f"computed blocks for {request_id!r}, which already has blocks")
            if len(hits) * self.block_size > num_tokens:
                raise ValueError(f"{len(hits)} computed blocks exceed {num_tokens} tokens")
        need = self.blocks_needed(request_id, num_tokens) - len(hits)
        # an evictable hit is taken off the free list too, so it counts against what is free
        revived = sum(1 for b in set(hits) if self.pool.ref_count(b) == 0)
        if need + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(hits)
        new = self.pool.allocate(need)
        table = self._tables.setdefault(request_id, [])
        table.extend(hits)
        table.extend(new)
        self._used_slots[request_id] = num_tokens
        if hits:
            self._num_registered[request_id] = len(hits)
        return True

    def allocate_for_write(self, request_id: str, write_start: int, num_tokens: int) -> list[tuple[int, int]] | None:
        """Make the request's table ready for it to write positions ``[write_start, num_tokens)``:
        grow it (as :meth:`allocate`) and give it a private copy of every block in that range
        that another table also holds (copy-on-write); all-or-nothing.

        Returns the (src, dst) block copies the runner must make before the step's writes (only
        for blocks holding tokens before ``write_start``; a block the write fills from its first
        slot needs no copy), or None, with nothing changed, if the pool lacks the blocks.
        """
        if not 0 <= write_start <= num_tokens:
            raise ValueError(f"write range [{write_start}, {num_tokens}) is not a range")
        table = self._tables.get(request_id, [])
        bs = self.block_size
        first, end = write_start // bs, min(len(table), _cdiv(num_tokens, bs))
        shared = [i for i in range(first, end) if self.pool.ref_count(table[i]) > 1]
        if self.blocks_needed(request_id, num_tokens) + len(shared) > self.pool.num_free_blocks:
            return None
        copies: list[tuple[int, int]] = []
        if shared:
            olds = [table[i] for i in shared]
            fresh = self.pool.allocate(len(shared))
            for i, old, new in zip(shared, olds, fresh, strict=True):
                if i * bs < write_start:
                    copies.append((old, new))
                table[i] = new
            # NOTE: a registered (cached) block is full and never written again, so a block
            # replaced here is never one of the registered leading blocks.
            self.pool.decref(olds)
        ok = self.allocate(request_id, num_tokens)
        assert ok, "blocks were counted above"
        return copies

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Shrink the request's table to the blocks ``num_tokens`` slots need (speculative
        decoding's rollback: the slots of rejected draft tokens are just past the length, and
        blocks that held only those go back to the pool at once). Returns the blocks freed."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        keep = _cdiv(num_tokens, self.block_size)
        extra = table[keep:]
        if extra:
            del table[keep:]
            self.pool.decref(reversed(extra))
        self._used_slots[request_id] = min(self._used_slots[request_id], num_tokens)
        return len(extra)

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int
    ) -> None:
        """Register the request's blocks that are now full and computed (the first
        ``num_computed_tokens // block_size``) under ``block_hashes``, for later lookups.

        Call it after the step that wrote them; blocks registered before are skipped, so each
        call costs only the newly filled blocks. A no-op with caching off.
        """
        if not self.enable_caching:
            return
        table = self._tables.get(request_id)
        if not table:
            return
        start = self._num_registered.get(request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        for i in range(start, end):
            self.pool.cache_block(table[i], block_hashes[i])
        if end > start:
            self._num_registered[request_id] = end

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block (e.g. between benchmark runs); returns how many."""
        return self.pool.reset_prefix_cache()

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty for an unknown request)."""
        return list(self._tables.get(request_id, ()))

    def free(self, request_id: str) -> None:
        """Drop the request's reference on every one of its blocks at once; unknown id: no-op."""
        table = self._tables.pop(request_id, None)
        self._used_slots.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if table:
            # NOTE: tail first, so the blocks holding the latest tokens are evicted first and
            # the prefix cache keeps the shared heads (prompt prefixes) longest; a tail block
            # is useless without the blocks before it anyway.
            self.pool.decref(reversed(table))

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (incref); whichever of them writes a
        shared block first gets a private copy (:meth:`allocate_for_write`)."""
        if parent_id not in self._tables:
            raise KeyError(f"fork from unknown request {parent_id!r}")
        if child_id in self._tables:
            raise ValueError(f"fork into existing request {child_id!r}")
        table = list(self._tables[parent_id])
        self.pool.incref(table)
        self._tables[child_id] = table
        self._used_slots[child_id] = self._used_slots[parent_id]
        if parent_id in self._num_registered:
            self._num_registered[child_id] = self._num_registered[parent_id]

    def block_owners(self) -> dict[int, list[str]]:
        """Physical block id -> ids of the requests holding it, in request insertion order."""
        owners: dict[int, list[str]] = {}
        for rid, table in self._tables.items():
            for b in table:
                owners.setdefault(b, []).append(rid)
        return owners

    def stats(self) -> KVStats:
        """Used/free blocks and slots; shared blocks counted once (see :class:`KVStats`)."""
        bs = self.block_size
        used_in_block: dict[int, int] = {}
        for rid, table in self._tables.items():
            used = self._used_slots[rid]
            for i, b in enumerate(table):
                # slots of block i that hold positions < used: clamp(used - i*bs, 0, bs)
                n = min(bs, max(0, used - i * bs))
                used_in_block[b] = max(used_in_block.get(b, 0), n)
        used_blocks = self.pool.num_used_blocks
        shared = sum(1 for b in used_in_block if self.pool.ref_count(b) > 1)
        allocated = used_blocks * bs
        used_slots = sum(used_in_block.values())
        frag = (allocated - used_slots) / allocated if allocated else 0.0
        return KVStats(
            num_blocks=self.pool.num_blocks,
            used_blocks=used_blocks,
            free_blocks=self.pool.num_free_blocks,
            allocated_slots=allocated,
            used_slots=used_slots,
            fragmentation=frag,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            shared_blocks=shared,
            cached_blocks=self.pool.num_cached_blocks,
            evictable_cached_blocks=self.pool.num_evictable_cached_blocks,
            touched_blocks=self.pool.num_touched_blocks,
        )
