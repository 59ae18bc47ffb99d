"""Scheduler sharing: n>1 on one prefill (fork + copy-on-write), beam forks/appends, seats and
the idle-beam rule, with exact chunks and block ids."""

from __future__ import annotations

import pytest

from fitserve.sched.request import SchedRequest
from fitserve.types import RequestStatus

from .test_scheduler import make, req


def children(parent: SchedRequest, n: int) -> None:
    parent.fork_children = [SchedRequest(f"{parent.request_id}.{j}", parent.prompt_token_ids, parent.max_tokens)
                            for j in range(1, n)]


def test_n_samples_compute_the_prompt_once_then_fork_with_copy_on_write() -> None:
    s = make(num_blocks=16, block_size=4, budget=16)
    a = req("A", 6, max_tokens=3)
    children(a, 3)
    s.add_request(a)
    out = s.schedule()
    # the prompt once; its logits give every child its first token (fanout)
    assert [(c.request_id, c.token_ids, c.start_pos, c.block_table, c.sample, c.fanout) for c in out.chunks] == [
        ("A", [0, 1, 2, 3, 4, 5], 0, [0, 1], True, ["A.1", "A.2"])]
    assert s.num_running == 1
    s.update(out, {"A": 10, "A.1": 11, "A.2": 12})
    assert [r.request_id for r in s.running] == ["A", "A.1", "A.2"]
    assert [r.output_token_ids for r in s.running] == [[10], [11], [12]]
    assert [s.kv.pool.ref_count(b) for b in (0, 1)] == [3, 3]
    out = s.schedule()
    # each writes its token at position 6 (block 1, slot 2); the first two copy the shared
    # partial block (slots 0-1 hold p4, p5), the last holder writes it in place
    assert [(c.request_id, c.token_ids, c.start_pos, c.block_table, c.fanout) for c in out.chunks] == [
        ("A", [10], 6, [0, 2], []), ("A.1", [11], 6, [0, 3], []), ("A.2", [12], 6, [0, 1], [])]
    assert out.block_copies == [(1, 2), (1, 3)]
    s.update(out, {"A": 20, "A.1": 21, "A.2": 22})
    assert s.kv.pool.ref_count(0) == 3 and s.kv.stats().shared_blocks == 1
    for rid in ("A", "A.1", "A.2"):
        s.finish(rid)
    assert s.kv.pool.num_free_blocks == 16


def test_a_prompt_of_whole_blocks_forks_with_no_copy() -> None:
    s = make(block_size=4)
    a = req("A", 8, max_tokens=2)
    children(a, 2)
    s.add_request(a)
    s.update(s.schedule(), {"A": 1, "A.1": 2})
    out = s.schedule()
    assert out.block_copies == [] and [c.block_table for c in out.chunks] == [[0, 1, 2], [0, 1, 3]]


def test_finishing_a_parent_before_its_fork_releases_its_children_as_plain_requests() -> None:
    s = make(block_size=4, budget=4)
    a = req("A", 9, max_tokens=2)
    children(a, 3)
    s.add_request(a)
    s.update(s.schedule(), {})  # 4 of the 9 prompt tokens
    assert s.get("A.1") is not None and s.get("A.1").status == RequestStatus.WAITING
    s.finish("A.2")  # a child aborted while waiting: it held nothing
    assert a.seats == 2
    s.finish("A")
    assert [r.request_id for r in s.waiting] == ["A.1"] and s.get("A.1").awaiting_fork_of is None
    out = s.schedule()
    # the parent's full first block was registered: the orphan starts from it
    assert out.chunks[0].request_id == "A.1" and out.chunks[0].start_pos == 4


def test_seats_hold_room_for_the_forks() -> None:
    s = make(max_num_seqs=3)
    a = req("A", 5, max_tokens=4)
    children(a, 3)
    s.add_request(a)
    s.add_request(req("B", 5, max_tokens=4))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["A"]  # B waits: A holds 3 seats
    big = req("C", 5, max_tokens=4)
    children(big, 4)
    with pytest.raises(ValueError, match="needs 4 sequences at once, more than max_num_seqs=3"):
        s.add_request(big)
    assert s.get("C.1") is None and s.get("C") is None


def test_a_group_must_fit_the_pool_as_the_planner_counts_it() -> None:
    # 4 sequences of up to 14 tokens over a 10-token prompt: 2 shared blocks + 4 x (4 - 2)
    s = make(num_blocks=9, block_size=4, max_model_len=64)
    a = req("A", 10, max_tokens=4)
    children(a, 4)
    with pytest.raises(ValueError, match="with its 3 siblings can grow to 14 tokens each, which needs 10 blocks"):
        s.add_request(a)


def test_beam_fork_and_append_share_the_table() -> None:
    s = make(block_size=4, budget=16)
    root = req("b0", 6, max_tokens=4)
    root.seats = 2
    s.add_request(root)
    out = s.schedule()
    s.update(out, {})  # a beam's chunk: no sampled token; it is idle until its group chooses
    assert root.is_idle and s.schedule().chunks == []
    child = SchedRequest("b1", root.prompt_token_ids, 4, output_token_ids=[7])
    s.fork("b0", child)
    s.append_token("b0", 8)
    assert (root.seats, child.seats, child.num_computed_tokens) == (1, 1, 6)
    out = s.schedule()
    assert [(c.request_id, c.token_ids, c.block_table) for c in out.chunks] == [
        ("b0", [8], [0, 2]), ("b1", [7], [0, 1])]
    assert out.block_copies == [(1, 2)]


def test_idle_beams_give_way_when_nothing_else_can_run() -> None:
    """Idle beams hold the pool while their group's last beam waits: the newest idle one is
    preempted and queued behind the head, so the head (that beam) runs."""
    s = make(num_blocks=4, block_size=4, budget=16, max_model_len=16)
    x = req("x", 8, max_tokens=4)
    y = req("y", 8, max_tokens=4, base=50)
    s.add_request(x)
    s.add_request(y)
    s.update(s.schedule(), {})  # both computed, idle (beams waiting for a sibling): 4 blocks held
    z = req("z", 5, max_tokens=3, base=90)
    s.add_request(z)
    out = s.schedule()
    assert out.preempted_ids == ["y"] and [c.request_id for c in out.chunks] == ["z"]
    assert [r.request_id for r in s.waiting] == ["y"]
