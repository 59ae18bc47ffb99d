"""A prepared request in flight on the engine loop (:class:`Run`), and how its outputs reach it.

Every path out of a request (finished, client gone, error, server shutdown) goes through
:meth:`Run.close`, which aborts whatever children are still unfinished, so no KV block can
outlive the HTTP request that asked for it.

Outputs reach a request through an :class:`OutputMailbox`: the engine thread merges each step's
deltas into one pending entry per child, so a slow reader (a client that does not read its
stream) holds at most one entry per child and one scheduled wake-up, however far behind it is.
How the outputs are written to the client is ``fitserve.server.streaming``.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from fitserve.sched.slo import AdmissionRejected
from fitserve.server.engine_loop import EngineLoop, EngineShutdown, EngineStepError, RequestRejected
from fitserve.server.errors import APIError
from fitserve.server.protocol.common import PromptTokensDetails, Usage
from fitserve.server.serving import Prepared
from fitserve.types import RequestOutput, TokenLogprobs


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


@dataclass(slots=True)
class _Pending:
    """One child's outputs not yet read, merged: deltas concatenated, the newest of the rest."""

    last: RequestOutput
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # the first output's, kept

    def add(self, out: RequestOutput) -> None:
        self.last = out
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
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
        out.prompt_logprobs = self.prompt_logprobs
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
        if self.prep.echo_only:  # max_tokens 0: the one token the engine made is not returned
            completion = 0
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
