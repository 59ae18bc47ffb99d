"""Scheduling policies on the real engine: the tokens are those of plain fcfs (scheduling moves
work between steps, never changes it), the TPOT cap shows in every recorded step, a rejected
request leaves nothing behind, and bad settings fail before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitserve.engine.core import Engine
from fitserve.ledger.errors import PlanError
from fitserve.ledger.step_time import StepTimeModel, save_step_model
from fitserve.sampling import SamplingParams
from fitserve.sched.slo import AdmissionRejected

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1 + (7 * i + 3 * j) % 900 for j in range(n)] for i, n in enumerate((5, 9, 3, 70, 40))]
MODEL = StepTimeModel(a=0.010, b=0.001, c=0.0, d=0.0, source="test: 10 ms + 1 ms per token")
TPOT_MS = 40.0  # with 3 decodes: 10 + 3 + x <= 40 -> prompt chunks of at most 27 tokens


@pytest.fixture()
def step_model_file(tmp_path: Path) -> Path:
    path = tmp_path / "step-model.json"
    save_step_model(MODEL, path)
    return path


def _run(engine: Engine, *, early: int = 3, **kw: object) -> dict[str, list[int]]:
    """The first ``early`` prompts start together; the others arrive once they are decoding."""
    ids = [engine.add_request(p, GREEDY, request_id=f"r{i}", **kw)  # type: ignore[arg-type]
           for i, p in enumerate(PROMPTS[:early])]
    done: dict[str, list[int]] = {}
    added = False
    while len(done) < len(PROMPTS):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if not added:
            for i, p in enumerate(PROMPTS[early:], start=early):
                ids.append(engine.add_request(p, GREEDY, request_id=f"r{i}", **kw))  # type: ignore[arg-type]
            added = True
    assert sorted(done) == sorted(ids)
    return done


def test_slo_and_priority_give_fcfs_tokens_and_slo_caps_chunks(make_engine, step_model_file: Path) -> None:  # type: ignore[no-untyped-def]
    fcfs = _run(make_engine())
    slo = make_engine(scheduling_policy="slo", slo_tpot_ms=TPOT_MS, step_model=str(step_model_file))
    assert slo.scheduler.step_model == MODEL
    assert _run(slo) == fcfs
    # the cap is the model's (scaled by the measured correction: these steps are far slower
    # than 10 ms + 1 ms/token) and no step beside decodes took more prompt tokens than it
    first = MODEL.max_new_tokens(TPOT_MS / 1000, new_tokens=3, seqs=3)
    capped = [r for r in slo.step_log if r.num_decodes and r.prefill_cap is not None]
    assert capped and all(r.num_prefill_tokens <= r.prefill_cap for r in capped)  # type: ignore[operator]
    assert capped[0].prefill_cap <= first and capped[0].num_prefill_tokens == capped[0].prefill_cap
    assert sum(r.num_prefill_tokens == r.prefill_cap for r in capped) >= 2  # cut at the cap
    assert slo.stats().slo_step_time_correction > 1  # measured steps are slower than the model
    prio = make_engine(scheduling_policy="priority")
    assert _run(prio, priority=3) == fcfs


def test_rejected_request_leaves_nothing_and_the_others_finish(make_engine, step_model_file: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(scheduling_policy="slo", slo_ttft_ms=10_000, step_model=str(step_model_file))
    engine.add_request(PROMPTS[0], GREEDY, request_id="ok")
    engine.step()
    used = engine.kv.stats().used_blocks
    with pytest.raises(AdmissionRejected, match="TTFT target of 5 ms") as info:
        engine.add_request(PROMPTS[3], GREEDY, request_id="late", slo_ttft_ms=5)
    assert info.value.predicted_s == pytest.approx(MODEL.predict(1 + 70, 2, 0), abs=1e-12)
    assert engine.num_unfinished_requests == 1 and engine.kv.stats().used_blocks == used
    assert engine.stats().slo_rejected == 1
    engine.add_request(PROMPTS[3], GREEDY, request_id="late")  # the id is free again
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.stats().used_blocks == 0


@pytest.mark.parametrize(("fields", "needle"), [
    ({"scheduling_policy": "lifo"}, "--scheduling-policy must be one of"),
    ({"scheduling_policy": "slo"}, "needs a target"),
    ({"slo_ttft_ms": 100}, "apply to --scheduling-policy slo"),
    ({"scheduling_policy": "slo", "slo_tpot_ms": -5}, "bad SLO setting"),
    ({"scheduling_policy": "slo", "slo_tpot_ms": 50, "slo_action": "drop"}, "bad SLO setting"),
])
def test_bad_scheduling_settings_fail_before_loading(fields: dict[str, object], needle: str) -> None:
    from fitserve.config import EngineConfig

    # a model path that does not exist: the settings must be refused before it is looked at
    with pytest.raises(ValueError, match=needle):
        Engine(EngineConfig(model="/nonexistent/model.gguf", device="cpu", **fields))  # type: ignore[arg-type]


def test_bad_request_scheduling_fields(make_engine, step_model_file: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fcfs = make_engine()
    with pytest.raises(ValueError, match="priorities need --scheduling-policy priority"):
        fcfs.add_request(PROMPTS[0], GREEDY, priority=1)
    slo = make_engine(scheduling_policy="slo", slo_tpot_ms=50, step_model=str(step_model_file))
    with pytest.raises(ValueError, match="slo_ttft_ms must be a number > 0"):
        slo.add_request(PROMPTS[0], GREEDY, slo_ttft_ms=0)
    assert fcfs.num_unfinished_requests == 0 and slo.num_unfinished_requests == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "a": -1, "b": 0, "c": 0, "d": 0}))
    with pytest.raises(PlanError, match="bad.json"):
        make_engine(scheduling_policy="slo", slo_tpot_ms=50, step_model=str(bad))


def test_llm_generate_takes_vllm_priorities(make_engine) -> None:  # type: ignore[no-untyped-def]
    from fitserve.engine.llm import LLM

    def llm_over(engine: Engine) -> LLM:
        llm = LLM.__new__(LLM)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = PROMPTS[:3]  # 5, 9 and 3 tokens
    plain = [r.outputs[0].token_ids for r in llm_over(make_engine(max_num_seqs=1)).generate(prompts, params)]
    llm = llm_over(make_engine(scheduling_policy="priority", max_num_seqs=1))
    got = llm.generate(prompts, params, priority=[2, 0, 1])
    assert [r.outputs[0].token_ids for r in got] == plain  # results in the prompts' order
    # one seat: the 9-token prompt (priority 0) ran first, then the 3-token one, then the 5
    firsts = [rec.new_tokens for rec in llm.engine.step_log if rec.num_prefill_tokens]
    assert firsts == [9, 3, 5]
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate(prompts, params, priority=[0, 1])
