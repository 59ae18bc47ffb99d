"""Scheduler side of speculative decoding: drafts in the chunk and the budget, KV slots for all
of them reserved before the step, rollback by length (blocks holding only rejected drafts freed
at once, nothing copied), and no prefix-cache hash over an unverified token.

The property test drives random requests with random drafts and random accept counts against a
model of the K/V memory (as the runner writes it: every chunk token, drafts included, into the
slots its table names) and checks after every step: each request reads back exactly its
verified tokens, its table holds just the blocks its computed tokens need, ref counts equal
holders, every block registered in the prefix cache holds verified tokens only, and at the end
every block is free.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fitserve.kv.prefix_hash import extend_block_hashes
from fitserve.sched.request import SchedRequest

from .test_scheduler import make, req

BS = 4


def test_drafts_ride_in_the_chunk_and_count_in_the_budget() -> None:
    s = make(block_size=4, budget=8)
    a, b = req("A", 5, max_tokens=20), req("B", 3, max_tokens=20, base=50)
    s.add_request(a)
    s.add_request(b)
    s.update(s.schedule(), {"A": 100, "B": 200})  # both prompts (8 tokens): both decode next
    s.config = type(s.config)(max_num_batched_tokens=6, max_num_seqs=8, max_model_len=128)
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3, 4], [5, 6, 7, 8]
    out = s.schedule()
    # A: its last token + 4 drafts = 5 tokens; B gets the 1 left: its last token, no drafts
    assert [(c.request_id, len(c.token_ids), c.num_draft) for c in out.chunks] == [("A", 5, 4), ("B", 1, 0)]
    assert out.chunks[0].token_ids[1:] == [1, 2, 3, 4] and out.num_batched_tokens == 6
    assert a.spec_token_ids == [] and b.spec_token_ids == []  # consumed (or dropped) by the step
    start = out.chunks[0].start_pos
    assert len(out.chunks[0].block_table) * 4 >= start + 5  # slots for all five reserved


def test_rollback_moves_the_length_back_and_frees_draft_only_blocks() -> None:
    s = make(num_blocks=8, block_size=4, budget=16)
    a = req("A", 6, max_tokens=20)
    s.add_request(a)
    s.update(s.schedule(), {"A": 9})  # 6 computed, 7 tokens; blocks [0, 1]
    a.spec_token_ids = [1, 2, 3, 4, 5]
    out = s.schedule()
    assert out.chunks[0].block_table == [0, 1, 2]  # positions 6 .. 11
    s.update(out, {}, {"A": [1, 42]})  # draft 1 accepted, then 42 instead of draft 2
    assert a.num_computed_tokens == 8 and a.output_token_ids == [9, 1, 42]
    assert s.kv.block_table("A") == [0, 1] and s.kv.pool.num_free_blocks == 6  # block 2 freed
    assert s.kv.stats().used_slots == 8


def test_drafts_never_pass_max_tokens_or_max_model_len() -> None:
    s = make(block_size=4, budget=32, max_model_len=12)
    a = req("A", 6, max_tokens=3)
    s.add_request(a)
    s.update(s.schedule(), {"A": 9})
    a.spec_token_ids = [1, 2, 3, 4]
    out = s.schedule()
    assert out.chunks[0].num_draft == 1  # 3 outputs at most: 1 so far, so 1 draft + 1 more


class SpecDecodeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = make(num_blocks=20, block_size=BS, budget=12, max_num_seqs=4, max_model_len=40)
        self.mem: dict[int, list[int | None]] = {b: [None] * BS for b in range(20)}
        self.n = 0

    @precondition(lambda self: len(self.s._requests) < 4)
    @rule(shared=st.integers(0, 9), own=st.integers(1, 6))
    def add(self, shared: int, own: int) -> None:
        prompt = [3] * shared + [10 + self.n * 7 + j for j in range(own)]
        self.s.add_request(SchedRequest(f"r{self.n}", prompt, 12))
        self.n += 1

    @precondition(lambda self: self.s.has_unfinished())
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        for r in self.s.running:  # drafts for the decoding requests
            if r.num_tokens - r.num_computed_tokens == 1:
                r.spec_token_ids = data.draw(st.lists(st.integers(0, 5), max_size=4))
        out = self.s.schedule()
        for src, dst in out.block_copies:
            self.mem[dst] = list(self.mem[src])
        emitted: dict[str, list[int]] = {}
        sampled: dict[str, int] = {}
        for c in out.chunks:
            for p, tok in enumerate(c.token_ids, c.start_pos):  # every token, drafts included
                self.mem[c.block_table[p // BS]][p % BS] = tok
            if c.num_draft:
                n = data.draw(st.integers(0, c.num_draft))
                event(f"accepted {n} of {c.num_draft}")
                emitted[c.request_id] = c.token_ids[1:1 + n] + [data.draw(st.integers(0, 5))]
            elif c.sample:
                sampled[c.request_id] = data.draw(st.integers(0, 5))
        self.s.update(out, sampled, emitted)
        for r in list(self.s.running):
            if len(r.output_token_ids) >= r.max_tokens:
                self.s.finish(r.request_id)

    @precondition(lambda self: self.s._requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.s.finish(data.draw(st.sampled_from(sorted(self.s._requests))))

    @invariant()
    def verified_tokens_tables_refs_and_hashes(self) -> None:
        kv = self.s.kv
        holders: Counter[int] = Counter()
        for r in self.s.running:
            table = kv.block_table(r.request_id)
            holders.update(table)
            toks = r.all_token_ids
            got = [self.mem[table[p // BS]][p % BS] for p in range(r.num_computed_tokens)]
            assert got == toks[: r.num_computed_tokens], r.request_id
            assert len(table) == -(-r.num_computed_tokens // BS)  # nothing past the length
            hashes: list[bytes] = []
            extend_block_hashes(hashes, toks, BS, r.num_computed_tokens // BS)
            for i, b in enumerate(table):
                h = kv.pool.block_hash(b)
                if h is not None:  # a registered block: a full block of verified tokens
                    assert i < r.num_computed_tokens // BS and h == hashes[i]
        for b in range(20):
            assert kv.pool.ref_count(b) == holders.get(b, 0)

    def teardown(self) -> None:
        for rid in list(self.s._requests):
            self.s.finish(rid)
        assert self.s.kv.pool.num_free_blocks == 20


SpecDecodeMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
TestSpecDecodeAccounting = SpecDecodeMachine.TestCase
