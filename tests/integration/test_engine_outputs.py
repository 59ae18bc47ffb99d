"""Engine outputs: deltas per step, the final text complete, failures isolated per request.

The engine is built on a random-weight tiny Llama with SmolLM2's real tokenizer. Where a test
needs exact tokens (characters split across tokens, long real text) a scripted runner replaces
the model; the references are plain algorithms on the whole output: ``tokenizer.decode`` of every token, and
the first stop string found in that text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.sampling import RequestSamplingState, SamplingParams
from fitserve.types import FinishReason, RequestOutput, RunnerOutput, SchedulerOutput, TokenLogprobs
from tests.faults import InjectedFault

MAX_LEN = 4160


@pytest.fixture()
def make_engine(tiny_hf_model_dir: Callable[..., Any]) -> Callable[..., Engine]:
    folder = tiny_hf_model_dir("llama", max_position_embeddings=MAX_LEN)

    def make(**kwargs: Any) -> Engine:
        fields: dict[str, Any] = {"model": str(folder), "dtype": "float32", "device": "cpu",
                                  "max_model_len": MAX_LEN, "num_kv_blocks": 600}
        return Engine(EngineConfig(**{**fields, **kwargs}))

    return make


class ScriptedRunner:
    """Stands in for the ModelRunner: each sampling chunk gets its request's next scripted token."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        self.scripts = scripts
        self.pos = dict.fromkeys(scripts, 0)

    def execute(self, plan: SchedulerOutput, states: dict[str, RequestSamplingState]) -> RunnerOutput:
        out = RunnerOutput(sampled={})
        for c in plan.chunks:
            if c.sample:
                token = self.scripts[c.request_id][self.pos[c.request_id]]
                self.pos[c.request_id] += 1
                out.sampled[c.request_id] = token
                out.logprobs[c.request_id] = TokenLogprobs(token, -0.25, 1, [(token, -0.25)])
        return out


def run_to_end(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def reference(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """The plain algorithm: cut the whole decoded text at the first stop string in it."""
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    idx, stop = min(hits)
    return text[: idx + len(stop) if include else idx], stop


# -- 1. the last partial character of a finished request ----------------------------------------
def _cases(tok: Any) -> list[tuple[str, list[int], list[str]]]:
    emoji = tok.encode("😀", add_special_tokens=False)  # 3 byte-tokens of one 4-byte character
    jp = tok.encode("Hello 日本", add_special_tokens=False)  # 'Hello', ' \xe6', '\x97', '\xa5', '本'
    assert len(emoji) == 3 and tok.decode(jp[1:2]) == " \ufffd", "the tokenizer's split changed"
    hello = tok.encode("Hello", add_special_tokens=False)
    return [
        ("emoji cut after 2 of its 3 tokens", hello + emoji[:2], []),
        ("CJK cut after its first byte-token", jp[:2], []),
        ("EOS right after a partial character", hello + emoji[:1] + [2], []),
        ("a stop string inside the held-back tail", jp[:2], ["o "]),
        ("a stop string in ordinary text, then a cut character", jp[:3], ["ll"]),
    ]


@pytest.mark.parametrize("include", [False, True])
def test_final_text_keeps_the_character_cut_by_the_end(make_engine: Callable[..., Engine],
                                                       include: bool) -> None:
    engine = make_engine()
    cases = _cases(engine.tokenizer)
    scripts = {name: ids for name, ids, _ in cases}
    engine.runner = ScriptedRunner(scripts)  # type: ignore[assignment]
    for name, ids, stops in cases:
        params = SamplingParams(max_tokens=len(ids), stop=stops or None, include_stop_str_in_output=include)
        engine.add_request([1, 30, 198], params, request_id=name)
    outs = run_to_end(engine)
    assert engine.kv.stats().used_blocks == 0
    for name, ids, stops in cases:
        final = outs[name][-1]
        assert final.finished and all(not o.finished for o in outs[name][:-1])
        assert final.token_ids is not None and ids[: len(final.token_ids)] == final.token_ids
        full = engine.tokenizer.decode(final.token_ids)  # skip_special_tokens, like the engine
        want_text, want_stop = reference(full, stops, include)
        assert final.text == want_text, name
        assert "".join(o.delta_text for o in outs[name]) == want_text, name
        assert final.stop_reason == want_stop, name
        eos = final.token_ids[-1] == 2
        want_reason = FinishReason.STOP if want_stop is not None or eos else FinishReason.LENGTH
        assert final.finish_reason == want_reason, name
    # not vacuous: the cut character really is in the text (as the decoder renders it)
    assert outs["emoji cut after 2 of its 3 tokens"][-1].text == "Hello\ufffd"


# -- 2. per-step outputs carry deltas; a 4,000-token stream holds nothing that grows ------------
def _held(out: RequestOutput) -> int:
    """How many items one output holds beyond the (shared) prompt list."""
    return (len(out.delta_token_ids) + len(out.delta_text) + len(out.delta_logprobs or [])
            + len(out.token_ids or []) + len(out.text or "") + len(out.logprobs or []))


def test_a_4000_token_stream_sends_deltas_only(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    n = 4000
    # NOTE: scripted tokens (real text, with characters split across tokens) rather than the
    # random model, whose greedy loops over invalid bytes make the detokenizer's window long.
    text = "A naïve café in 日本 served 😀 pancakes; the queue grew, and grew. "
    line = engine.tokenizer.encode(text, add_special_tokens=False)
    script = (line * (n // len(line) + 1))[:n]
    engine.runner = ScriptedRunner({"long": script})  # type: ignore[assignment]
    params = SamplingParams(max_tokens=n, logprobs=1)
    engine.add_request([1, 30, 198, 50, 132], params, request_id="long")
    outs = run_to_end(engine)["long"]
    assert len(outs) == n
    *steps, final = outs
    for k, out in enumerate(steps, 1):
        assert out.token_ids is None and out.text is None and out.logprobs is None
        assert len(out.delta_token_ids) == 1 and len(out.delta_logprobs or []) == 1
        assert out.num_output_tokens == k
        assert out.prompt_token_ids is steps[0].prompt_token_ids  # shared, never copied
    # The largest output before the final one is as small as the first: nothing grows with n.
    per_step = [_held(o) for o in steps]
    assert max(per_step) <= 2 + 64, max(per_step)
    assert final.token_ids is not None and len(final.token_ids) == n
    assert final.logprobs is not None and len(final.logprobs) == n
    assert [t for o in outs for t in o.delta_token_ids] == final.token_ids
    assert [lp for o in outs for lp in o.delta_logprobs or []] == final.logprobs
    assert final.token_ids == script
    assert "".join(o.delta_text for o in outs) == final.text == engine.tokenizer.decode(script)
    assert engine.kv.stats().used_blocks == 0


# -- 4. a failing request is isolated; the others are untouched ----------------------------------
PROMPTS = {"a": [1, 54, 132, 28], "b": [1, 96, 198], "c": [50, 60, 70, 80, 90, 100, 110], "bad": [1, 2, 3]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


def _run(engine: Engine, ids: Sequence[str]) -> dict[str, RequestOutput]:
    for rid in ids:
        engine.add_request(PROMPTS[rid], GREEDY, request_id=rid)
    return {rid: o[-1] for rid, o in run_to_end(engine).items()}


@pytest.mark.parametrize("fail_after", [0, 4])
def test_a_failing_request_fails_alone(make_engine: Callable[..., Engine], fail_after: int) -> None:
    alone = _run(make_engine(), ["a", "b", "c"])
    engine = make_engine()
    seen: list[list[str]] = []

    def hook(request_ids: Sequence[str]) -> None:
        seen.append(list(request_ids))
        bad = engine.scheduler.get("bad")
        if "bad" in request_ids and bad is not None and len(bad.output_token_ids) >= fail_after:
            raise InjectedFault("boom")

    engine.fault_hook = hook
    for rid in ["a", "b", "c", "bad"]:
        engine.add_request(PROMPTS[rid], GREEDY, request_id=rid)
    outs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                assert out.request_id == "bad"
                # its blocks are back the moment it fails, while the others still run
                assert not any("bad" in owners for owners in engine.kv.block_owners().values())
                assert engine.scheduler.get("bad") is None
            if out.finished:
                outs[out.request_id] = out
    bad = outs["bad"]
    assert bad.finish_reason == FinishReason.ERROR and isinstance(bad.error, InjectedFault)
    assert bad.token_ids is not None and len(bad.token_ids) == fail_after
    assert any("bad" in s and len(s) == 4 for s in seen), "vacuous: the fault never hit a shared step"
    for rid in ["a", "b", "c"]:
        assert outs[rid].error is None and outs[rid].token_ids == alone[rid].token_ids, rid
        assert outs[rid].text == alone[rid].text and outs[rid].finish_reason == FinishReason.LENGTH
    assert engine.kv.stats().used_blocks == 0


def test_stream_raises_the_request_error(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()

    def hook(request_ids: Sequence[str]) -> None:
        raise InjectedFault("always")

    engine.fault_hook = hook
    with pytest.raises(InjectedFault):
        list(engine.stream(PROMPTS["a"], GREEDY))
    assert engine.kv.stats().used_blocks == 0 and not engine.has_unfinished_requests()
