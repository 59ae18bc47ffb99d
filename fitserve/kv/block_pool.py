"""A pool of fixed-size KV blocks with reference counts. Torch-free.

The pool only hands out block *ids*; the tensors that hold the keys and values live in the
runner. A block is free when its reference count is 0. Sharing (prefix caching, copy-on-write
forks) is an ``incref`` on blocks someone already holds, so the pool needs no redesign for it.

Free list (a FIFO queue, so allocation is deterministic)::

    start         free = [0, 1, 2, 3, 4, 5]
    allocate(2)   -> [0, 1]          free = [2, 3, 4, 5]
    decref([1])   ref(1) 1 -> 0      free = [2, 3, 4, 5, 1]   (freed blocks go to the back)
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """``num_blocks`` block ids, each with a reference count.

    Every operation is all-or-nothing: on an error the pool is left exactly as it was.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least 1 block, got num_blocks={num_blocks}")
        self.num_blocks: int = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        # NOTE: FIFO reuse (freed blocks queue at the back) keeps recently freed blocks intact
        # the longest, which is what a prefix cache that revives freed blocks will want.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count 0."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with reference count >= 1 (a shared block counts once)."""
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1, in free-list order.

        Raises NoFreeBlocksError (pool unchanged) if fewer than ``n`` blocks are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {len(self._free)} of {self.num_blocks} are free"
            )
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref_counts[b] = 1
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

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per occurrence; a block reaching 0 goes back to the free list.

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
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        """The number of holders of ``block_id`` (0 = free)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
