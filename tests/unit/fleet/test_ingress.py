"""The ingress's retries and stream ending, against scripted replicas (no Ray cluster): a 429 or
503 goes to another replica with the refuser excluded, a replica that dies before answering is
retried, a stream whose replica dies mid-way ends with an OpenAI error event, and when every
attempt is refused the client gets the last refusal."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

exceptions = pytest.importorskip("ray.exceptions", reason="the fitserve[ray] extra is not installed")
from starlette.requests import Request  # noqa: E402

from fitserve.fleet.ingress import FleetIngress  # noqa: E402
from fitserve.fleet.request import FleetRequest, ResponseHead  # noqa: E402

DIES = object()
SSE = [("content-type", "text/event-stream")]
JSON = [("content-type", "application/json")]


class Scripted:
    """One replica answer: items to yield (ResponseHead, bytes, or DIES to raise ActorDiedError)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._gen()

    async def __anext__(self) -> Any:
        if not hasattr(self, "_it"):
            self._it = self._gen()
        return await self._it.__anext__()

    async def _gen(self) -> AsyncIterator[Any]:
        for item in self.items:
            if item is DIES:
                raise exceptions.ActorDiedError()
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """A DeploymentHandle stand-in: each forward.remote(req) gets the next scripted answer."""

    def __init__(self, answers: list[list[Any]]) -> None:
        self.answers = answers
        self.sent: list[FleetRequest] = []

    def options(self, **_: Any) -> Handle:
        return self

    @property
    def forward(self) -> Handle:
        return self

    def remote(self, req: FleetRequest) -> Scripted:
        self.sent.append(FleetRequest(req.method, req.path, prompt=req.prompt, exclude=req.exclude))
        return Scripted(self.answers.pop(0))


def head(status: int, replica: str, headers: list[tuple[str, str]] = JSON) -> ResponseHead:
    return ResponseHead(status, headers, replica, 1)


def call(handle: Handle, body: dict[str, Any]) -> tuple[int, bytes]:
    async def run() -> tuple[int, bytes]:
        raw = json.dumps(body).encode()
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")]}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": raw, "more_body": False}

        ingress = FleetIngress([("g", handle, 1.0)], max_retries=2)
        resp = await ingress(Request(scope, receive))
        if hasattr(resp, "body_iterator"):
            return resp.status_code, b"".join([c async for c in resp.body_iterator])
        return resp.status_code, resp.body

    return asyncio.run(run())


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_a_429_is_retried_on_another_replica() -> None:
    handle = Handle([[head(429, "A"), b'{"error": 1}'], [head(200, "B"), b'{"ok": 1}']])
    assert call(handle, CHAT) == (200, b'{"ok": 1}')
    assert [r.exclude for r in handle.sent] == [(), ("A",)]
    assert handle.sent[0].prompt == "<user>hi\n"


def test_a_replica_dying_before_it_answers_is_retried() -> None:
    handle = Handle([[DIES], [head(200, "B"), b"{}"]])
    assert call(handle, CHAT) == (200, b"{}")
    handle = Handle([[head(200, "A"), DIES], [head(200, "B"), b'{"whole": 1}']])  # died mid-body
    assert call(handle, CHAT) == (200, b'{"whole": 1}')


def test_a_stream_whose_replica_dies_ends_with_an_error_event() -> None:
    handle = Handle([[head(200, "A", SSE), b"data: {}\n\n", DIES]])
    status, body = call(handle, {**CHAT, "stream": True})
    assert status == 200
    first, last = body.split(b"\n\n")[0], body.split(b"\n\n")[-2]
    assert first == b"data: {}"
    assert "replica serving this stream failed" in json.loads(last.removeprefix(b"data: "))["error"]["message"]


def test_when_every_attempt_is_refused_the_last_refusal_is_returned() -> None:
    handle = Handle([[head(503, "A"), b"a"], [head(429, "B"), b"b"], [head(429, "A"), b"c"]])
    assert call(handle, CHAT) == (429, b"c")
    assert [r.exclude for r in handle.sent] == [(), ("A",), ("A", "B")]
