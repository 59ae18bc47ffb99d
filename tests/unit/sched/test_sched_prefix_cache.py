"""The scheduler with prefix caching: exact chunks and block ids of hits, the recompute of the
last token, hits on generated tokens, on blocks of running and preempted requests, counters."""

from __future__ import annotations

from fitserve.sched.request import SchedRequest
from fitserve.types import RequestStatus, SchedulerOutput
from tests.unit.sched.test_scheduler import alone, drain, make, req, step, summary


def prefill_tokens(outs: list[SchedulerOutput], rid: str) -> int:
    return sum(len(c.token_ids) for o in outs for c in o.chunks if c.request_id == rid)


def run(s, max_steps: int = 1000) -> list[SchedulerOutput]:  # type: ignore[no-untyped-def]
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return outs
        outs.append(step(s))
    raise AssertionError("no progress")


def test_second_request_with_a_long_shared_prefix_computes_only_its_suffix() -> None:
    s = make(num_blocks=32, block_size=4, budget=64)
    shared = list(range(100, 120))  # 20 tokens: 5 full blocks
    a = SchedRequest("A", shared + [1, 2, 3], 4)
    s.add_request(a)
    outs = run(s)
    assert prefill_tokens(outs, "A") == 23 + 3  # prompt, then 3 decodes
    b = SchedRequest("B", shared + [7, 8], 4)
    s.add_request(b)
    out = step(s)
    # A's blocks for positions 0..19 are cached (A freed them: evictable); B starts at 20, its
    # new block is A's partial last one (6: empty, reused before the never touched 7)
    assert summary(out) == [("B", 20, 2, [0, 1, 2, 3, 4, 6], True)]
    outs = [out, *run(s)]
    assert prefill_tokens(outs, "B") == 2 + 3
    assert b.num_cached_tokens == 20 and b.output_token_ids == alone(shared + [7, 8], 4)
    st = s.kv.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (23 + 22, 20)


def test_an_identical_prompt_recomputes_its_last_block() -> None:
    s = make(num_blocks=16, block_size=4, budget=64)
    prompt = list(range(12))
    s.add_request(SchedRequest("A", list(prompt), 3))
    drain(s)
    b = SchedRequest("B", list(prompt), 3)
    s.add_request(b)
    out = step(s)
    # all 3 blocks are cached, but the cap (12 - 1) // 4 = 2 blocks leaves t8..t11 to run,
    # and the chunk that reaches the last prompt token samples
    (c,) = out.chunks
    assert (c.start_pos, c.token_ids, c.sample) == (8, [8, 9, 10, 11], True)
    assert c.block_table[:2] == [0, 1]
    drain(s)
    assert b.output_token_ids == alone(prompt, 3)


def test_one_token_past_a_block_boundary_runs_one_token() -> None:
    s = make(num_blocks=16, block_size=4, budget=64)
    s.add_request(SchedRequest("A", list(range(8)), 2))
    drain(s)
    s.add_request(SchedRequest("B", list(range(9)), 2))
    (c,) = step(s).chunks
    assert (c.start_pos, c.token_ids, c.sample) == (8, [8], True)  # a "decode" of its prompt


def test_generated_tokens_are_cached_too() -> None:
    s = make(num_blocks=16, block_size=4, budget=64)
    a = SchedRequest("A", list(range(6)), 6)
    s.add_request(a)
    drain(s)
    # A ended with 6 + 6 tokens, 11 computed: blocks [t0..t3] and [t4, t5, o0, o1] are full
    b_prompt = list(range(6)) + a.output_token_ids[:2] + [500, 501]
    b = SchedRequest("B", b_prompt, 2)
    s.add_request(b)
    (c,) = step(s).chunks
    assert (c.start_pos, c.token_ids) == (8, [500, 501])
    drain(s)
    assert b.output_token_ids == alone(b_prompt, 2)


def test_hit_on_blocks_a_running_request_holds() -> None:
    s = make(num_blocks=16, block_size=4, budget=64)
    s.add_request(SchedRequest("A", list(range(10)), 20))
    step(s)  # A's prompt is computed: blocks 0, 1 registered, 2 partial
    s.add_request(SchedRequest("B", list(range(8)) + [77], 20))
    out = step(s)
    assert summary(out) == [("A", 10, 1, [0, 1, 2], True), ("B", 8, 1, [0, 1, 3], True)]
    assert s.kv.block_owners() == {0: ["A", "B"], 1: ["A", "B"], 2: ["A"], 3: ["B"]}
    assert [s.kv.pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    s.finish("A")
    assert [s.kv.pool.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    drain(s)
    assert s.kv.pool.num_free_blocks == 16


def test_a_chunked_prompt_is_hittable_block_by_block() -> None:
    s = make(num_blocks=16, block_size=4, budget=64, threshold=4)
    s.add_request(SchedRequest("A", list(range(14)), 3))
    step(s)
    step(s)  # A has computed 8 tokens in two chunks: both blocks registered already
    s.add_request(SchedRequest("B", list(range(10)), 3))
    out = step(s)
    assert summary(out) == [("A", 8, 4, [0, 1, 2], False), ("B", 8, 2, [0, 1, 3], True)]


def test_preempted_request_hits_its_own_blocks_on_return() -> None:
    # test_scheduler's test_preemption_newest_first_then_resume_recomputes with the cache on
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add_request(req("A", 6, max_tokens=5))
    s.add_request(req("B", 6, max_tokens=6, base=50))
    assert summary(step(s)) == [("A", 0, 6, [0, 1], True), ("B", 0, 6, [2, 3], True)]
    step(s)
    step(s)
    out = step(s)
    assert out.preempted_ids == ["B"]
    # B had 8 tokens computed: both blocks registered, freed tail first (free list [3, 2]):
    # A takes 3, which evicts B's second block; B's first block (2) stays cached
    assert summary(out) == [("A", 8, 1, [0, 1, 3], True)]
    assert s.kv.pool.free_block_ids() == [2] and s.kv.pool.num_evictable_cached_blocks == 1
    b = s.get("B")
    assert b is not None and b.status == RequestStatus.PREEMPTED
    assert summary(step(s)) == [("A", 9, 1, [0, 1, 3], True)]
    out = step(s)
    # back, B hits block 2 (its own t0..t3) and recomputes only t4 .. t8
    assert summary(out) == [("B", 4, 5, [2, 3, 1], True)]
    assert out.chunks[0].token_ids == [54, 55] + alone(list(range(50, 56)), 3)
    assert b.num_cached_tokens == 4
    drain(s)
    assert b.output_token_ids == alone(list(range(50, 56)), 6)
    assert s.kv.pool.num_free_blocks == 4


def test_same_prompt_admitted_together_computes_twice_then_one_block_is_cached() -> None:
    s = make(num_blocks=8, block_size=4, budget=64)
    s.add_request(SchedRequest("A", list(range(9)), 2))
    s.add_request(SchedRequest("B", list(range(9)), 2))
    out = step(s)  # nothing registered before this step ran: no hit
    assert summary(out) == [("A", 0, 9, [0, 1, 2], True), ("B", 0, 9, [3, 4, 5], True)]
    assert [s.kv.pool.block_hash(b) is not None for b in range(6)] == [True] * 2 + [False] * 4
    drain(s)
    s.add_request(SchedRequest("C", list(range(9)), 2))
    assert summary(step(s))[0][:2] == ("C", 8)


def test_extra_keys_keep_prefixes_apart() -> None:
    s = make(num_blocks=16, block_size=4, budget=64)
    s.add_request(SchedRequest("A", list(range(9)), 2))
    drain(s)
    s.add_request(SchedRequest("B", list(range(9)), 2, cache_extra_keys=("adapter-x",)))
    assert summary(step(s))[0][:3] == ("B", 0, 9)
    drain(s)
    s.add_request(SchedRequest("C", list(range(9)), 2, cache_extra_keys=("adapter-x",)))
    assert summary(step(s))[0][:3] == ("C", 8, 1)


def test_cached_blocks_are_evicted_when_the_pool_needs_them() -> None:
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add_request(SchedRequest("A", list(range(12)), 2))
    drain(s)
    assert s.kv.pool.num_evictable_cached_blocks == 3
    # C shares nothing and needs all 4 blocks: every cached block is reclaimed
    s.add_request(SchedRequest("C", list(range(500, 514)), 2))
    step(s)
    assert s.kv.pool.num_cached_blocks == 3 and s.kv.pool.num_evictions == 3  # C's own
    drain(s)
    s.add_request(SchedRequest("A2", list(range(12)), 2))
    assert summary(step(s))[0][:2] == ("A2", 0)  # A's prefix is gone


def test_caching_off_never_hits() -> None:
    s = make(num_blocks=16, block_size=4, budget=64, caching=False)
    s.add_request(SchedRequest("A", list(range(12)), 2))
    drain(s)
    s.add_request(SchedRequest("B", list(range(12)), 2))
    assert summary(step(s))[0][:3] == ("B", 0, 12)
    st = s.kv.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits, st.cached_blocks) == (0, 0, 0)
