"""Property test (hypothesis, stateful): random new-with-lookup / compute / append / fork /
finish / evict / reset on a manager with prefix caching never leaks or double-frees, a block's
ref count is the number of tables holding it, and a hit only ever returns a block whose
registered tokens are the requested prefix's."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fitserve.kv.manager import KVCacheManager
from fitserve.kv.prefix_hash import extend_block_hashes

BS = 4
NUM_BLOCKS = 14
# a few token streams to take prompt heads from, so requests share prefixes often
STEMS = [[(s * 37 + 11 * j) % 50 for j in range(40)] for s in range(3)]


@dataclass
class Seq:
    tokens: list[int]
    computed: int = 0  # tokens whose K/V is "written"
    hashes: list[bytes] = field(default_factory=list)

    def rehash(self) -> None:
        extend_block_hashes(self.hashes, self.tokens, BS, len(self.tokens) // BS)


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BS)
        self.seqs: dict[str, Seq] = {}
        self.content: dict[int, tuple[int, ...]] = {}  # tokens a block was registered with
        self.counter = 0
        self.hits_seen = 0

    def _snapshot(self) -> tuple[list[int], list[int], int]:
        pool = self.kv.pool
        refs = [pool.ref_count(b) for b in range(NUM_BLOCKS)]
        return refs, pool.free_block_ids(), pool.num_cached_blocks

    @initialize(stem=st.integers(0, 2), n=st.integers(5, 24))
    def a_computed_prompt(self, stem: int, n: int) -> None:
        """Start with one request whose prompt is computed, so there is something to hit."""
        self.new_request(stem, n, [], prefill=True)

    @rule(stem=st.integers(0, 2), shared=st.sampled_from([5, 9, 13, 24]) | st.integers(0, 24),
          tail=st.lists(st.integers(50, 60), max_size=10), prefill=st.booleans())
    def new_request(self, stem: int, shared: int, tail: list[int], prefill: bool) -> None:
        seq = Seq(STEMS[stem][:shared] + tail)
        if not seq.tokens:
            return
        seq.rehash()
        n = len(seq.tokens)
        hits = self.kv.get_computed_blocks(seq.hashes, n)
        assert len(hits) <= (n - 1) // BS
        for i, b in enumerate(hits):  # a hit holds exactly the prefix asked for
            assert self.content[b] == tuple(seq.tokens[i * BS : (i + 1) * BS])
            assert self.kv.pool.block_hash(b) == seq.hashes[i]
        rid = f"q{self.counter}"
        self.counter += 1
        before = self._snapshot()
        revived = sum(1 for b in hits if self.kv.pool.ref_count(b) == 0)
        need = -(-n // BS) - len(hits)
        ok = self.kv.allocate(rid, n, hits)
        assert ok == (need + revived <= len(before[1]))
        if not ok:
            assert self._snapshot() == before and not self.kv.has_request(rid)
            return
        self.hits_seen += len(hits)
        seq.computed = len(hits) * BS
        self.seqs[rid] = seq
        assert self.kv.block_table(rid)[: len(hits)] == hits
        if prefill:  # the whole prompt in its first step
            self._compute(rid, n)

    def _compute(self, rid: str, k: int) -> None:
        seq = self.seqs[rid]
        seq.computed = min(seq.computed + k, len(seq.tokens))
        self.kv.cache_blocks(rid, seq.hashes, seq.computed)
        table = self.kv.block_table(rid)
        for i in range(seq.computed // BS):
            b = table[i]
            if self.kv.pool.block_hash(b) == seq.hashes[i]:
                self.content[b] = tuple(seq.tokens[i * BS : (i + 1) * BS])

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), k=st.integers(1, 12))
    def compute(self, data: st.DataObject, k: int) -> None:
        """The forward pass wrote ``k`` more tokens; register the blocks that filled."""
        self._compute(data.draw(st.sampled_from(sorted(self.seqs))), k)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), new=st.lists(st.integers(0, 60), min_size=1, max_size=9))
    def append(self, data: st.DataObject, new: list[int]) -> None:
        """Tokens sampled / a longer target: the table grows (all or nothing)."""
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[rid]
        old = self.kv.block_table(rid)
        before = self._snapshot()
        ok = self.kv.allocate(rid, len(seq.tokens) + len(new))
        if ok:
            seq.tokens.extend(new)
            seq.rehash()
            assert self.kv.block_table(rid)[: len(old)] == old
        else:
            assert self._snapshot() == before

    @precondition(lambda self: any(
        len(s.tokens) % BS == 0 and s.computed == len(s.tokens) for s in self.seqs.values()))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        # NOTE: only block-aligned, fully computed parents: a shared partial block would be
        # written by both sides, which is copy-on-write's job (not built yet)
        ids = sorted(r for r, s in self.seqs.items() if len(s.tokens) % BS == 0 and s.computed == len(s.tokens))
        parent = data.draw(st.sampled_from(ids))
        child = f"q{self.counter}"
        self.counter += 1
        self.kv.fork(parent, child)
        p = self.seqs[parent]
        self.seqs[child] = Seq(list(p.tokens), p.computed, list(p.hashes))

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Finish, abort or preempt: the same for the manager (all blocks dropped at once)."""
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        del self.seqs[rid]
        self.kv.free(rid)
        self.kv.free(rid)  # freeing again is a no-op, never a double free

    @rule(n=st.integers(1, NUM_BLOCKS))
    def hog(self, n: int) -> None:
        """A request of fresh tokens takes ``n`` blocks and ends: pressure that evicts."""
        if self.kv.allocate("hog", n * BS):
            assert all(self.kv.pool.block_hash(b) is None for b in self.kv.block_table("hog"))
            self.kv.free("hog")

    @rule()
    def reset(self) -> None:
        self.kv.reset_prefix_cache()

    @invariant()
    def accounting_is_exact(self) -> None:
        pool = self.kv.pool
        holders = [0] * NUM_BLOCKS
        for rid in self.seqs:
            for b in self.kv.block_table(rid):
                holders[b] += 1
        assert [pool.ref_count(b) for b in range(NUM_BLOCKS)] == holders
        free = pool.free_block_ids()
        assert sorted(free) == [b for b in range(NUM_BLOCKS) if holders[b] == 0]
        assert pool.num_free_blocks + pool.num_used_blocks == NUM_BLOCKS
        hashed = [b for b in range(NUM_BLOCKS) if pool.block_hash(b) is not None]
        assert pool.num_cached_blocks == len(hashed)
        for b in hashed:
            h = pool.block_hash(b)
            assert h is not None and pool.lookup(h) == b
        assert pool.num_evictable_cached_blocks == sum(1 for b in hashed if holders[b] == 0)

    @invariant()
    def a_held_cached_block_is_its_holders_prefix(self) -> None:
        for rid, seq in self.seqs.items():
            table = self.kv.block_table(rid)
            assert len(table) == -(-len(seq.tokens) // BS)
            for i, b in enumerate(table):
                h = self.kv.pool.block_hash(b)
                if h is not None:
                    assert i < seq.computed // BS and h == seq.hashes[i]

    def teardown(self) -> None:
        # visible with --hypothesis-show-statistics: the cases the runs actually covered
        event(f"hits > 0: {self.hits_seen > 0}")
        event(f"evictions > 0: {self.kv.pool.num_evictions > 0}")
        for rid in list(self.seqs):
            self.kv.free(rid)
        assert self.kv.pool.num_free_blocks == NUM_BLOCKS and self.kv.block_owners() == {}


PrefixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
