"""Run a prepared request on the engine loop and shape its outputs as OpenAI responses.

Every path out of a request (finished, client gone, error, server shutdown) goes through
:meth:`Run.close`, which aborts whatever children are still unfinished, so no KV block can
outlive the HTTP request that asked for it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from fitserve.loading.tokenizer import Tokenizer
from fitserve.server.engine_loop import EngineLoop, EngineShutdown
from fitserve.server.errors import APIError
from fitserve.server.protocol import Usage, chat_body, completion_chunk
from fitserve.server.serving import Prepared
from fitserve.types import RequestOutput, TokenLogprobs


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


class Run:
    """One client request in flight: its children, their outputs queue, and its cleanup."""

    def __init__(self, loop: EngineLoop, prep: Prepared) -> None:
        self.engine_loop = loop
        self.prep = prep
        children = prep.children()
        self.children = children
        self.index = {c.request_id: k for k, c in enumerate(children)}
        self.finished: dict[str, RequestOutput] = {}
        self.queue: asyncio.Queue[list[RequestOutput] | BaseException] = asyncio.Queue()
        self._submitted = False
        self._closed = False

    def submit(self) -> None:
        aio = asyncio.get_running_loop()
        q = self.queue

        def sink(item: list[RequestOutput] | BaseException) -> None:
            aio.call_soon_threadsafe(q.put_nowait, item)

        self.engine_loop.submit(self.prep.group, self.children, self.prep.arrival, sink)
        self._submitted = True

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.children)

    async def next_outputs(self) -> list[RequestOutput]:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise as_api_error(item)
        for out in item:
            if out.finished:
                self.finished[out.request_id] = out
        return item

    def close(self) -> None:
        """Abort every unfinished child (idempotent)."""
        if self._submitted and not self._closed and not self.done:
            self.engine_loop.abort([c.request_id for c in self.children if c.request_id not in self.finished])
        self._closed = True

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.prep.prompts)
        completion = sum(len(o.token_ids) for o in self.finished.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineShutdown):
        return APIError(503, str(exc), headers={"Retry-After": "5"})
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}")


# -- logprobs -----------------------------------------------------------------------------------
def token_text_fn(tok: Tokenizer) -> Callable[[int], str]:
    @lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return tok.decode([token_id], skip_special_tokens=False)

    return text


def chat_logprobs(lps: list[TokenLogprobs], text: Callable[[int], str]) -> list[dict[str, Any]]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
            for t in lps]


def completion_logprobs(lps: list[TokenLogprobs], text: Callable[[int], str], offset: int) -> dict[str, Any]:
    tokens = [text(t.token_id) for t in lps]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [t.logprob for t in lps],
        "top_logprobs": [{text(i): lp for i, lp in t.top} for t in lps],
        "text_offset": offsets,
    }


# -- non-streaming ------------------------------------------------------------------------------
async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the next message the server sends is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(run: Run, request: Request, text: Callable[[int], str]) -> dict[str, Any]:
    """Wait for every child; abort them all if the client leaves first."""
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        run.submit()
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
    choices = []
    for child in run.children:
        out = run.finished[child.request_id]
        k = run.index[child.request_id]
        reason = out.finish_reason.value if out.finish_reason else None
        lps = out.logprobs if prep.params.logprobs is not None else None
        if prep.chat:
            choices.append({
                "index": k, "message": {"role": "assistant", "content": out.text},
                "logprobs": {"content": chat_logprobs(lps, text)} if lps is not None else None,
                "finish_reason": reason, "stop_reason": out.stop_reason,
            })
        else:
            choices.append({
                "index": k, "text": out.text,
                "logprobs": completion_logprobs(lps, text, 0) if lps is not None else None,
                "finish_reason": reason, "stop_reason": out.stop_reason,
            })
    if prep.chat:
        return chat_body(prep.group, prep.created, prep.model, choices, chunk=False, usage=run.usage())
    return completion_chunk(prep.group, prep.created, prep.model, choices, usage=run.usage())


# -- streaming ----------------------------------------------------------------------------------
def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


async def stream_events(run: Run, text: Callable[[int], str]) -> AsyncIterator[str]:
    """SSE events: one chunk per choice per step with new text, usage if asked, then [DONE]."""
    prep = run.prep
    sent_lp = dict.fromkeys(run.index, 0)
    sent_chars = dict.fromkeys(run.index, 0)

    def body(choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        if prep.chat:
            return chat_body(prep.group, prep.created, prep.model, choices, chunk=True, usage=usage)
        return completion_chunk(prep.group, prep.created, prep.model, choices, usage=usage)

    try:
        run.submit()
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
                new_lps = None
                if out.logprobs is not None and prep.params.logprobs is not None:
                    new_lps = out.logprobs[sent_lp[rid]:]
                if not out.delta_text and not out.finished:
                    continue  # held back (a possible stop string): its logprobs go with the next chunk
                reason = out.finish_reason.value if out.finished and out.finish_reason else None
                k = run.index[rid]
                if prep.chat:
                    choice: dict[str, Any] = {
                        "index": k, "delta": {"content": out.delta_text} if out.delta_text else {},
                        "logprobs": {"content": chat_logprobs(new_lps, text)} if new_lps is not None else None,
                    }
                else:
                    choice = {
                        "index": k, "text": out.delta_text,
                        "logprobs": completion_logprobs(new_lps, text, sent_chars[rid]) if new_lps is not None else None,
                    }
                choice["finish_reason"] = reason
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                choices.append(choice)
                sent_lp[rid] = len(out.logprobs or [])
                sent_chars[rid] += len(out.delta_text)
            if choices:
                yield _sse(body(choices))
        if prep.include_usage:
            yield _sse(body([], usage=run.usage()))
        yield _sse("[DONE]")
    finally:
        run.close()


class RunStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its run however the response ends (disconnects too)."""

    def __init__(self, run: Run, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # NOTE: on a disconnect Starlette cancels the body iterator wherever it is (maybe
            # suspended at a yield, where its own finally would wait for garbage collection).
            self.run.close()
