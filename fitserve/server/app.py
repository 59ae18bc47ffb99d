"""The FastAPI app: OpenAI routes, vLLM's /tokenize and /detokenize, health, metrics and the
dashboard (``fitserve.server.routers``) over one EngineLoop.

Request bodies are read by hand (with a size cap) and validated strictly
(``fitserve.server.request_body``), so every client mistake becomes an OpenAI-style 4xx;
FastAPI's own 422 is turned into 400 as well. Which routes need the API key is declared on the
routers (``fitserve.server.auth``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fitserve import envs
from fitserve.server.engine_loop import EngineLoop
from fitserve.server.errors import APIError, error_body
from fitserve.server.routers import dashboard, openai, ops, tokenize
from fitserve.server.settings import ServerSettings
from fitserve.server.stat_logger import AccessLogMiddleware, ThroughputLogger
from fitserve.server.state import AppState

log = logging.getLogger("fitserve.server")


def create_app(engine_loop: EngineLoop, settings: ServerSettings | None = None) -> FastAPI:
    """Build the app; the engine loop is started by the app's lifespan and stopped with it."""
    settings = settings or ServerSettings()

    engine_loop.metrics.vllm.bind(settings.model_name)  # the model_name label of vllm:* series
    stats = ThroughputLogger(engine_loop.metrics, lambda: engine_loop.gauges)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine_loop.alive and engine_loop.error is None:
            engine_loop.start()  # loads in the background: /health answers 503 meanwhile
        interval = envs.FITSERVE_LOG_STATS_INTERVAL()
        task = asyncio.create_task(stats.run(interval)) if interval > 0 else None
        yield
        if task is not None:
            task.cancel()
        engine_loop.stop()

    # openapi_url=None: FastAPI's own document would show no bodies (read by hand); see /openapi.json
    app = FastAPI(title="fitserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.fitserve = AppState(engine_loop, settings)
    _install_error_handlers(app)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    for module in (openai, tokenize, ops, dashboard):
        app.include_router(module.router)
    app.add_middleware(AccessLogMiddleware)  # outermost: sees every response, errors included
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, f"invalid request: {exc.errors()[:3]}"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
