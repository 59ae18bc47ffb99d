"""Run a prepared request on the engine loop and shape its outputs as OpenAI responses.

Every path out of a request (finished, client gone, error, server shutdown) goes through
:meth:`Run.close`, which aborts whatever children are still unfinished, so no KV block can
outlive the HTTP request that asked for it.

Outputs reach a request through an :class:`OutputMailbox`: the engine thread merges each step's
deltas into one pending entry per child, so a slow reader (a client that does not read its
stream) holds at most one entry per child and one scheduled wake-up, however far behind it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from fitserve.sched.slo import AdmissionRejected
from fitserve.server.choices import ChoiceText, chat_logprobs, completion_logprobs
from fitserve.server.engine_loop import EngineLoop, EngineShutdown, EngineStepError, RequestRejected
from fitserve.server.errors import APIError
from fitserve.server.protocol import PromptTokensDetails, Usage, chat_body, completion_chunk
from fitserve.server.serving import Prepared
from fitserve.types import RequestOutput, TokenLogprobs

log = logging.getLogger("fitserve.server")


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


@dataclass(slots=True)
class _Pending:
    """One child's outputs not yet read, merged: deltas concatenated, the newest of the rest."""

    last: RequestOutput
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None

    def add(self, out: RequestOutput) -> None:
        self.last = out
        self.token_ids.extend(out.delta_token_ids)
        self.text.append(out.delta_text)
        if out.delta_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(out.delta_logprobs)

    def merged(self) -> RequestOutput:
        out = self.last
        if len(self.text) == 1:
            return out  # the common case: the reader kept up
        out.delta_token_ids = self.token_ids
        out.delta_text = "".join(self.text)
        out.delta_logprobs = self.logprobs
        return out


class OutputMailbox:
    """Hands a request's outputs from the engine thread to its asyncio reader, coalescing.

    ``put`` (engine thread) merges a step's outputs into one pending entry per child and
    schedules at most one wake-up on the event loop; ``get`` (event loop) takes everything
    pending. The backlog is therefore bounded by the number of children, not by how many steps
    a slow reader is behind; what it holds is only the unread tokens and text themselves.
    An error is raised by ``get`` once the outputs that came before it have been read.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._error: BaseException | None = None
        self._wake_scheduled = False
        self._event = asyncio.Event()

    def __len__(self) -> int:
        """Entries waiting to be read (at most one per child, plus one error)."""
        with self._lock:
            return len(self._pending) + (self._error is not None)

    @property
    def wake_scheduled(self) -> bool:
        """Whether a wake-up callback is queued on the event loop (never more than one)."""
        return self._wake_scheduled

    def put(self, item: list[RequestOutput] | BaseException) -> None:
        """Engine thread: add one step's outputs for this request (or the error that ended it)."""
        with self._lock:
            if isinstance(item, BaseException):
                self._error = self._error or item
            else:
                for out in item:
                    entry = self._pending.get(out.request_id)
                    if entry is None:
                        entry = self._pending[out.request_id] = _Pending(out)
                    entry.add(out)
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        self._event.set()

    async def get(self) -> list[RequestOutput]:
        """Wait for outputs; return everything pending, one merged output per child."""
        while True:
            with self._lock:
                if self._pending:
                    entries, self._pending = self._pending, {}
                    return [e.merged() for e in entries.values()]
                if self._error is not None:
                    raise self._error
                self._event.clear()
            await self._event.wait()


class Run:
    """One client request in flight: its children, their outputs mailbox, and its cleanup."""

    def __init__(self, loop: EngineLoop, prep: Prepared) -> None:
        self.engine_loop = loop
        self.prep = prep
        children = prep.children()
        self.children = children
        # a child's first choice index: i * n + j for sample j of prompt i, i * n for the beam
        # search of prompt i (its beams are choices i * n .. i * n + n - 1)
        per_child = prep.n if prep.beam is not None else 1
        self.index = {c.request_id: k * per_child for k, c in enumerate(children)}
        self.finished: dict[str, RequestOutput] = {}
        self.mailbox: OutputMailbox | None = None
        self._added: asyncio.Future[BaseException | None] | None = None
        self._submitted = False
        self._closed = False

    def submit(self, max_queued: int | None = None) -> bool:
        """Hand the children to the engine; False (nothing queued) if over ``max_queued``."""
        loop = asyncio.get_running_loop()
        self.mailbox = OutputMailbox(loop)
        self._added = added = loop.create_future()

        def on_added(outcome: BaseException | None) -> None:  # engine thread
            loop.call_soon_threadsafe(_settle, added, outcome)

        ok = self.engine_loop.submit(self.prep.group, self.children, self.prep.arrival,
                                     self.mailbox.put, max_queued, on_added)
        self._submitted = ok
        return ok

    async def added(self) -> None:
        """Wait until the engine has queued the children; raise the APIError if it refused
        them (a 400 for a bad request, a 429 when the slo policy turns it away)."""
        assert self._added is not None, "submit() first"
        outcome = await self._added
        if outcome is not None:
            raise as_api_error(outcome)

    @property
    def backlog(self) -> int:
        """Output entries delivered but not read yet (bounded by the number of children)."""
        return len(self.mailbox) if self.mailbox is not None else 0

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.children)

    async def next_outputs(self) -> list[RequestOutput]:
        """The next outputs (one merged output per child with news); raises APIError on failure."""
        assert self.mailbox is not None, "submit() first"
        try:
            outputs = await self.mailbox.get()
        except BaseException as exc:  # noqa: BLE001 - every engine-side failure becomes an APIError
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise as_api_error(exc) from None
        for out in outputs:
            if out.error is not None:
                # NOTE: the engine loop logged the traceback (the client gets only the type);
                # one failed child fails the whole group.
                raise APIError(500, f"internal error: {type(out.error).__name__} (see the server log)")
            if out.finished:
                self.finished[out.request_id] = out
        return outputs

    def close(self) -> None:
        """Abort every unfinished child (idempotent)."""
        if self._submitted and not self._closed and not self.done:
            self.engine_loop.abort([c.request_id for c in self.children if c.request_id not in self.finished])
        self._closed = True

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.prep.prompts)
        completion = sum(sum(len(b.token_ids) for b in o.beams) if o.beams is not None else o.num_output_tokens
                         for o in self.finished.values())
        # each prompt counts once (as prompt_tokens): its first child's cache hits
        n = self.prep.n
        cached = sum(o.num_cached_tokens for rid, o in self.finished.items() if self.index[rid] % n == 0)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _settle(fut: asyncio.Future[BaseException | None], outcome: BaseException | None) -> None:
    if not fut.done():
        fut.set_result(outcome)


def as_api_error(exc: BaseException) -> APIError:
    """Client mistakes (RequestRejected) are 400, a shutdown 503, everything else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineShutdown):
        return APIError(503, str(exc), headers={"Retry-After": "5"})
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc))
    if isinstance(exc, AdmissionRejected):
        return APIError(429, str(exc), code="slo_ttft_unreachable",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}")


# -- non-streaming ------------------------------------------------------------------------------
async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the next message the server sends is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(run: Run, request: Request, text: Callable[[int], str]) -> dict[str, Any]:
    """Wait for every child of a submitted run; abort them all if the client leaves first."""
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        while not run.done:
            getter = asyncio.ensure_future(run.next_outputs())
            done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                raise ClientGone()
            getter.result()
    finally:
        watcher.cancel()
        run.close()
    prep = run.prep
    choices: list[dict[str, Any]] = []
    for child in run.children:
        out = run.finished[child.request_id]
        k = run.index[child.request_id]
        if out.beams is not None:
            choices += [_choice(prep, k + j, b.text, None, b.finish_reason.value, b.stop_reason)
                        for j, b in enumerate(out.beams)]
            continue
        reason = out.finish_reason.value if out.finish_reason else None
        lps = out.logprobs if prep.params.logprobs is not None else None
        if prep.chat:
            lp_body = {"content": chat_logprobs(lps, text)} if lps is not None else None
        else:
            lp_body = completion_logprobs(lps, text, 0) if lps is not None else None
        choices.append(_choice(prep, k, out.text or "", lp_body, reason, out.stop_reason))
    if prep.chat:
        return chat_body(prep.group, prep.created, prep.model, choices, chunk=False, usage=run.usage())
    return completion_chunk(prep.group, prep.created, prep.model, choices, usage=run.usage())


def _choice(prep: Prepared, index: int, text: str, logprobs: Any, reason: str | None,
            stop_reason: str | int | None) -> dict[str, Any]:
    """A finished choice of a response body (its echo prepended, its tool calls parsed out)."""
    shaped = ChoiceText(prep, index)
    content, calls = shaped.whole(text)
    if prep.chat:
        return {"index": index, "message": {"role": "assistant", "content": content, "tool_calls": calls},
                "logprobs": logprobs, "finish_reason": shaped.finish_reason(reason), "stop_reason": stop_reason}
    return {"index": index, "text": content or "", "logprobs": logprobs, "finish_reason": reason,
            "stop_reason": stop_reason}


# -- streaming ----------------------------------------------------------------------------------
def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


async def stream_events(run: Run, text: Callable[[int], str]) -> AsyncIterator[str]:
    """SSE events of a submitted run: one chunk per choice per read with new text, usage if
    asked, then [DONE]. A reader that falls behind gets the steps it missed merged."""
    prep = run.prep
    want_lps = prep.params.logprobs is not None
    carry_lps: dict[str, list[TokenLogprobs]] = {rid: [] for rid in run.index}
    sent_chars = dict.fromkeys(run.index, 0)
    shaped = {rid: ChoiceText(prep, k) for rid, k in run.index.items()}  # echo, tool calls

    def body(choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        if prep.chat:
            return chat_body(prep.group, prep.created, prep.model, choices, chunk=True, usage=usage)
        return completion_chunk(prep.group, prep.created, prep.model, choices, usage=usage)

    try:
        if prep.chat:  # the role comes first, as OpenAI sends it
            yield _sse(body([{"index": k, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None} for k in range(prep.num_choices)]))
        while not run.done:
            try:
                outputs = await run.next_outputs()
            except APIError as err:
                yield _sse(err.body())
                return
            choices = []
            for out in outputs:
                rid = out.request_id
                if want_lps and out.delta_logprobs:
                    carry_lps[rid].extend(out.delta_logprobs)
                content, calls = shaped[rid].stream(out.delta_text, out.finished)
                if not content and not calls and not out.finished:
                    continue  # held back (a possible stop string or tool call): its logprobs go later
                new_lps = carry_lps[rid] if want_lps else None
                carry_lps[rid] = []
                reason = out.finish_reason.value if out.finished and out.finish_reason else None
                k = run.index[rid]
                if prep.chat:
                    delta: dict[str, Any] = {"content": content} if content else {}
                    if calls:
                        delta["tool_calls"] = calls
                    choice: dict[str, Any] = {
                        "index": k, "delta": delta,
                        "logprobs": {"content": chat_logprobs(new_lps, text)} if new_lps is not None else None,
                    }
                    reason = shaped[rid].finish_reason(reason)
                else:
                    choice = {
                        "index": k, "text": content,
                        "logprobs": completion_logprobs(new_lps, text, sent_chars[rid]) if new_lps is not None else None,
                    }
                choice["finish_reason"] = reason
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                choices.append(choice)
                sent_chars[rid] += len(content)
            if choices:
                yield _sse(body(choices))
        if prep.include_usage:
            yield _sse(body([], usage=run.usage()))
        yield _sse("[DONE]")
    finally:
        run.close()


class StreamStalled(Exception):
    """The client stopped reading its stream: one write waited longer than the send timeout."""


class RunStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its run however the response ends (disconnects too).

    A client that stops reading is a slow reader, not a disconnect: once the socket's buffers
    are full, a write waits. A write that waits ``send_timeout_s`` ends the response and aborts
    the request (its KV blocks come back); the unread output the server holds meanwhile is
    bounded by the mailbox (one entry per child) and the capped socket buffers.
    """

    def __init__(self, run: Run, content: AsyncIterator[str], send_timeout_s: float | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.send_timeout_s

        async def guarded_send(message: Message) -> None:
            if timeout is None:
                await send(message)
                return
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                raise StreamStalled() from None

        try:
            await super().__call__(scope, receive, guarded_send)
        except StreamStalled:
            log.warning("stream %s: the client read nothing for %.0f s; aborting the request",
                        self.run.prep.group, timeout)
        finally:
            # NOTE: on a disconnect Starlette cancels the body iterator wherever it is (maybe
            # suspended at a yield, where its own finally would wait for garbage collection).
            self.run.close()
