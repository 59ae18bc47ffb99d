"""/health while the model loads and after the engine fails, without loading a model."""

from __future__ import annotations

import asyncio
import threading

import httpx

from fitserve.config import EngineConfig
from fitserve.server.app import create_app
from fitserve.server.engine_loop import EngineLoop
from fitserve.server.metrics import Metrics
from fitserve.server.settings import ServerSettings


def test_health_is_503_while_loading_and_when_the_engine_is_dead() -> None:
    release = threading.Event()

    def slow_failing_load(_cfg: EngineConfig) -> object:
        release.wait(30)
        raise RuntimeError("weights are corrupt")

    loop = EngineLoop(EngineConfig(), Metrics(), engine_factory=slow_failing_load)  # type: ignore[arg-type]
    app = create_app(loop, ServerSettings())

    async def scenario() -> None:
        loop.start()  # what the lifespan does
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            assert (await c.get("/ready")).status_code == 503
            r = await c.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
            assert "retry-after" in r.headers
            release.set()
            await asyncio.to_thread(loop.wait_ready, 30)
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "dead"
            assert "corrupt" in r.json()["error"]
            assert (await c.post("/v1/chat/completions", json={"messages": []})).status_code == 503
            assert (await c.get("/metrics")).status_code == 200

    asyncio.run(scenario())
