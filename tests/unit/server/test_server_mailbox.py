"""A slow stream reader holds a bounded backlog: the engine thread's deltas are coalesced.

No model and no HTTP: a fake engine loop hands RequestOutputs to a real :class:`Run`, from a
thread, the way the engine thread does. The reference is the plain concatenation of every delta.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from fitserve.sampling import SamplingParams
from fitserve.server.engine_commands import Child
from fitserve.server.engine_loop import EngineShutdown, RequestRejected
from fitserve.server.errors import APIError
from fitserve.server.inflight import OutputMailbox, Run, as_api_error
from fitserve.server.serving import Prepared
from fitserve.server.streaming import stream_events
from fitserve.types import FinishReason, RequestOutput, TokenLogprobs

STEPS = 4000


def _out(rid: str, k: int, last: bool = False) -> RequestOutput:
    """Step k of request rid: token k, text 't{k} ', one logprob; the last one is final."""
    out = RequestOutput(rid, [1, 2, 3], [k], f"t{k} ", [TokenLogprobs(k, -1.0, 1, [])], last,
                        num_output_tokens=k + 1)
    if last:
        out.token_ids = list(range(k + 1))
        out.text = "".join(f"t{i} " for i in range(k + 1))
        out.finish_reason = FinishReason.LENGTH
    return out


class FakeEngineLoop:
    """What Run needs of an EngineLoop: submit() keeps the sink; abort() is recorded."""

    def __init__(self) -> None:
        self.sink: Callable[[list[RequestOutput] | BaseException], None] | None = None
        self.aborted: list[str] = []

    def submit(self, group: str, children: Sequence[Child], arrival: float, sink: Any,
               max_queued: int | None = None, on_added: Any = None) -> bool:
        self.sink = sink
        if on_added is not None:
            on_added(None)  # queued at once
        return True

    def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted.extend(request_ids)


def _prepared(n: int = 2) -> Prepared:
    return Prepared(group="cmpl-test", created=0, model="m", chat=False, prompts=[[1, 2, 3]],
                    params=SamplingParams(max_tokens=STEPS, logprobs=0), n=n, stream=True,
                    include_usage=True, arrival=0.0)


def _engine_thread(sink: Callable[[list[RequestOutput]], None], rids: list[str]) -> None:
    for k in range(STEPS):
        sink([_out(rid, k, last=k == STEPS - 1) for rid in rids])


def test_a_slow_reader_backlog_stays_bounded() -> None:
    async def scenario() -> None:
        engine_loop = FakeEngineLoop()
        run = Run(engine_loop, _prepared())  # type: ignore[arg-type]
        assert run.submit(max_queued=10) and engine_loop.sink is not None
        rids = [c.request_id for c in run.children]
        # The engine produces all 4,000 steps while the reader reads nothing (the event loop
        # keeps running meanwhile, as it does when a client just stops reading its socket).
        await asyncio.to_thread(_engine_thread, engine_loop.sink, rids)
        await asyncio.sleep(0)
        assert run.backlog <= len(rids), run.backlog  # one merged entry per child, not 4,000
        events = [e async for e in stream_events(run, str)]
        assert events[-1] == "data: [DONE]\n\n"
        bodies = [json.loads(e[6:]) for e in events[:-1]]
        text = {0: "", 1: ""}
        lps = {0: 0, 1: 0}
        for b in bodies:
            for c in b["choices"]:
                text[c["index"]] += c["text"]
                lps[c["index"]] += len(c["logprobs"]["tokens"])
        want = "".join(f"t{i} " for i in range(STEPS))
        assert text == {0: want, 1: want} and lps == {0: STEPS, 1: STEPS}
        assert len(bodies) <= 3, "the missed steps were coalesced into one chunk per child"
        assert bodies[-1]["usage"]["completion_tokens"] == 2 * STEPS
        assert engine_loop.aborted == []  # both finished: nothing to abort

    asyncio.run(scenario())


def test_a_blocked_event_loop_gets_one_wakeup() -> None:
    """Even with the event loop not running at all, the engine thread queues one callback."""

    class CountingLoop:
        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop, self.calls = loop, 0

        def call_soon_threadsafe(self, cb: Callable[[], None]) -> None:
            self.calls += 1
            self.loop.call_soon_threadsafe(cb)

    async def scenario() -> None:
        counting = CountingLoop(asyncio.get_running_loop())
        box = OutputMailbox(counting)  # type: ignore[arg-type]
        t = threading.Thread(target=_engine_thread, args=(box.put, ["a"]))
        t.start()
        t.join()  # blocks the event loop while all 4,000 steps arrive
        assert counting.calls == 1 and len(box) == 1 and box.wake_scheduled
        (out,) = await box.get()
        assert out.delta_token_ids == list(range(STEPS)) and out.finished
        assert out.delta_text == out.text and len(out.delta_logprobs or []) == STEPS
        box.put(EngineShutdown("bye"))
        with pytest.raises(EngineShutdown):
            await box.get()

    asyncio.run(scenario())


def test_error_mapping() -> None:
    assert as_api_error(RequestRejected("bad prompt")).status == 400
    assert as_api_error(ValueError("raised inside a step")).status == 500  # internal, not a 400
    assert as_api_error(RuntimeError("boom")).status == 500
    assert as_api_error(EngineShutdown("bye")).status == 503
    err = APIError(404, "x")
    assert as_api_error(err) is err
