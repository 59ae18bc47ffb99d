"""One replica: a whole fitserve server (EngineLoop + the FastAPI app of ``fitserve serve``) in a
Ray Serve replica, driven in-process over ASGI so every route, stream, auth check and metric is
the single server's own.

::

    ingress --FleetRequest--> FitserveReplica.forward --ASGI scope--> fitserve app --> EngineLoop
            <--ResponseHead, body chunks... (a streaming generator) <--send()--
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from fitserve.fleet.request import FleetRequest, ResponseHead
from fitserve.fleet.spec import ReplicaSpec

log = logging.getLogger("fitserve.fleet")


class FitserveReplica:
    """The engine and app of one replica; Ray Serve wraps it with ``serve.deployment``."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from fitserve.server.app import create_app
        from fitserve.server.engine_loop import EngineLoop
        from fitserve.server.metrics import Metrics

        self.spec = spec
        if spec.pull_default:
            from fitserve.loading.pull import pull

            pull(spec.config.model, progress=False)
        self.loop = EngineLoop(spec.config, Metrics(), engine_factory=self._load, warm_up=spec.warm_up)
        self.app = create_app(self.loop, spec.settings)
        self.loop.start()  # NOTE: not the app's lifespan: nothing runs it in-process
        if not self.loop.wait_ready():
            raise RuntimeError(f"the engine failed to load {spec.config.model}: {self.loop.error}")
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        log.info("replica %s ready: %d torch threads, %.3g capacity units", self.replica_id,
                 spec.threads, spec.capacity_units)

    def _load(self, config: Any) -> Any:
        import torch

        from fitserve.engine.core import Engine

        torch.set_num_threads(self.spec.threads)  # here, in the engine thread: OpenMP's count is per thread
        engine = Engine(config)
        if self.spec.chat_template is not None:
            engine.tokenizer.chat_template = self.spec.chat_template
        return engine

    async def forward(self, req: FleetRequest) -> AsyncIterator[ResponseHead | bytes]:
        """Run one HTTP request through the app: the response head, then its body chunks."""
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_given = False

        async def receive() -> dict[str, Any]:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await disconnected.wait()  # the app's disconnect watch: set when the ingress goes away
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await out.put(message)

        task = asyncio.create_task(self.app(_scope(req), receive, send))
        task.add_done_callback(lambda _t: out.put_nowait(None))
        try:
            while (msg := await out.get()) is not None:
                if msg["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", [])]
                    yield ResponseHead(int(msg["status"]), headers, self.replica_id, os.getpid())
                elif msg["type"] == "http.response.body" and msg.get("body"):
                    yield bytes(msg["body"])
            task.result()  # an app that raised: the ingress sees it
        finally:
            disconnected.set()  # a cancelled stream (client gone) aborts its engine requests
            if not task.done():
                await asyncio.wait([task], timeout=5)

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router weighs this replica by (Serve polls it; see FleetRouter)."""
        g = self.loop.gauges
        stats: dict[str, Any] = {"capacity": self.spec.capacity_units, "pid": os.getpid(),
                                 "threads": self.spec.threads, "generation": self.spec.generation}
        if g is not None:
            kv = g.kv
            stats.update(running=g.num_running, waiting=g.num_waiting,
                         kv_usage=kv.used_blocks / kv.num_blocks if kv.num_blocks else 0.0,
                         prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits)
        return stats

    def check_health(self) -> None:
        """Serve's health check: a dead engine thread makes Serve replace this replica."""
        if not self.loop.ready:
            raise RuntimeError(f"engine not running: {self.loop.error}")

    def __del__(self) -> None:
        """Serve calls this once the replica is drained (a rolling update, a scale-down, the
        fleet's shutdown): Serve sent it nothing new and waited for its running requests."""
        app = getattr(self, "app", None)
        if app is not None:
            app.state.fitserve.draining = True  # a straggler gets 503 (the ingress retries it)
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()


def _scope(req: FleetRequest) -> dict[str, Any]:
    path = req.path if req.path.startswith("/") else "/" + req.path
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": req.method, "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": req.query.encode(), "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req.headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }
