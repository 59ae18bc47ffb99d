"""Scheduling policies with exact numbers: the TPOT chunk cap, TTFT admission, priority order.

The step-time model is t = 10 ms + 1 ms x new_tokens (c = d = 0), so every prediction below is
arithmetic that can be checked by hand; the clock is fake.
"""

from __future__ import annotations

import pytest

from fitserve.config import SchedulerConfig
from fitserve.kv.manager import KVCacheManager
from fitserve.ledger.step_time import StepTimeModel
from fitserve.sched.request import SchedRequest
from fitserve.sched.scheduler import Scheduler
from fitserve.sched.slo import AdmissionRejected, predict_ttft, step_shape
from fitserve.types import ScheduledChunk, SchedulerOutput

MODEL = StepTimeModel(a=0.010, b=0.001, c=0.0, d=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(policy: str = "slo", *, budget: int = 512, seqs: int = 8, ttft_ms: float | None = None,
         tpot_ms: float | None = None, action: str = "reject", clock: Clock | None = None,
         num_blocks: int = 256) -> Scheduler:
    # headroom 1: the rules plan for the targets themselves (the arithmetic below is exact)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=1024,
                          scheduling_policy=policy, slo_ttft_ms=ttft_ms, slo_tpot_ms=tpot_ms,
                          slo_action=action, slo_headroom=1.0)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4), step_model=MODEL if policy == "slo" else None,
                     clock=clock or Clock())


def req(rid: str, n: int, max_tokens: int = 100, **kw: object) -> SchedRequest:
    """Distinct tokens per request id, so no prefix-cache hit shortens a prompt."""
    base = sum(map(ord, rid)) * 1000
    return SchedRequest(rid, [base + i for i in range(n)], max_tokens, **kw)  # type: ignore[arg-type]


def run(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, {c.request_id: 1 for c in out.chunks if c.sample})
    return out


def lens(out: SchedulerOutput) -> dict[str, int]:
    return {c.request_id: len(c.token_ids) for c in out.chunks}


@pytest.mark.parametrize(("tpot_ms", "chunk"), [
    (30, 16),   # 10 + (4 decodes + x) <= 30  ->  x = 16
    (50, 36),   # 10 + 4 + x <= 50            ->  x = 36
    (12, 4),    # even the decodes alone miss: one block (4 tokens) so the queue moves
    (None, 100),  # no TPOT target: the whole prompt (budget 512)
])
def test_tpot_target_caps_the_prompt_chunk_beside_decodes(tpot_ms: float | None, chunk: int) -> None:
    # deprioritize: admission (which would turn the 12 ms requests away) queues them anyway
    s = make(tpot_ms=tpot_ms, action="deprioritize")
    for i in range(4):
        s.add_request(req(f"d{i}", 2))
    assert lens(run(s)) == {f"d{i}": 2 for i in range(4)}  # no decodes yet: nothing capped
    s.add_request(req("long", 100))
    out = run(s)
    assert lens(out) == {**{f"d{i}": 1 for i in range(4)}, "long": chunk}
    if tpot_ms is not None and chunk > 4:  # the cap is what the model allows, to the token
        assert MODEL.predict_shape(step_shape(out)) <= tpot_ms / 1000 + 1e-12
        assert MODEL.predict(step_shape(out).new_tokens + 1, 6, 0) > tpot_ms / 1000


def test_tightest_tpot_among_the_decodes_sets_the_cap() -> None:
    s = make(tpot_ms=50)
    s.add_request(req("d0", 2))
    s.add_request(req("d1", 2, slo_tpot_s=0.020))  # its own, tighter target
    run(s)
    s.add_request(req("long", 100))
    assert lens(run(s))["long"] == 8  # 10 + 2 + x <= 20


def test_a_running_prompt_is_capped_too_and_resumes_next_step() -> None:
    s = make(tpot_ms=30)
    for i in range(4):
        s.add_request(req(f"d{i}", 2))
    run(s)
    s.add_request(req("long", 40))
    assert lens(run(s))["long"] == 16
    assert lens(run(s))["long"] == 16  # running now, still capped
    assert lens(run(s))["long"] == 8   # the rest


def test_admission_rejects_exactly_the_requests_predicted_to_miss_ttft() -> None:
    """Budget 64, no TPOT target (cap = budget), TTFT target 100 ms. Backlogs and predictions:

        r0: 32 tokens        -> t(0 + 32)                           = 42 ms   admitted
        r1: 32 + 32 = 64     -> t(1 + 64)                           = 75 ms   admitted
        r2: 64 + 32 = 96     -> t(2 + 64) + t(2 + 32) = 76 + 44     = 120 ms  rejected
        r3: 64 + 8  = 72     -> t(2 + 64) + t(2 + 8)  = 76 + 20     = 96 ms   admitted
    (t(x) = 10 + x ms; the decodes counted are the requests ahead, which will be decoding)
    """
    s = make(budget=64, ttft_ms=100)
    for rid, n, want in (("r0", 32, 0.042), ("r1", 32, 0.075)):
        r = req(rid, n)
        s.add_request(r)
        assert r.predicted_ttft_s == pytest.approx(want, abs=1e-12)
    free = s.kv.pool.num_free_blocks
    with pytest.raises(AdmissionRejected) as info:
        s.add_request(req("r2", 32))
    exc = info.value
    assert exc.predicted_s == pytest.approx(0.120, abs=1e-12) and exc.target_s == 0.1 and exc.target == "TTFT"
    assert exc.retry_after_s == 1 and "r2" in str(exc) and "TTFT target" in str(exc)
    assert s.get("r2") is None and s.num_waiting == 2 and s.kv.pool.num_free_blocks == free
    r3 = req("r3", 8)
    s.add_request(r3)
    assert r3.predicted_ttft_s == pytest.approx(0.096, abs=1e-12)
    assert s.slo is not None and s.slo.num_rejected == 1
    # the rejected id is free to come back later
    assert [c.request_id for c in run(s).chunks] == ["r0", "r1"]


def test_admission_keeps_the_decode_batch_within_the_tpot_target() -> None:
    """TPOT 30 ms, one block (4 tokens) of prompt beside the decodes: a step of B decodes
    takes 10 + (B + 4) ms, so B = 16 fits and the 17th request is turned away."""
    s = make(tpot_ms=30, seqs=64)
    for i in range(16):
        s.add_request(req(f"r{i}", 2))
    with pytest.raises(AdmissionRejected) as info:
        s.add_request(req("r16", 2))
    exc = info.value
    assert exc.target == "TPOT" and exc.target_s == 0.030
    assert exc.predicted_s == pytest.approx(0.010 + 0.001 * (17 + 4), abs=1e-12)
    assert "TPOT target of 30 ms" in str(exc) and exc.retry_after_s == 1
    assert s.num_waiting == 16 and s.get("r16") is None
    # a request bringing its own tighter target makes the bar lower for the batch it joins
    t = make(tpot_ms=30)
    t.add_request(req("tight", 2, slo_tpot_s=0.016))  # 10 + (1 + 4) = 15 ms
    t.add_request(req("second", 2))  # 10 + (2 + 4) = 16 ms: fits the 16 ms exactly
    with pytest.raises(AdmissionRejected, match="TPOT target of 16 ms"):
        t.add_request(req("third", 2))  # 17 ms: fine for its own 30 ms, not for "tight"


def test_deprioritize_queues_a_late_request_behind_the_on_time_ones() -> None:
    s = make(budget=64, ttft_ms=100, action="deprioritize")
    for rid, n in (("r0", 32), ("r1", 32), ("r2", 32), ("r3", 8)):
        s.add_request(req(rid, n))
    r2 = s.get("r2")
    assert r2 is not None and r2.late and r2.predicted_ttft_s == pytest.approx(0.120, abs=1e-12)
    # r3 was predicted without r2 in its backlog (r2 is late): 96 ms, on time
    r3 = s.get("r3")
    assert r3 is not None and not r3.late and r3.predicted_ttft_s == pytest.approx(0.096, abs=1e-12)
    assert [r.request_id for r in s.waiting] == ["r0", "r1", "r3", "r2"]
    assert lens(run(s)) == {"r0": 32, "r1": 32}
    assert lens(run(s)) == {"r0": 1, "r1": 1, "r3": 8, "r2": 32}


def test_a_request_overdue_in_the_queue_is_deprioritized_and_overrides_apply() -> None:
    clock = Clock()
    s = make(seqs=1, ttft_ms=100, action="deprioritize", clock=clock)
    s.add_request(req("a", 4, max_tokens=50, slo_ttft_s=10.0))
    run(s)  # a holds the only seat
    b = req("b", 4, slo_ttft_s=5.0)  # seat wait 49 decode steps x 11 ms + t(4) = 0.553 s
    s.add_request(b)
    assert not b.late and b.predicted_ttft_s == pytest.approx(0.553, abs=1e-12)
    clock.now = 5.5  # b has waited past its own 5 s target without starting
    run(s)
    assert b.late
    s.add_request(req("c", 4, slo_ttft_s=100.0))
    assert [r.request_id for r in s.waiting] == ["c", "b"]


def test_seat_wait_counts_the_fewest_steps_a_running_request_has_left() -> None:
    s = make(seqs=1, ttft_ms=10_000)
    s.add_request(req("a", 4, max_tokens=50))
    run(s)  # a: 1 output, 49 to go, decoding
    b = req("b", 4)
    s.add_request(b)
    # seat wait 49 x t(decode of a) = 49 x 11 ms; then b's prompt: the decodes counted are
    # min(1 + 0, max_num_seqs - 1 = 0) = 0 -> t(4) = 14 ms
    assert b.predicted_ttft_s == pytest.approx(49 * 0.011 + 0.014, abs=1e-12)


def test_predict_ttft_formula() -> None:
    # backlog 130 at cap 64 beside 3 decodes: 2 full steps of t(3 + 64) and one of t(3 + 2)
    got = predict_ttft(MODEL, backlog_tokens=130, cap=64, decode_tokens=3, decode_seqs=3,
                       decode_kv=300, seat_wait_s=0.5)
    assert got == pytest.approx(0.5 + 2 * 0.077 + 0.015, abs=1e-12)


def test_slo_needs_a_step_model_and_valid_settings() -> None:
    cfg = SchedulerConfig(scheduling_policy="slo", slo_ttft_ms=100)
    s = Scheduler(cfg, KVCacheManager(64, 4))
    with pytest.raises(RuntimeError, match="step-time model"):
        s.add_request(req("x", 4))
    s.step_model = MODEL
    s.add_request(req("x", 4))
    with pytest.raises(ValueError, match="scheduling policy must be one of"):
        Scheduler(SchedulerConfig(scheduling_policy="lifo"), KVCacheManager(64, 4))
    with pytest.raises(ValueError, match="slo action"):
        Scheduler(SchedulerConfig(scheduling_policy="slo", slo_action="drop"), KVCacheManager(64, 4))
    with pytest.raises(ValueError, match="tpot_s must be > 0"):
        Scheduler(SchedulerConfig(scheduling_policy="slo", slo_tpot_ms=-1), KVCacheManager(64, 4))
    with pytest.raises(ValueError, match="uses no step-time model"):
        make("fcfs").step_model = MODEL


def test_priority_orders_the_queue_and_preempts_the_lowest_priority() -> None:
    s = make("priority", budget=64, num_blocks=8)  # 32 slots
    s.add_request(req("low", 8, max_tokens=8, priority=5))
    s.add_request(req("high", 8, max_tokens=8, priority=-1))
    s.add_request(req("mid", 4, max_tokens=8, priority=0))
    assert [r.request_id for r in s.waiting] == ["high", "mid", "low"]
    out = run(s)
    assert [c.request_id for c in out.chunks] == ["high", "mid", "low"]
    assert [r.request_id for r in s.running] == ["high", "mid", "low"]
    # 5 of 8 blocks used (2 + 1 + 2); decodes grow until the pool runs out: the lowest
    # priority request goes first, though it is the oldest (fcfs would take "mid", the newest)
    preempted: list[str] = []
    for _ in range(12):
        preempted += run(s).preempted_ids
    assert preempted[0] == "low" and "high" not in preempted


def test_priority_needs_the_priority_policy() -> None:
    with pytest.raises(ValueError, match="priorities need --scheduling-policy priority"):
        make("fcfs").add_request(req("x", 4, priority=1))


def test_step_shape_counts_tokens_seqs_and_context_read() -> None:
    out = SchedulerOutput(chunks=[
        ScheduledChunk("a", [1] * 16, 0, [0, 1, 2, 3], True),
        ScheduledChunk("b", [1], 40, list(range(11)), True),
        ScheduledChunk("c", [1, 2, 3], 9, [4, 5, 6], True, num_draft=2),
    ], num_batched_tokens=20)
    shape = step_shape(out)
    assert (shape.new_tokens, shape.seqs, shape.kv_tokens_read) == (20, 3, 16 + 41 + 12)


def test_measured_steps_scale_the_model_the_rules_use() -> None:
    """Steps measured at twice the model's time: the correction moves a fifth of the way each
    step (1.2, then 1.36) and the chunk cap shrinks with the scaled model."""
    s = make(tpot_ms=50, action="deprioritize")
    assert s.slo is not None
    for i in range(4):
        s.add_request(req(f"d{i}", 2))
    run(s)
    shape = step_shape(SchedulerOutput(chunks=[ScheduledChunk("x", [1] * 10, 0, [0, 1, 2], True)],
                                       num_batched_tokens=10))
    s.slo.observe(shape, 2 * MODEL.predict_shape(shape))
    assert s.slo.correction == pytest.approx(1.2, abs=1e-12)
    s.slo.observe(shape, 2 * MODEL.predict_shape(shape))
    assert s.slo.correction == pytest.approx(1.36, abs=1e-12)
    s.add_request(req("long", 100))
    # 1.36 x (10 + 4 + x) <= 50  ->  x = floor(50 / 1.36 - 14) = 22
    assert lens(run(s))["long"] == 22
    for _ in range(50):  # a wild measurement cannot push it past the clamp
        s.slo.observe(shape, 100 * MODEL.predict_shape(shape))
    assert s.slo.correction == 4.0


def test_headroom_plans_for_a_share_of_the_target() -> None:
    def sched(**kw: float) -> Scheduler:  # the default headroom, 0.85
        cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=1024,
                              scheduling_policy="slo", **kw)  # type: ignore[arg-type]
        return Scheduler(cfg, KVCacheManager(256, 4), step_model=MODEL, clock=Clock())

    s = sched(slo_tpot_ms=50)
    for i in range(4):
        s.add_request(req(f"d{i}", 2))
    run(s)
    s.add_request(req("long", 100))
    assert lens(run(s))["long"] == 28  # 10 + 4 + x <= 0.85 x 50 = 42.5 ms  ->  x = 28
    t = sched(slo_ttft_ms=40)
    with pytest.raises(AdmissionRejected) as info:  # t(30) = 40 ms: the target, not 0.85 of it
        t.add_request(req("p", 30))
    assert info.value.target_s == pytest.approx(0.040) and info.value.predicted_s == pytest.approx(0.040)
    t.add_request(req("q", 23))  # t(23) = 33 ms <= 0.85 x 40 = 34 ms
    with pytest.raises(ValueError, match="headroom must be in"):
        Scheduler(SchedulerConfig(scheduling_policy="slo", slo_headroom=1.5), KVCacheManager(8, 4))
