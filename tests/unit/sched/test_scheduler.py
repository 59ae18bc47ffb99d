"""Scheduler: exact chunks and block ids for chunked prefill, admission, preemption, finish."""

from __future__ import annotations

import pytest

from fitserve.config import SchedulerConfig
from fitserve.kv.manager import KVCacheManager
from fitserve.sched.request import SchedRequest
from fitserve.sched.scheduler import Scheduler
from fitserve.types import RequestStatus, ScheduledChunk, SchedulerOutput


def fake_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the request's own tokens."""
    return (sum(tokens) * 31 + len(tokens)) % 1000


def make(
    num_blocks: int = 32,
    block_size: int = 4,
    budget: int = 8,
    max_num_seqs: int = 8,
    max_model_len: int = 128,
    threshold: int | None = None,
    caching: bool = True,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, enable_caching=caching))


def req(rid: str, n: int, max_tokens: int = 100, base: int = 0) -> SchedRequest:
    return SchedRequest(rid, [base + i for i in range(n)], max_tokens)


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step with the fake model; finishes requests that reach max_tokens."""
    out = s.schedule()
    sampled: dict[str, int] = {}
    for c in out.chunks:
        r = s.get(c.request_id)
        assert r is not None
        assert r.all_token_ids[c.start_pos : c.start_pos + len(c.token_ids)] == c.token_ids
        if c.sample:
            sampled[c.request_id] = fake_token(r.all_token_ids)
    s.update(out, sampled)
    for rid in sampled:
        r = s.get(rid)
        if r is not None and len(r.output_token_ids) >= r.max_tokens:
            s.finish(rid)
    return out


def drain(s: Scheduler, max_steps: int = 1000) -> None:
    """Step until every request finished; a bounded loop, so a scheduler bug cannot hang."""
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        step(s)
    raise AssertionError(f"still unfinished after {max_steps} steps")


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(fake_token(toks))
    return toks[len(prompt) :]


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, list[int], bool]]:
    return [
        (c.request_id, c.start_pos, len(c.token_ids), c.block_table, c.sample) for c in out.chunks
    ]


def test_chunked_prefill_mixes_with_decodes_within_budget() -> None:
    s = make(budget=8)
    s.add_request(req("A", 3))
    s.add_request(req("B", 2, base=100))
    out = step(s)
    assert summary(out) == [("A", 0, 3, [0], True), ("B", 0, 2, [1], True)]
    assert out.num_batched_tokens == 5
    s.add_request(req("C", 20, base=200))
    # each step: A and B decode one token each, C gets the rest of the budget (6)
    expected = [
        [("A", 3, 1, [0], True), ("B", 2, 1, [1], True), ("C", 0, 6, [2, 3], False)],
        [("A", 4, 1, [0, 4], True), ("B", 3, 1, [1], True), ("C", 6, 6, [2, 3, 5], False)],
        [
            ("A", 5, 1, [0, 4], True),
            ("B", 4, 1, [1, 6], True),
            ("C", 12, 6, [2, 3, 5, 7, 8], False),
        ],
        [("A", 6, 1, [0, 4], True), ("B", 5, 1, [1, 6], True), ("C", 18, 2, [2, 3, 5, 7, 8], True)],
        [
            ("A", 7, 1, [0, 4], True),
            ("B", 6, 1, [1, 6], True),
            ("C", 20, 1, [2, 3, 5, 7, 8, 9], True),
        ],
    ]
    for want in expected:
        out = step(s)
        assert summary(out) == want
        assert out.num_batched_tokens == sum(n for _, _, n, _, _ in want) <= 8
    c = s.get("C")
    assert c is not None and c.output_token_ids == alone(list(range(200, 220)), 2)


def test_long_prefill_threshold_caps_a_chunk() -> None:
    s = make(budget=100, threshold=5)
    s.add_request(req("A", 12))
    s.add_request(req("B", 3))
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in step(s).chunks] == [
        ("A", 0, 5),
        ("B", 0, 3),
    ]
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in step(s).chunks] == [
        ("A", 5, 5),
        ("B", 3, 1),
    ]
    chunks = step(s).chunks
    assert [(c.request_id, c.start_pos, len(c.token_ids), c.sample) for c in chunks] == [
        ("A", 10, 2, True),
        ("B", 4, 1, True),
    ]


def test_budget_limits_admission_fifo() -> None:
    s = make(budget=6)
    s.add_request(req("A", 4))
    s.add_request(req("B", 4))
    s.add_request(req("C", 1))
    out = step(s)
    # B gets the 2 tokens left; C may not jump ahead even though it would fit
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("A", 4), ("B", 2)]
    assert [r.request_id for r in s.waiting] == ["C"]


def test_max_num_seqs_respected() -> None:
    s = make(budget=64, max_num_seqs=2)
    for rid in "ABC":
        s.add_request(req(rid, 3, max_tokens=2))
    assert [c.request_id for c in step(s).chunks] == ["A", "B"]
    assert (s.num_running, s.num_waiting) == (2, 1)
    out = step(s)  # A and B reach max_tokens=2 and finish after this step
    assert [c.request_id for c in out.chunks] == ["A", "B"]
    assert s.num_running == 0
    out = step(s)
    assert summary(out) == [("C", 0, 3, [1], True)]  # a freed block, before the untouched 2


def test_preemption_newest_first_then_resume_recomputes() -> None:
    # 4 blocks of 4 slots; A and B take 2 blocks each for 6-token prompts (no prefix cache:
    # the recompute is from scratch; test_prefix_cache.py has the same run with it on)
    s = make(num_blocks=4, block_size=4, budget=64, caching=False)
    s.add_request(req("A", 6, max_tokens=5))
    s.add_request(req("B", 6, max_tokens=6, base=50))
    assert summary(step(s)) == [("A", 0, 6, [0, 1], True), ("B", 0, 6, [2, 3], True)]
    step(s)
    step(s)  # two decodes later each has 8 tokens computed and 9 known
    out = step(s)  # A needs a 3rd block for slot 8: the newest (B) is preempted
    assert out.preempted_ids == ["B"]
    # B's blocks went back tail first (free list [3, 2]), so A gets block 3
    assert summary(out) == [("A", 8, 1, [0, 1, 3], True)]
    b = s.get("B")
    assert b is not None
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert len(b.output_token_ids) == 3 and s.total_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["B"]
    # B needs 3 blocks for 9 tokens, only 1 is free: it waits until A finishes
    assert summary(step(s)) == [("A", 9, 1, [0, 1, 3], True)]
    assert s.get("A") is None  # finished with 5 tokens, all its blocks back
    out = step(s)
    # B recomputes prompt + 3 outputs from scratch, then samples its 4th token;
    # free list was [2] + A's blocks tail first [3, 1, 0]
    assert summary(out) == [("B", 0, 9, [2, 3, 1], True)]
    assert out.chunks[0].token_ids == list(range(50, 56)) + alone(list(range(50, 56)), 3)
    b_final = s.get("B")
    drain(s)
    assert b_final is not None and b_final.output_token_ids == alone(list(range(50, 56)), 6)
    assert s.kv.pool.num_free_blocks == 4


def test_preempting_itself_when_it_is_the_newest() -> None:
    s = make(num_blocks=2, block_size=4, budget=64)
    s.add_request(req("A", 2, max_tokens=3))
    s.add_request(req("B", 4, max_tokens=3, base=10))
    step(s)
    out = step(s)  # A fits in its block; B needs a 2nd, and B is the newest
    assert out.preempted_ids == ["B"]
    assert summary(out) == [("A", 2, 1, [0], True)]
    assert s.kv.block_owners() == {0: ["A"]}
    b = s.get("B")
    assert b is not None and b.status == RequestStatus.PREEMPTED
    drain(s)
    assert b.output_token_ids == alone(list(range(10, 14)), 3)
    assert s.kv.pool.num_free_blocks == 2


def test_outputs_survive_preemption_unchanged() -> None:
    s = make(num_blocks=5, block_size=2, budget=7, threshold=3)
    prompts = {rid: list(range(i * 10, i * 10 + 3 + i)) for i, rid in enumerate("ABCD")}
    reqs = {rid: SchedRequest(rid, p, 4) for rid, p in prompts.items()}
    for r in reqs.values():
        s.add_request(r)
    drain(s)
    assert s.total_preemptions > 0
    for rid, r in reqs.items():
        assert r.status == RequestStatus.FINISHED
        assert r.output_token_ids == alone(prompts[rid], 4)
    assert s.kv.pool.num_free_blocks == 5


def test_finish_and_abort_free_blocks_immediately() -> None:
    s = make(num_blocks=8, block_size=4, budget=4, max_num_seqs=8)
    s.add_request(req("A", 10, max_tokens=5))
    s.add_request(req("B", 3, max_tokens=5))
    out = s.schedule()  # A gets a 4-token chunk, B waits for budget
    assert summary(out) == [("A", 0, 4, [0], False)]
    aborted = s.finish("A")
    assert aborted is not None and aborted.status == RequestStatus.FINISHED
    assert s.kv.pool.num_free_blocks == 8 and not s.kv.has_request("A")
    s.update(out, {})  # the aborted request's chunk is ignored
    assert s.finish("A") is None and s.get("A") is None
    waiting = s.finish("B")  # finishing a waiting request
    assert waiting is not None and not s.has_unfinished()
    assert s.schedule().is_empty
    assert s.finish("nope") is None


def test_add_request_errors() -> None:
    s = make(num_blocks=4, block_size=4, max_model_len=32)
    s.add_request(req("A", 3, max_tokens=5))
    with pytest.raises(ValueError, match="'A' is already"):
        s.add_request(req("A", 3))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(SchedRequest("E", [], 5))
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        s.add_request(req("Z", 3, max_tokens=0))
    with pytest.raises(ValueError, match="prompt of 32 tokens .* max_model_len=32"):
        s.add_request(req("L", 32))
    # 10 + 10 = 20 tokens need 5 blocks of 4; the pool has 4 (16 slots)
    with pytest.raises(ValueError, match="20 tokens, which needs 5 blocks of 4 .* has 4 blocks"):
        s.add_request(req("F", 10, max_tokens=10))
    s.add_request(req("G", 10, max_tokens=6))  # 16 tokens fit exactly
    assert [r.request_id for r in s.waiting] == ["A", "G"]
    assert [r.arrival for r in s.waiting] == [0, 1]


def test_stale_chunk_is_an_error() -> None:
    s = make()
    s.add_request(req("A", 3))
    out = s.schedule()
    s.update(out, {"A": 1})
    with pytest.raises(RuntimeError, match="stale chunk"):
        s.update(out, {"A": 1})


def test_chunk_type() -> None:
    s = make()
    s.add_request(req("A", 3))
    (c,) = s.schedule().chunks
    assert c == ScheduledChunk("A", [0, 1, 2], 0, [0], True)


def test_no_admission_in_a_step_that_preempted() -> None:
    # B (8-token prompt, chunks of 4) preempts itself at step 2; its restart chunk would need
    # only the 1 block just freed, but a step that preempted admits nothing
    s = make(num_blocks=3, block_size=4, budget=64, threshold=4, caching=False)
    s.add_request(req("A", 4, max_tokens=3))
    s.add_request(req("B", 8, max_tokens=3, base=10))
    assert summary(step(s)) == [("A", 0, 4, [0], True), ("B", 0, 4, [1], False)]
    out = step(s)
    assert out.preempted_ids == ["B"]
    assert summary(out) == [("A", 4, 1, [0, 2], True)]
    assert summary(step(s)) == [("A", 5, 1, [0, 2], True), ("B", 0, 4, [1], False)]
    drain(s)
    assert s.kv.pool.num_free_blocks == 3


def test_update_ignores_chunk_of_a_request_re_added_under_the_same_id() -> None:
    s = make()
    s.add_request(req("A", 3))
    out = s.schedule()
    s.finish("A")
    s.add_request(req("A", 5))  # a new request reusing the id, still waiting
    s.update(out, {"A": 7})
    a = s.get("A")
    assert a is not None and (a.num_computed_tokens, a.output_token_ids) == (0, [])
