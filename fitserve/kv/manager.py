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

Layer groups (:mod:`fitserve.kv.group`): the manager keeps one pool and one table per request
for each group of layers of one attention kind; every operation below runs on every group and
is all-or-nothing across them. A windowed group frees the blocks its window has left behind
each time the request is given new slots (:meth:`allocate_slots`). A prefix hit is the longest
prefix every group can supply (:meth:`find_prefix_hit`). The one-group methods
(:meth:`get_computed_blocks`, :meth:`allocate_for_write`, :meth:`block_table`) act on group 0.

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
from dataclasses import dataclass, field

from fitserve.kv.block_pool import BlockPool
from fitserve.kv.group import GroupStats, GroupTables, KVGroup
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
    # a manager of several groups (hybrid sliding/full models): the blocks each group's
    # requests hold, in group order (every count above sums the groups); () for one group
    group_used_blocks: tuple[int, ...] = ()
    # every group's pool (one entry for one group); a view of the counts above, so left out of ==
    groups: tuple[GroupStats, ...] = field(default=(), compare=False)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the pools and every request's block tables, one of each per layer group.

    ``KVCacheManager(num_blocks, block_size)`` is one full-attention group; ``window=`` makes
    it one windowed group (Mistral); :meth:`from_groups` builds any list of groups.
    ``enable_caching=False`` turns the prefix cache off: lookups find nothing and
    :meth:`cache_blocks` registers nothing, so blocks are never shared except by :meth:`fork`.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 window: int | None = None, groups: Sequence[KVGroup] = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not groups:
            groups = (KVGroup("sliding" if window else "full", num_blocks, window),)
        self.block_size: int = block_size
        self.enable_caching: bool = enable_caching
        self.groups: list[GroupTables] = [GroupTables(g, block_size) for g in groups]
        self.pool: BlockPool = self.groups[0].pool  # group 0's (the only one for most models)
        self._used_slots: dict[str, int] = {}  # tokens the request's tables are sized for
        self.prefix_cache_queries: int = 0
        self.prefix_cache_hits: int = 0

    @classmethod
    def from_groups(cls, groups: Sequence[KVGroup], block_size: int, *,
                    enable_caching: bool = True) -> KVCacheManager:
        """A manager of one pool per group (:class:`fitserve.kv.group.KVGroup`)."""
        if not groups:
            raise ValueError("a KV cache manager needs at least one layer group")
        return cls(0, block_size, enable_caching=enable_caching, groups=groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def _one_group(self, what: str) -> GroupTables:
        if len(self.groups) != 1:
            raise ValueError(f"{what} is for a one-group manager; this one has {len(self.groups)} groups")
        return self.groups[0]

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` holds block tables (possibly empty)."""
        return request_id in self.groups[0].tables

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks group 0's table needs to cover ``num_tokens`` slots."""
        return self.groups[0].blocks_needed(request_id, num_tokens)

    # ---------------------------------------------------------------- prefix hits

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """One group: the cached blocks of the longest cached prefix of a ``num_tokens``-token
        sequence whose full blocks hash to ``block_hashes``; nothing is changed (see
        :meth:`find_prefix_hit`, :meth:`allocate`).

        At most ``(num_tokens - 1) // block_size`` blocks, so at least the last token is left
        to compute: its forward pass gives the logits to sample from::

            block_size 4, 8 tokens, both blocks cached   ->  1 block (4 tokens) returned:
            the cap (8 - 1) // 4 = 1 leaves t4 .. t7 to recompute; with 9 tokens: 2 blocks
        """
        self._one_group("get_computed_blocks")
        return self.find_prefix_hit(block_hashes, num_tokens)[0]

    def find_prefix_hit(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[list[int]]:
        """Per group, the blocks a request starts from: the longest prefix (in whole blocks,
        at most ``(num_tokens - 1) // block_size``) that *every* group can supply, as vLLM's
        hybrid coordinator finds it. A windowed group supplies only the blocks before the hit
        point that its window still reads (the rest of its list is the null block); shortening
        the hit can change which blocks those are, so the groups are asked again until they
        agree (each round only shortens it)::

            full cached h0..h5, window group cached h3 h4 only, window = 2 blocks
            full: 6 -> window(max 6): h4 h5? h5 missing -> run h3 h4 -> 5 -> full(max 5): 5
        """
        empty: list[list[int]] = [[] for _ in self.groups]
        if not self.enable_caching or num_tokens < 1:
            return empty
        length = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        while True:
            hits = [g.longest_hit(block_hashes, length) for g in self.groups]
            shortest = min(len(h) for h in hits)
            if shortest == length or shortest == 0:
                return hits if shortest == length else empty
            length = shortest

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup: ``num_tokens`` queried, ``num_hit_tokens`` hit."""
        if not 0 <= num_hit_tokens <= num_tokens:
            raise ValueError(f"hit {num_hit_tokens} of {num_tokens} tokens")
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # ---------------------------------------------------------------- growth

    def allocate(self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = (), *,
                 computed_groups: Sequence[Sequence[int]] | None = None) -> bool:
        """Grow the request's tables to cover ``num_tokens`` slots; all-or-nothing.

        ``computed_groups`` (from :meth:`find_prefix_hit`; ``computed_blocks`` for a one-group
        manager, from :meth:`get_computed_blocks`), only for a request with no blocks yet, start
        the tables: each real block gets one more reference, an evictable one leaves the free
        list, and only the rest of each table is newly allocated.

        Returns False, with nothing changed, if a pool lacks the blocks. On success records
        ``num_tokens`` as the request's used slots (the tables never shrink).
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if computed_groups is None:
            computed_groups = [list(computed_blocks)] + [[] for _ in self.groups[1:]]
        elif computed_blocks:
            raise ValueError("pass computed_blocks or computed_groups, not both")
        hits = [list(h) for h in computed_groups]
        if len(hits) != len(self.groups) or len({len(h) for h in hits}) > 1:
            raise ValueError(f"computed blocks must give every one of {len(self.groups)} groups "
                             f"the same number of blocks, got {[len(h) for h in hits]}")
        if hits[0]:
            if self.groups[0].tables.get(request_id):
                raise ValueError(f"computed blocks for {request_id!r}, which already has blocks")
            if len(hits[0]) * self.block_size > num_tokens:
                raise ValueError(f"{len(hits[0])} computed blocks exceed {num_tokens} tokens")
        needs = []
        for g, h in zip(self.groups, hits, strict=True):
            need = g.blocks_needed(request_id, num_tokens) - len(h)
            live = g.live(h)
            # an evictable hit is taken off the free list too, so it counts against what is free
            revived = sum(1 for b in set(live) if g.pool.ref_count(b) == 0)
            if need + revived > g.pool.num_free_blocks:
                return False
            needs.append((need, live))
        for g, h, (need, live) in zip(self.groups, hits, needs, strict=True):
            g.pool.touch(live)
            table = g.tables.setdefault(request_id, [])
            table.extend(h)
            table.extend(g.pool.allocate(need))
            if h:
                g.num_registered[request_id] = len(h)
        self._used_slots[request_id] = num_tokens
        return True

    def allocate_slots(self, request_id: str, write_start: int, num_tokens: int
                       ) -> list[list[tuple[int, int]]] | None:
        """Make the request's tables ready for it to write positions ``[write_start,
        num_tokens)``, ``write_start`` being its computed tokens: a windowed group first frees
        the blocks no query from ``write_start`` on can read; then every group grows (as
        :meth:`allocate`) and gets a private copy of each block in that range another table
        also holds (copy-on-write); the growth is all-or-nothing.

        Returns per group the (src, dst) block copies the runner must make before the step's
        writes (only for blocks holding tokens before ``write_start``; a block the write fills
        from its first slot needs no copy), or None, with no table grown, if a pool lacks the
        blocks (the window's dead blocks stay freed: nothing can read them again).
        """
        if not 0 <= write_start <= num_tokens:
            raise ValueError(f"write range [{write_start}, {num_tokens}) is not a range")
        bs = self.block_size
        want = _cdiv(num_tokens, bs)
        first = write_start // bs
        plans: list[tuple[GroupTables, list[int], list[int]]] = []
        for g in self.groups:
            if g.window is not None:
                g.remove_skipped(request_id, write_start)
            table = g.tables.get(request_id)
            if table is None:
                table = []
            pool = g.pool
            # NOTE: the null block's one reference is the group's own, so it is never "shared"
            shared = [i for i in range(first, min(len(table), want)) if pool.ref_count(table[i]) > 1]
            if max(0, want - len(table)) + len(shared) > pool.num_free_blocks:
                return None
            plans.append((g, table, shared))
        copies: list[list[tuple[int, int]]] = []
        for g, table, shared in plans:
            copies.append(self._copy_on_write(g, request_id, shared, write_start) if shared else [])
            if request_id not in g.tables:
                g.tables[request_id] = table
            if want > len(table):
                table.extend(g.pool.allocate(want - len(table)))
        self._used_slots[request_id] = num_tokens
        return copies

    def _copy_on_write(self, g: GroupTables, request_id: str, shared: list[int],
                       write_start: int) -> list[tuple[int, int]]:
        """Replace the table slots ``shared`` with private blocks; the copies the runner makes."""
        if not shared:
            return []
        table = g.tables[request_id]
        olds = [table[i] for i in shared]
        fresh = g.pool.allocate(len(shared))
        copies: list[tuple[int, int]] = []
        for i, old, new in zip(shared, olds, fresh, strict=True):
            if i * self.block_size < write_start:
                copies.append((old, new))
            table[i] = new
        # NOTE: a registered (cached) block is full and never written again, so a block
        # replaced here is never one of the registered leading blocks.
        g.pool.decref(olds)
        return copies

    def allocate_for_write(self, request_id: str, write_start: int, num_tokens: int
                           ) -> list[tuple[int, int]] | None:
        """One group: :meth:`allocate_slots`, returning that group's copies."""
        self._one_group("allocate_for_write")
        copies = self.allocate_slots(request_id, write_start, num_tokens)
        return None if copies is None else copies[0]

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Shrink the request's tables to the blocks ``num_tokens`` slots need (speculative
        decoding's rollback: the slots of rejected draft tokens are just past the length, and
        blocks that held only those go back to the pool at once). Returns the blocks freed."""
        if request_id not in self._used_slots:
            return 0
        keep = _cdiv(num_tokens, self.block_size)
        freed = 0
        for g in self.groups:
            table = g.tables[request_id]
            extra = g.live(table[keep:])
            del table[keep:]
            g.pool.decref(reversed(extra))
            freed += len(extra)
        self._used_slots[request_id] = min(self._used_slots[request_id], num_tokens)
        return freed

    # ---------------------------------------------------------------- the prefix cache

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int
    ) -> None:
        """Register the request's blocks that are now full and computed (the first
        ``num_computed_tokens // block_size``) under ``block_hashes``, in every group, for
        later lookups. Call it after the step that wrote them; blocks registered before (and a
        windowed group's null slots) are skipped, so each call costs only the newly filled
        blocks. A no-op with caching off.
        """
        if not self.enable_caching:
            return
        for g in self.groups:
            table = g.tables.get(request_id)
            if not table:
                continue
            start = g.num_registered.get(request_id, 0)
            end = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
            for i in range(start, end):
                if table[i] != g.null_block:
                    g.pool.cache_block(table[i], block_hashes[i])
            if end > start:
                g.num_registered[request_id] = end

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block (e.g. between benchmark runs); returns how many."""
        return sum(g.pool.reset_prefix_cache() for g in self.groups)

    # ---------------------------------------------------------------- tables, free, fork

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's group-0 block table (empty for an unknown request)."""
        return list(self.groups[0].tables.get(request_id, ()))

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Copies of the request's block table in every group, in group order."""
        return [list(g.tables.get(request_id, ())) for g in self.groups]

    def free(self, request_id: str) -> None:
        """Drop the request's reference on every one of its blocks at once; unknown id: no-op."""
        self._used_slots.pop(request_id, None)
        for g in self.groups:
            table = g.tables.pop(request_id, None)
            g.num_registered.pop(request_id, None)
            if table:
                # NOTE: tail first, so the blocks holding the latest tokens are evicted first and
                # the prefix cache keeps the shared heads (prompt prefixes) longest; a tail block
                # is useless without the blocks before it anyway.
                g.pool.decref(reversed(g.live(table)))

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (incref); whichever of them writes a
        shared block first gets a private copy (:meth:`allocate_slots`)."""
        if parent_id not in self._used_slots:
            raise KeyError(f"fork from unknown request {parent_id!r}")
        if child_id in self._used_slots:
            raise ValueError(f"fork into existing request {child_id!r}")
        for g in self.groups:
            table = list(g.tables[parent_id])
            g.pool.incref(g.live(table))
            g.tables[child_id] = table
            if parent_id in g.num_registered:
                g.num_registered[child_id] = g.num_registered[parent_id]
        self._used_slots[child_id] = self._used_slots[parent_id]

    def block_owners(self) -> dict[int, list[str]]:
        """Group 0's physical block id -> ids of the requests holding it, in insertion order."""
        owners: dict[int, list[str]] = {}
        g = self.groups[0]
        for rid, table in g.tables.items():
            for b in g.live(table):
                owners.setdefault(b, []).append(rid)
        return owners

    def stats(self) -> KVStats:
        """Used/free blocks and slots of every group; shared blocks counted once (see
        :class:`KVStats`); a windowed group's null block is neither used nor free."""
        bs = self.block_size
        used_slots = shared = 0
        for g in self.groups:
            used_in_block: dict[int, int] = {}
            for rid, table in g.tables.items():
                used = self._used_slots[rid]
                for i, b in enumerate(table):
                    if b == g.null_block:
                        continue
                    # slots of block i that hold positions < used: clamp(used - i*bs, 0, bs)
                    n = min(bs, max(0, used - i * bs))
                    used_in_block[b] = max(used_in_block.get(b, 0), n)
            shared += sum(1 for b in used_in_block if g.pool.ref_count(b) > 1)
            used_slots += sum(used_in_block.values())
        used_blocks = sum(g.num_used_blocks for g in self.groups)
        allocated = used_blocks * bs
        frag = (allocated - used_slots) / allocated if allocated else 0.0
        return KVStats(
            num_blocks=sum(g.num_usable_blocks for g in self.groups),
            used_blocks=used_blocks,
            free_blocks=sum(g.pool.num_free_blocks for g in self.groups),
            allocated_slots=allocated,
            used_slots=used_slots,
            fragmentation=frag,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            shared_blocks=shared,
            cached_blocks=sum(g.pool.num_cached_blocks for g in self.groups),
            evictable_cached_blocks=sum(g.pool.num_evictable_cached_blocks for g in self.groups),
            touched_blocks=sum(g.pool.num_touched_blocks for g in self.groups),
            group_used_blocks=tuple(g.num_used_blocks for g in self.groups) if len(self.groups) > 1 else (),
            groups=tuple(g.stats() for g in self.groups),
        )
