"""A pool of fixed-size KV blocks with reference counts and a prefix cache. Torch-free.

The pool only hands out block *ids*; the tensors that hold the keys and values live in the
runner. A block is free when its reference count is 0. Sharing (prefix caching, copy-on-write
forks) is an ``incref`` on blocks someone already holds, or a ``touch`` that revives a free
block still holding a cached prefix.

Free list: one queue in least-recently-freed order, holding both empty blocks and *evictable*
cached ones (ref count 0, K/V still valid, hash kept). Allocation takes from the front; taking a
cached block evicts it (its hash is forgotten). A prefix hit takes a block out of the middle::

    start           free = [0, 1, 2, 3, 4, 5]
    allocate(2)     -> [0, 1]        free = [2, 3, 4, 5]
    cache_block(0, h0)               cached = {h0: 0}
    decref([1, 0])  both 1 -> 0      free = [2, 3, 4, 5, 1, 0*]    (* evictable, still cached)
    touch([0])      a hit on h0      free = [2, 3, 4, 5, 1]        ref(0) = 1
    decref([0]); allocate(6)         -> [2, 3, 4, 5, 1, 0]         0 evicted: cached = {}

NOTE: the free list is an OrderedDict (block id -> None), a hash map over a doubly linked list:
O(1) pop from the front, append at the back and removal from the middle, the three moves of an
LRU list (vLLM links its block objects by hand for the same three moves). A plain dict would
not do: popping its front leaves holes that ``next(iter(d))`` has to skip.
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
        # NOTE: FIFO reuse (freed blocks queue at the back) keeps recently freed blocks intact
        # the longest: the least recently freed cached block is the one evicted.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> the one block registered under it
        self._num_free_cached = 0  # blocks with ref count 0 that still hold a hash
        self.num_evictions: int = 0  # cached blocks reclaimed for new use, since start

    # ---------------------------------------------------------------- counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count 0 (empty or evictable cached): what allocate can take."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with reference count >= 1 (a shared block counts once)."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a prefix hash, held or evictable."""
        return len(self._cached)

    @property
    def num_evictable_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reclaimed only when the pool needs them)."""
        return self._num_free_cached

    # ---------------------------------------------------------------- allocation and refs

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1, least recently freed first.

        A cached block taken this way is evicted (its hash is dropped). Raises
        NoFreeBlocksError (pool unchanged) if fewer than ``n`` blocks are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {len(self._free)} of {self.num_blocks} are free"
            )
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            if self._hash[b] is not None:
                self._evict(b)
            self._ref_counts[b] = 1
            out.append(b)
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
                del self._free[b]
                self._num_free_cached -= 1
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
                self._free[b] = None
                if self._hash[b] is not None:
                    self._num_free_cached += 1

    def ref_count(self, block_id: int) -> int:
        """The number of holders of ``block_id`` (0 = free)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def evictable_block_ids(self) -> list[int]:
        """Free blocks still holding a cached prefix, next to be evicted first."""
        return [b for b in self._free if self._hash[b] is not None]

    def free_block_ids(self) -> list[int]:
        """The free list, front (next to be allocated) first."""
        return list(self._free)

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
        """Forget every evictable cached block (held ones stay cached); returns how many."""
        dropped = [b for b in self._free if self._hash[b] is not None]
        for b in dropped:
            self._evict(b, count=False)
        return len(dropped)

    def _evict(self, block_id: int, count: bool = True) -> None:
        h = self._hash[block_id]
        assert h is not None and self._ref_counts[block_id] == 0
        del self._cached[h]
        self._hash[block_id] = None
        self._num_free_cached -= 1
        if count:
            self.num_evictions += 1

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
