"""The fleet's one HTTP ingress: forwards every route to a replica chosen by FleetRouter.

A replica that answers 429 (SLO admission) or 503 (queue full, loading) gets the request retried
on another; one that dies before any byte of the answer reached the client gets it retried too
(a non-streamed answer is read whole before it is sent, so that holds until its last byte). A
stream whose replica dies after it started ends with an OpenAI-style ``error`` event, never hangs.
``/metrics`` is every replica's, each sample labelled ``replica``; ``/fleet`` lists the replicas
as the router sees them. Admin routes (the API key's, as every route): ``POST /fleet/rollout``
asks ``fitserve serve --replicas`` for a rolling update (:mod:`fitserve.fleet.launch` redeploys;
Serve drains each replaced replica), ``POST /fleet/canary`` starts, advances or stops a canary
group's staged share (:mod:`fitserve.fleet.canary`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from fitserve.fleet.canary import canary_from_body
from fitserve.fleet.groups import GroupPicker
from fitserve.fleet.metrics_merge import merge_metrics
from fitserve.fleet.registry import router_of
from fitserve.fleet.request import FleetRequest, ResponseHead, routing_text
from fitserve.fleet.routing import ROUTING_MODES, RoutingPolicy
from fitserve.server.errors import error_body

log = logging.getLogger("fitserve.fleet")
_HOP_HEADERS = {"host", "transfer-encoding", "connection", "keep-alive"}
_RETRY_STATUS = (429, 503)


class FleetIngress:
    """The ingress deployment: Serve's HTTP proxy hands each request to ``__call__``."""

    def __init__(self, groups: list[tuple[str, DeploymentHandle, float]], api_key: str | None = None,
                 policy: RoutingPolicy | None = None, max_retries: int = 2, generation: int = 0,
                 canary: dict[str, Any] | None = None) -> None:
        """``groups``: (deployment name, its handle, its capacity units) per replica group."""
        self.handles = {name: handle for name, handle, _ in groups}
        self.picker = GroupPicker({name: units for name, _, units in groups}, policy or RoutingPolicy())
        self.api_key = api_key
        self.max_retries = max_retries
        self.generation = generation  # the replicas' rollout generation last asked for
        self._rollout = asyncio.Event()
        if canary is not None:
            self.picker.start_canary(canary_from_body(canary))

    async def __call__(self, request: Request) -> Response:
        """/fleet, /metrics, and every other path forwarded to a replica."""
        if request.method == "GET" and request.url.path == "/fleet":
            return await self.fleet(request)
        if request.method == "GET" and request.url.path == "/metrics":
            return await self.metrics(request)
        if request.url.path in ("/fleet/rollout", "/fleet/canary"):
            return await self.admin(request)
        return await self.proxy(request)

    async def admin(self, request: Request) -> Response:
        """POST /fleet/rollout: a rolling update of every replica (202; the launcher redeploys).
        POST /fleet/canary: {group, stages | plan, n_per_arm?} starts a canary's staged share,
        {"action": "advance"} moves to its next stage, {"action": "stop"} sends it nothing."""
        if (denied := self._denied(request)) is not None:
            return denied
        if request.method != "POST":
            return JSONResponse(error_body(405, f"{request.url.path} takes POST"), status_code=405)
        if request.url.path == "/fleet/rollout":
            return JSONResponse({"generation": self.rollout(), "status": "rolling"}, status_code=202)
        try:
            body = json.loads(await request.body() or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            action = body.get("action", "start")
            if action == "start":
                self.picker.start_canary(canary_from_body(body))
            elif self.picker.canary is None:
                raise ValueError("no canary is running")
            elif action == "advance":
                self.picker.canary.advance()
            elif action == "stop":
                self.picker.canary = None
            else:
                raise ValueError(f"'action' must be start, advance or stop, got {action!r}")
        except ValueError as exc:  # json's errors included
            return JSONResponse(error_body(400, str(exc)), status_code=400)
        canary = self.picker.canary
        return JSONResponse({"canary": None if canary is None else canary.describe()})

    def rollout(self) -> int:
        """Ask for a rolling update (POST /fleet/rollout, the launcher's SIGHUP): its generation."""
        self.generation += 1
        self._rollout.set()
        return self.generation

    async def take_rollout(self, wait_s: float = 1.0) -> int | None:
        """The launcher's long poll: the generation to roll out to, or None within ``wait_s``."""
        try:
            await asyncio.wait_for(self._rollout.wait(), wait_s)
        except TimeoutError:
            return None
        self._rollout.clear()
        return self.generation

    async def fleet(self, request: Request) -> Response:
        """The replicas as the router sees them: stats, in-flight requests, capacity, pid."""
        if (denied := self._denied(request)) is not None:
            return denied
        p = self.picker
        return JSONResponse({"groups": p.capacities, "group_in_flight": p.in_flight, "peak_load": p.peak_load,
                             "canary": None if p.canary is None else p.canary.describe(),
                             "generation": self.generation, "replicas": await self._replicas()})

    async def metrics(self, request: Request) -> Response:
        """Every replica's /metrics, each sample labelled with its replica."""
        texts: dict[str, str] = {}
        for rid in sorted(await self._replicas()):
            head, body = await self._collect(self._send(self._request(request, b"", pin=rid), _group_of(rid)))
            if head.status != 200:
                return Response(body, status_code=head.status, headers=_forwarded(head.headers))
            texts[rid.rsplit("#", 1)[-1]] = body.decode()
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def proxy(self, request: Request) -> Response:
        """Forward one request; retried elsewhere on 429/503 or a replica death before it started."""
        body = await request.body()
        req = self._request(request, body)
        if req.routing is not None and req.routing not in ROUTING_MODES:
            return JSONResponse(error_body(400, f"X-Fitserve-Routing must be one of {ROUTING_MODES}, "
                                                f"got {req.routing!r}"), status_code=400)
        failure: str = "no replica answered"
        order = self.picker.order(req.prompt, req.routing)
        for attempt in range(self.max_retries + 1):
            group = order[min(attempt, len(order) - 1)]  # a retry goes to the next group, if any
            gen = self._send(req, group)
            self.picker.started(group, req.prompt)
            try:
                head = await gen.__anext__()
                if head.status in _RETRY_STATUS and attempt < self.max_retries:
                    req.exclude = (*req.exclude, head.replica)
                    gen.cancel()
                    continue
                if _is_stream(head):
                    first = await anext(gen, b"")  # NOTE: a replica dying before the first byte: retried
                    return StreamingResponse(_stream(head, first, gen), status_code=head.status,
                                             headers=_forwarded(head.headers))
                head, content = await self._collect(gen, head)
                return Response(content, status_code=head.status, headers=_forwarded(head.headers))
            except RayError as exc:  # the replica died (or its actor failed) before answering
                failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                log.warning("request %s %s failed on a replica (attempt %d): %s", req.method, req.path,
                            attempt + 1, failure)
            finally:
                self.picker.finished(group)  # NOTE: a stream counts while its head is awaited
        return JSONResponse(error_body(503, f"no replica could serve the request ({failure})"),
                            status_code=503, headers={"Retry-After": "1"})

    def _request(self, request: Request, body: bytes, pin: str | None = None) -> FleetRequest:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS]
        return FleetRequest(request.method, request.url.path, request.url.query, headers, body,
                            prompt=routing_text(body), routing=request.headers.get("x-fitserve-routing"),
                            pin=pin)

    def _send(self, req: FleetRequest, group: str) -> DeploymentResponseGenerator:
        return self.handles[group].options(stream=True).forward.remote(req)

    @staticmethod
    async def _collect(gen: DeploymentResponseGenerator,
                       head: ResponseHead | None = None) -> tuple[ResponseHead, bytes]:
        parts: list[bytes] = []
        async for item in gen:
            if isinstance(item, ResponseHead):
                head = item
            else:
                parts.append(item)
        if head is None:
            raise RuntimeError("the replica answered without a response head")
        return head, b"".join(parts)

    async def _replicas(self) -> dict[str, dict[str, Any]]:
        """Every group's live replicas as its router sees them (a router is built by Serve on
        its handle's first request: /health is sent to a group that has none yet)."""
        out: dict[str, dict[str, Any]] = {}
        for group in self.handles:
            router = router_of(group)
            if router is None:
                await self._collect(self._send(FleetRequest("GET", "/health"), group))
                router = router_of(group)
            for _ in range(50):  # its replica list arrives from the controller shortly after
                if router is not None and router.curr_replicas:
                    break
                await asyncio.sleep(0.1)
            if router is not None:
                out.update({rid: {**stats, "group": group} for rid, stats in router.replicas().items()})
        return out

    def _denied(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return None
        return JSONResponse(error_body(401, "invalid or missing API key"), status_code=401)


def _group_of(replica: str) -> str:
    """The deployment of a full replica id ("SERVE_REPLICA::app#deployment#id")."""
    return replica.split("#")[-2]


def _is_stream(head: ResponseHead) -> bool:
    return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head.headers)


def _forwarded(headers: list[tuple[str, str]]) -> dict[str, str]:
    out = {k: v for k, v in headers if k.lower() not in _HOP_HEADERS and k.lower() != "content-length"}
    return out


async def _stream(head: ResponseHead, first: bytes, gen: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The stream's bytes; a replica lost mid-stream ends it with an error event."""
    yield first
    try:
        async for chunk in gen:
            if isinstance(chunk, bytes):
                yield chunk
    except RayError as exc:
        log.warning("replica %s failed mid-stream: %s", head.replica, type(exc).__name__)
        body = error_body(502, f"the replica serving this stream failed ({type(exc).__name__}); "
                               "the output so far is incomplete")
        yield f"data: {json.dumps(body)}\n\n".encode()
