"""A run's outputs written as OpenAI responses: server-sent events while it runs
(:func:`stream_events`, sent by :class:`RunStreamingResponse`), or one body once it has
finished (:func:`collect`); vLLM's stream and full generators of ``serving_chat.py`` /
``serving_completion.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from fitserve.server.choices import (
    ChoiceText,
    chat_logprobs,
    completion_choice_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    vllm_prompt_logprobs,
)
from fitserve.server.errors import APIError
from fitserve.server.inflight import ClientGone, Run
from fitserve.server.protocol.chat import chat_body
from fitserve.server.protocol.common import Usage
from fitserve.server.protocol.completions import completion_chunk
from fitserve.server.serving import Prepared
from fitserve.types import TokenLogprobs

log = logging.getLogger("fitserve.server")


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
            lp_body = completion_choice_logprobs(prep, out, text)
        choices.append(_choice(prep, k, out.text or "", lp_body, reason, out.stop_reason))
        if not prep.chat:
            choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs, prep.prompt_logprobs, text)
    if prep.chat:
        first = run.finished[run.children[0].request_id]  # one prompt: every choice's is the same
        return chat_body(prep.group, prep.created, prep.model, choices, chunk=False, usage=run.usage(),
                         prompt_logprobs=vllm_prompt_logprobs(first.prompt_logprobs, prep.prompt_logprobs, text))
    return completion_chunk(prep.group, prep.created, prep.model, choices, usage=run.usage())


def _choice(prep: Prepared, index: int, text: str, logprobs: Any, reason: str | None,
            stop_reason: str | int | None) -> dict[str, Any]:
    """A finished choice of a response body (its echo prepended, its tool calls parsed out)."""
    shaped = ChoiceText(prep, index)
    message = shaped.whole(text)
    if prep.chat:
        return {"index": index, "message": {"role": "assistant", **message},
                "logprobs": logprobs, "finish_reason": shaped.finish_reason(reason), "stop_reason": stop_reason}
    return {"index": index, "text": message["content"] or "", "logprobs": logprobs, "finish_reason": reason,
            "stop_reason": stop_reason, "prompt_logprobs": None}


# -- streaming ----------------------------------------------------------------------------------
def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


async def stream_events(run: Run, text: Callable[[int], str]) -> AsyncIterator[str]:
    """SSE events of a submitted run: one chunk per choice per read with new text, usage if
    asked, then [DONE]. A reader that falls behind gets the steps it missed merged."""
    prep = run.prep
    want_lps = prep.params.logprobs is not None
    carry_lps: dict[str, list[TokenLogprobs]] = {rid: [] for rid in run.index}
    # echo with logprobs: the prompt's logprobs go first, in a choice's first chunk, after the
    # prompt's first token (null logprob, held in echo_head until that chunk is sent);
    # echo_pending: the choices whose prompt logprobs have not come yet
    echo_head: dict[str, int] = {}
    echo_pending = set(run.index) if want_lps and prep.echo is not None else set()
    sent_chars = dict.fromkeys(run.index, 0)
    shaped = {rid: ChoiceText(prep, k) for rid, k in run.index.items()}  # echo, reasoning, tool calls

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
                if rid in echo_pending and out.prompt_logprobs is not None:
                    echo_pending.discard(rid)
                    carry_lps[rid][:0] = echoed_prompt_logprobs(out.prompt_logprobs, prep.params.logprobs or 0)
                    echo_head[rid] = out.prompt_token_ids[0]
                if want_lps and out.delta_logprobs and not prep.echo_only:
                    carry_lps[rid].extend(out.delta_logprobs)
                piece = shaped[rid].stream(out.delta_text, out.finished)
                content = piece.content
                if not piece and not out.finished:
                    continue  # held back (a possible stop string or tool call): its logprobs go later
                new_lps = carry_lps[rid] if want_lps else None
                carry_lps[rid] = []
                reason = out.finish_reason.value if out.finished and out.finish_reason else None
                k = run.index[rid]
                if prep.chat:
                    delta: dict[str, Any] = {}
                    if piece.reasoning:  # vLLM's field, and current vLLM's name for it
                        delta["reasoning_content"] = delta["reasoning"] = piece.reasoning
                    if content:
                        delta["content"] = content
                    if piece.calls:
                        delta["tool_calls"] = piece.calls
                    choice: dict[str, Any] = {
                        "index": k, "delta": delta,
                        "logprobs": {"content": chat_logprobs(new_lps, text)} if new_lps is not None else None,
                    }
                    reason = shaped[rid].finish_reason(reason)
                else:
                    choice = {
                        "index": k, "text": content,
                        "logprobs": completion_logprobs(new_lps, text, sent_chars[rid], echo_head.pop(rid, None))
                        if new_lps is not None else None,
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
