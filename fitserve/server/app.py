"""The FastAPI app: OpenAI routes, health, metrics and the dashboard over one EngineLoop.

Request bodies are read by hand (with a size cap) and validated strictly, so every client
mistake becomes an OpenAI-style 4xx; FastAPI's own 422 is turned into 400 as well.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fitserve.server.engine_loop import EngineLoop
from fitserve.server.errors import APIError, error_body
from fitserve.server.protocol import (
    REJECTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from fitserve.server.responses import (
    ClientGone,
    Run,
    RunStreamingResponse,
    collect,
    stream_events,
    token_text_fn,
)
from fitserve.server.serving import ModelContext, Prepared, prepare_chat, prepare_completion

log = logging.getLogger("fitserve.server")
_M = TypeVar("_M", bound=BaseModel)


@dataclass(slots=True)
class ServerSettings:
    """Limits and identity of a server; the CLI fills these from its flags."""

    model_name: str = "smollm2-135m"
    api_key: str | None = None
    max_waiting: int = 256  # waiting + not-yet-admitted requests before new ones get 503
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1


class AppState:
    """Mutable server state shared by the routes (one per app)."""

    def __init__(self, engine_loop: EngineLoop, settings: ServerSettings) -> None:
        self.loop = engine_loop
        self.settings = settings
        self.draining = False
        self._ctx: ModelContext | None = None
        self.token_text: Callable[[int], str] = str  # replaced by the tokenizer's once loaded

    def context(self) -> ModelContext:
        if not self.loop.ready or self.loop.engine is None:
            raise APIError(503, "the model is still loading" if self.loop.alive else "the engine is not running",
                           headers={"Retry-After": "5"})
        if self._ctx is None:
            e = self.loop.engine
            self._ctx = ModelContext(self.settings.model_name, e.tokenizer, e.max_model_len,
                                     e.spec.vocab_size, int(self.loop.snapshot["time"]) if self.loop.snapshot else 0)
            self.token_text = token_text_fn(e.tokenizer)
        return self._ctx


def create_app(engine_loop: EngineLoop, settings: ServerSettings | None = None) -> FastAPI:
    """Build the app; the engine loop is started by the app's lifespan and stopped with it."""
    settings = settings or ServerSettings()
    state = AppState(engine_loop, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine_loop.alive and engine_loop.error is None:
            engine_loop.start()  # loads in the background: /health answers 503 meanwhile
        yield
        engine_loop.stop()

    app = FastAPI(title="fitserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.fitserve = state
    _install_error_handlers(app)

    def check_auth(request: Request) -> None:
        key = settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "Incorrect or missing API key", code="invalid_api_key")

    def check_capacity(children: int) -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        g = engine_loop.gauges
        waiting = (g.num_waiting if g else 0) + engine_loop.pending
        if waiting + children > settings.max_waiting:
            engine_loop.metrics.rejected.labels(status="503").inc()
            raise APIError(503, f"the server is overloaded ({waiting} requests waiting); retry later",
                           code="overloaded", headers={"Retry-After": str(settings.retry_after_s)})

    async def run(request: Request, prep: Prepared) -> Response:
        check_capacity(prep.num_choices)
        job = Run(engine_loop, prep)
        if prep.stream:
            return RunStreamingResponse(job, stream_events(job, state.token_text))
        try:
            return JSONResponse(await collect(job, request, state.token_text))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        body = await _parse(request, CompletionRequest, settings.max_body_bytes)
        return await run(request, prepare_completion(body, state.context()))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        body = await _parse(request, ChatCompletionRequest, settings.max_body_bytes)
        return await run(request, prepare_chat(body, state.context()))

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        ctx = state.context()
        card = ModelCard(id=ctx.name, created=ctx.created, max_model_len=ctx.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine_loop.ready:
            return JSONResponse({"status": "ok"})
        status = "loading" if engine_loop.alive else "dead"
        return JSONResponse({"status": status, "error": repr(engine_loop.error) if engine_loop.error else None},
                            status_code=503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = engine_loop.ready and not state.draining
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine_loop.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_asset("index.html"))

    @app.get("/dashboard/app.js")
    async def dashboard_js() -> Response:
        return Response(_asset("app.js"), media_type="text/javascript")

    @app.get("/dashboard/state")
    async def dashboard_state() -> JSONResponse:
        snap = engine_loop.snapshot or {}
        return JSONResponse({**snap, "model": settings.model_name, "ready": engine_loop.ready,
                             "draining": state.draining, "history": engine_loop.metrics.history()})

    return app


def _asset(name: str) -> str:
    return resources.files("fitserve.server").joinpath("dashboard", name).read_text(encoding="utf-8")


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, model: type[_M], limit: int) -> _M:
    raw = await _read_body(request, limit)
    try:
        data = json.loads(raw)
    except Exception:  # noqa: BLE001 - bad UTF-8, bad JSON, absurd nesting: all the client's
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    for name, why in REJECTED_FIELDS.items():
        if data.get(name) not in (None, [], {}):
            raise APIError(400, why, param=name, code="unsupported_parameter")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise APIError(400, _validation_message(exc), param=_validation_param(exc)) from None


def _validation_param(exc: ValidationError) -> str | None:
    errs = exc.errors()
    if not errs or not errs[0]["loc"]:
        return None
    return str(errs[0]["loc"][0])  # the top-level field; deeper parts name union members


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:3]:
        loc = ".".join(str(p) for p in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    return "invalid request: " + "; ".join(parts)


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

