"""Property test (hypothesis, stateful) for copy-on-write sharing: random new / fork / append
(through copy-on-write) / prune / finish / abort / evict over a manager with prefix caching on,
against a model of the physical K/V memory that applies the manager's block copies and then
writes each request's tokens into the slots its table names.

Invariants: every request reads back exactly its own tokens through its table (so a
copy-on-write never changed a block another table still reads, and a copy carried everything
the writer needed), a block's ref count equals the number of tables holding it, free and used
blocks partition the pool, and dropping everything frees every block.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fitserve.kv.manager import KVCacheManager
from fitserve.kv.prefix_hash import extend_block_hashes

BS = 4
NUM_BLOCKS = 16
STEM = [(7 * j + 3) % 40 for j in range(40)]


@dataclass
class Seq:
    tokens: list[int]  # every token written so far (all computed)
    hashes: list[bytes] = field(default_factory=list)


class CopyOnWriteMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BS)
        self.mem: dict[int, list[int | None]] = {b: [None] * BS for b in range(NUM_BLOCKS)}
        self.seqs: dict[str, Seq] = {}
        self.counter = 0

    # -- the model of the runner: copies first, then writes ------------------------------------
    def _write(self, rid: str, start: int, new: list[int]) -> bool:
        seq = self.seqs[rid]
        copies = self.kv.allocate_for_write(rid, start, start + len(new))
        if copies is None:
            return False
        if copies:
            event("copy-on-write copied a block")
        for src, dst in copies:
            self.mem[dst] = list(self.mem[src])
        table = self.kv.block_table(rid)
        for p, tok in enumerate(new, start):
            self.mem[table[p // BS]][p % BS] = tok
        seq.tokens = seq.tokens[:start] + new
        extend_block_hashes(seq.hashes, seq.tokens, BS, len(seq.tokens) // BS)
        self.kv.cache_blocks(rid, seq.hashes, len(seq.tokens))
        return True

    @rule(shared=st.integers(0, 30), tail=st.lists(st.integers(40, 50), min_size=1, max_size=9))
    def new_request(self, shared: int, tail: list[int]) -> None:
        tokens = STEM[:shared] + tail
        rid = f"r{self.counter}"
        self.counter += 1
        hashes: list[bytes] = []
        extend_block_hashes(hashes, tokens, BS, len(tokens) // BS)
        hits = self.kv.get_computed_blocks(hashes, len(tokens))
        cached = len(hits) * BS
        if not self.kv.allocate(rid, cached, hits):
            return
        if hits:
            event("prefix hit")
        self.seqs[rid] = Seq(tokens[:cached], hashes[: len(hits)])
        if not self._write(rid, cached, tokens[cached:]):
            self.drop(rid)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        rid = f"r{self.counter}"
        self.counter += 1
        self.kv.fork(parent, rid)
        p = self.seqs[parent]
        self.seqs[rid] = Seq(list(p.tokens), list(p.hashes))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(40, 50), min_size=1, max_size=6))
    def append(self, data: st.DataObject, new: list[int]) -> None:
        """Decode / chunk tokens at the end; sharers diverge here (copy-on-write)."""
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        self._write(rid, len(self.seqs[rid].tokens), new)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def prune_finish_or_abort(self, data: st.DataObject) -> None:
        self.drop(data.draw(st.sampled_from(sorted(self.seqs))))

    def drop(self, rid: str) -> None:
        self.kv.free(rid)
        self.seqs.pop(rid, None)

    @rule()
    def evict_everything_evictable(self) -> None:
        self.kv.reset_prefix_cache()

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for rid, seq in self.seqs.items():
            table = self.kv.block_table(rid)
            got = [self.mem[table[p // BS]][p % BS] for p in range(len(seq.tokens))]
            assert got == seq.tokens, rid

    @invariant()
    def ref_counts_equal_holders_and_pool_partitions(self) -> None:
        pool = self.kv.pool
        holders = Counter(b for rid in self.seqs for b in self.kv.block_table(rid))
        free = pool.free_block_ids()
        assert len(free) == len(set(free))
        for b in range(NUM_BLOCKS):
            assert pool.ref_count(b) == holders.get(b, 0), b
            assert (b in free) == (holders.get(b, 0) == 0)
        shared = sum(1 for c in holders.values() if c > 1)
        assert self.kv.stats().shared_blocks == shared

    def teardown(self) -> None:
        for rid in list(self.seqs):
            self.drop(rid)
        assert self.kv.pool.num_free_blocks == NUM_BLOCKS
        assert all(self.kv.pool.ref_count(b) == 0 for b in range(NUM_BLOCKS))


CopyOnWriteMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCopyOnWrite = CopyOnWriteMachine.TestCase


def test_last_sharer_writes_in_place() -> None:
    """n sharers of a partial block: n - 1 copies, the last holder writes in place."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_for_write("p", 0, 6) == []  # [0, 1], block 1 half full
    kv.fork("p", "a")
    kv.fork("p", "b")
    assert kv.pool.ref_count(1) == 3
    assert kv.allocate_for_write("p", 6, 7) == [(1, 2)]
    assert kv.allocate_for_write("a", 6, 7) == [(1, 3)]
    assert kv.allocate_for_write("b", 6, 7) == []  # the last holder: in place
    assert [kv.block_table(r) for r in "pab"] == [[0, 2], [0, 3], [0, 1]]
    assert kv.pool.ref_count(0) == 3 and kv.stats().shared_blocks == 1
    # prune first: once the other sharer is gone, the survivor writes the block in place
    kv.fork("b", "c")
    kv.free("b")
    assert kv.allocate_for_write("c", 7, 9) == []
    assert kv.block_table("c") == [0, 1, 4] and kv.pool.ref_count(0) == 3
    # a write that starts at a shared block's first slot needs a fresh block, not a copy
    kv.fork("c", "d")
    assert kv.allocate_for_write("d", 8, 9) == [] and kv.block_table("d") == [0, 1, 5]


def test_copy_on_write_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_for_write("p", 0, 6) == []
    kv.fork("p", "c")
    kv.allocate_for_write("x", 0, 1)  # the last free block
    before = (kv.block_table("c"), kv.pool.free_block_ids(), [kv.pool.ref_count(b) for b in range(3)])
    assert kv.allocate_for_write("c", 6, 7) is None  # needs a copy of block 1: no block free
    assert (kv.block_table("c"), kv.pool.free_block_ids(), [kv.pool.ref_count(b) for b in range(3)]) == before
