"""Per-request block tables over a :class:`BlockPool`, with exact accounting. Torch-free.

A request's block table maps its token positions to physical slots::

    block_size = 4, request of 10 tokens (positions 0..9)

    positions   0 1 2 3 | 4 5 6 7 | 8 9 . .
    table       [   7   ,    2    ,   5   ]     slot(p) = table[p // 4] * 4 + p % 4
    used slots  10, allocated slots 3 * 4 = 12, unused (internal fragmentation) 2

Only the last block of a table can be partly filled, so a request wastes < block_size slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.kv.block_pool import BlockPool


@dataclass(slots=True)
class KVStats:
    """A snapshot of the pool, counting each physical block once even when shared.

    For a block shared by several requests (fork / prefix cache), its used slots are the most
    any holder uses in it: holders of one block see the same tokens, so the slots are counted
    once and never more than ``block_size``.
    """

    num_blocks: int
    used_blocks: int
    free_blocks: int
    allocated_slots: int  # used_blocks * block_size
    used_slots: int  # slots holding (or reserved for) a token
    fragmentation: float  # (allocated_slots - used_slots) / allocated_slots; 0.0 when empty


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the pool and every request's block table."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size: int = block_size
        self.pool: BlockPool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._used_slots: dict[str, int] = {}  # tokens the request's table is sized for

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` holds a block table (possibly empty)."""
        return request_id in self._tables

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs for its table to cover ``num_tokens`` slots."""
        have = len(self._tables.get(request_id, ()))
        return max(0, _cdiv(num_tokens, self.block_size) - have)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to cover ``num_tokens`` slots; all-or-nothing.

        Returns False, with nothing changed, if the pool lacks the blocks. On success records
        ``num_tokens`` as the request's used slots (the table never shrinks).
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.pool.num_free_blocks:
            return False
        new = self.pool.allocate(need)
        self._tables.setdefault(request_id, []).extend(new)
        self._used_slots[request_id] = num_tokens
        return True

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty for an unknown request)."""
        return list(self._tables.get(request_id, ()))

    def free(self, request_id: str) -> None:
        """Drop the request's reference on every one of its blocks at once; unknown id: no-op."""
        table = self._tables.pop(request_id, None)
        self._used_slots.pop(request_id, None)
        if table:
            # NOTE: tail first, so the blocks holding the latest tokens are reused first and a
            # future prefix cache keeps the shared heads (prompt prefixes) longest.
            self.pool.decref(reversed(table))

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (incref), for later copy-on-write."""
        if parent_id not in self._tables:
            raise KeyError(f"fork from unknown request {parent_id!r}")
        if child_id in self._tables:
            raise ValueError(f"fork into existing request {child_id!r}")
        table = list(self._tables[parent_id])
        self.pool.incref(table)
        self._tables[child_id] = table
        self._used_slots[child_id] = self._used_slots[parent_id]

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
        )
