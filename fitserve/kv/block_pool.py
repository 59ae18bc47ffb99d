"""A pool of fixed-size KV blocks with reference counts and a prefix cache. Torch-free.

The pool only hands out block *ids*; the tensors that hold the keys and values live in the
runner. A block is free when its reference count is 0. Sharing (prefix caching, copy-on-write
forks) is an ``incref`` on blocks someone already holds, or a ``touch`` that revives a free
block still holding a cached prefix.

Free blocks come in three kinds, taken in this order by ``allocate``:

1. *empty*: used before, no cached prefix (FIFO: least recently freed first);
2. *fresh*: never handed out, ids ``num_touched_blocks ..`` in order;
3. *evictable*: ref count 0 but K/V still valid and hash kept (LRU: least recently freed is
   evicted first; taking one forgets its hash).

Why this order: the runner's cache tensors are lazily backed on CPU (a page becomes resident
when a block in it is first written), so a fresh block costs memory an empty one does not, and
an evictable one is a prefix hit not yet made. Hence ``num_touched_blocks`` -- the blocks whose
memory is resident -- is exactly the most blocks ever held or cached at once, and the cache
never gives up a prefix while the pool has room it has not touched::

    start           empty = [], fresh = 0.., evictable = []          (6 blocks)
    allocate(2)     -> [0, 1]        touched = 2
    cache_block(0, h0)               cached = {h0: 0}
    decref([1, 0])  both 1 -> 0      empty = [1], evictable = [0]
    touch([0])      a hit on h0      evictable = []                 ref(0) = 1
    decref([0]); allocate(6)         -> [1, 2, 3, 4, 5, 0]          0 evicted: cached = {}

NOTE: the empty and evictable lists are OrderedDicts (block id -> None), a hash map over a
doubly linked list: O(1) pop from the front, append at the back and removal from the middle,
the three moves of an LRU list (vLLM links its block objects by hand for the same three moves).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from fitserve.kv.prefix_hash import BlockHash


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """``num_blocks`` block ids, each with a reference count and, if cached, a prefix hash.

    Every operation is all-or-nothing: on an error the pool is left exactly as it was.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least 1 block, got num_blocks={num_blocks}")
        self.num_blocks: int = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        self._empty: OrderedDict[int, None] = OrderedDict()  # freed, no hash; FIFO
        self._evictable: OrderedDict[int, None] = OrderedDict()  # freed, hash kept; LRU
        self._next_fresh = 0  # ids >= this were never handed out
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> the one block registered under it
        self.num_evictions: int = 0  # cached blocks reclaimed for new use, since start

    # ---------------------------------------------------------------- counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count 0 (empty, fresh or evictable): what allocate can take."""
        return len(self._empty) + (self.num_blocks - self._next_fresh) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with reference count >= 1 (a shared block counts once)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a prefix hash, held or evictable."""
        return len(self._cached)

    @property
    def num_evictable_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reclaimed only when the pool needs them)."""
        return len(self._evictable)

    @property
    def num_touched_blocks(self) -> int:
        """Blocks ever handed out (ids 0 .. this - 1): the part of a lazily backed cache that is
        resident. Equals the most blocks held or evictable at any one time since start."""
        return self._next_fresh

    # ---------------------------------------------------------------- allocation and refs

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1: empty ones first, then fresh,
        then evictable (least recently freed first; its hash is dropped).

        Raises NoFreeBlocksError (pool unchanged) if fewer than ``n`` blocks are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        free = self.num_free_blocks
        if n > free:
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {free} of {self.num_blocks} are free"
            )
        out: list[int] = []
        for _ in range(n):
            if self._empty:
                blk, _ = self._empty.popitem(last=False)
            elif self._next_fresh < self.num_blocks:
                blk = self._next_fresh
                self._next_fresh += 1
            else:
                blk, _ = self._evictable.popitem(last=False)
                self._forget(blk)
                self.num_evictions += 1
            self._ref_counts[blk] = 1
            out.append(blk)
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference per occurrence of each id; every block must be in use."""
        counts = Counter(block_ids)
        for b in counts:
            self._check_id(b)
            if self._ref_counts[b] == 0:
                raise ValueError(f"incref on free block {b}: only held blocks can be shared")
        for b, c in counts.items():
            self._ref_counts[b] += c

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one reference per occurrence on cached blocks (prefix hits), held or free.

        A free (evictable) block leaves the free list. Every block must hold a hash: a block
        without one has no K/V anyone may rely on.
        """
        counts = Counter(block_ids)
        for b in counts:
            self._check_id(b)
            if self._hash[b] is None:
                raise ValueError(f"touch on block {b}, which holds no cached prefix")
        for b, c in counts.items():
            if self._ref_counts[b] == 0:
                del self._evictable[b]
            self._ref_counts[b] += c

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per occurrence; a block reaching 0 goes to the back of the free
        list, keeping its hash (if any) until it is evicted.

        Raises ValueError (pool unchanged) if any block would drop below 0 (a double free).
        """
        ids = list(block_ids)
        counts = Counter(ids)
        for b, c in counts.items():
            self._check_id(b)
            if self._ref_counts[b] < c:
                raise ValueError(
                    f"double free of block {b}: ref count {self._ref_counts[b]}, asked to drop {c}"
                )
        for b in ids:  # in the caller's order, so the free list order is deterministic
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                if self._hash[b] is None:
                    self._empty[b] = None
                else:
                    self._evictable[b] = None

    def ref_count(self, block_id: int) -> int:
        """The number of holders of ``block_id`` (0 = free)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def evictable_block_ids(self) -> list[int]:
        """Free blocks still holding a cached prefix, next to be evicted first."""
        return list(self._evictable)

    def free_block_ids(self) -> list[int]:
        """Every free block in the order ``allocate`` takes them: empty, fresh, evictable."""
        return [*self._empty, *range(self._next_fresh, self.num_blocks), *self._evictable]

    # ---------------------------------------------------------------- the prefix cache

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a held, fully written block under ``block_hash``, so later lookups hit it.

        Returns False, changing nothing, if another block already holds that hash (two requests
        computed the same prefix at once: the first registered stays the cached one, the other
        stays a plain block). Registering a block again under its own hash is a no-op (True).
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cache_block on free block {block_id}: only held blocks are written")
        old = self._hash[block_id]
        if old is not None:
            if old != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return True
        if block_hash in self._cached:
            return False
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block cached under ``block_hash`` (held or evictable), or None."""
        return self._cached.get(block_hash)

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash ``block_id`` is cached under, or None."""
        self._check_id(block_id)
        return self._hash[block_id]

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block (held ones stay cached); returns how many.
        They become empty blocks, in their eviction order."""
        dropped = list(self._evictable)
        self._evictable.clear()
        for blk in dropped:
            self._forget(blk)
            self._empty[blk] = None
        return len(dropped)

    def _forget(self, block_id: int) -> None:
        h = self._hash[block_id]
        assert h is not None and self._ref_counts[block_id] == 0
        del self._cached[h]
        self._hash[block_id] = None

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
