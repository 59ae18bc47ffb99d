"""The FastAPI app: OpenAI routes, vLLM's /tokenize and /detokenize, health, metrics and the
dashboard over one EngineLoop.

Request bodies are read by hand (with a size cap) and validated strictly, so every client
mistake becomes an OpenAI-style 4xx; FastAPI's own 422 is turned into 400 as well.

Validation, tokenization and chat-template rendering run in a worker thread (Starlette's
thread pool), never on the event loop, so a 1 MiB prompt does not stall other streams.

With an API key set, every route but /health needs it: the /v1 API, /ready, /metrics (unless
``metrics_public``, for Prometheus scrapers) and the dashboard. The key is accepted as
``Authorization: Bearer KEY`` or as the password of HTTP Basic auth (what a browser sends for
the dashboard, which answers 401 with ``WWW-Authenticate: Basic`` so the browser asks for it).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from fitserve.loading.generation_defaults import (
    DefaultSampling,
)
from fitserve.server.choices import token_text_fn
from fitserve.server.engine_loop import EngineLoop
from fitserve.server.errors import APIError, error_body
from fitserve.server.openapi import build_openapi
from fitserve.server.protocol import (
    REJECTED_FIELDS,
    TOKENIZE_REJECTED_FIELDS,
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
)
from fitserve.server.serving import ModelContext, Prepared, prepare_chat, prepare_completion
from fitserve.server.settings import ServerSettings
from fitserve.server.tokenize import DetokenizeRequest, detokenize, tokenize, tokenize_model

log = logging.getLogger("fitserve.server")
_M = TypeVar("_M", bound=BaseModel)
_Req = TypeVar("_Req", CompletionRequest, ChatCompletionRequest)


class AppState:
    """Mutable server state shared by the routes (one per app)."""

    def __init__(self, engine_loop: EngineLoop, settings: ServerSettings) -> None:
        self.loop = engine_loop
        self.settings = settings
        self.draining = False
        self._ctx: ModelContext | None = None
        self.defaults = DefaultSampling()  # resolved with the context, once the model is loaded
        self.token_text: Callable[[int], str] = str  # replaced by the tokenizer's once loaded

    def context(self) -> ModelContext:
        if not self.loop.ready or self.loop.engine is None:
            raise APIError(503, "the model is still loading" if self.loop.alive else "the engine is not running",
                           headers={"Retry-After": "5"})
        if self._ctx is None:
            e = self.loop.engine
            self._ctx = ModelContext(self.settings.model_name, e.tokenizer, e.max_model_len,
                                     e.spec.vocab_size, int(self.loop.snapshot.time) if self.loop.snapshot else 0)
            self.token_text = token_text_fn(e.tokenizer)
            self.defaults = self.settings.resolve_sampling(e.loaded.generation_defaults)
        return self._ctx

    def fill_defaults(self, body: _Req) -> _Req:
        """``body`` with its omitted sampling fields set to the defaults in force."""
        self.context()  # resolves the defaults once the model is loaded (503 before)
        return body.with_defaults(self.defaults.values)


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

    # openapi_url=None: FastAPI's own document would show no bodies (read by hand); see /openapi.json
    app = FastAPI(title="fitserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.fitserve = state
    _install_error_handlers(app)
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    def check_auth(request: Request, *, browser: bool = False) -> None:
        key = settings.api_key
        if key is None:
            return
        if not hmac.compare_digest(_given_key(request).encode(), key.encode()):
            # A browser only offers its login prompt (for the dashboard) on this header.
            headers = {"WWW-Authenticate": 'Basic realm="fitserve"'} if browser else None
            raise APIError(401, "Incorrect or missing API key", code="invalid_api_key", headers=headers)

    def overloaded() -> APIError:
        engine_loop.metrics.rejected.labels(status="503").inc()
        return APIError(503, f"the server is overloaded ({engine_loop.queued} requests waiting); retry later",
                        code="overloaded", headers={"Retry-After": str(settings.retry_after_s)})

    async def run(request: Request, prep: Prepared) -> Response:
        if state.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        log.debug("request %s: %d prompt(s) x n=%d, user=%r", prep.group, len(prep.prompts), prep.n, prep.user)
        job = Run(engine_loop, prep)
        if len(job.children) > settings.max_waiting:  # a 503 would tell it to retry in vain
            raise APIError(400, f"this request needs {len(job.children)} sequences (prompts x n), more than "
                                f"the server queues at once (--max-waiting {settings.max_waiting})", param="n")
        # NOTE: admission is reserved atomically with the submit (EngineLoop.submit), so
        # requests racing each other cannot overshoot max_waiting.
        if not job.submit(settings.max_waiting):
            raise overloaded()
        try:
            # NOTE: a refusal (bad request 400, slo admission 429) comes back as an HTTP status,
            # streamed or not: the response starts only once the engine has queued the request.
            await job.added()
        except BaseException as err:  # a refusal, or the client left while it was queued
            job.close()
            if isinstance(err, APIError) and err.status == 429:
                engine_loop.metrics.rejected.labels(status="429").inc()
            if isinstance(err, APIError) and err.status == 400 and err.param is None:
                # NOTE: the engine refused it at add_request: with an output constraint, that is
                # its schema/regex/grammar not compiling (the message says what is wrong).
                err.param = prep.guided_param
            raise
        if prep.stream:
            return RunStreamingResponse(job, stream_events(job, state.token_text), settings.send_timeout_s)
        try:
            return JSONResponse(await collect(job, request, state.token_text))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        finally:
            job.close()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        raw = await _read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        prep = await run_in_threadpool(lambda: prepare_completion(state.fill_defaults(_parse(raw, CompletionRequest)), state.context()))
        return await run(request, prep)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        raw = await _read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        prep = await run_in_threadpool(lambda: prepare_chat(state.fill_defaults(_parse(raw, ChatCompletionRequest)), state.context()))
        return await run(request, prep)

    _add_tokenizer_routes(app, state, check_auth)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        ctx = state.context()
        card = ModelCard(id=ctx.name, created=ctx.created, max_model_len=ctx.max_model_len,
                         sampling_defaults=state.defaults.values,
                         sampling_defaults_source=state.defaults.sources)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine_loop.ready:
            return JSONResponse({"status": "ok"})
        status = "loading" if engine_loop.alive else "dead"
        return JSONResponse({"status": status, "error": repr(engine_loop.error) if engine_loop.error else None},
                            status_code=503)

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        check_auth(request)
        ok = engine_loop.ready and not state.draining
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not settings.metrics_public:
            check_auth(request)
        return Response(engine_loop.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/dashboard")
    async def dashboard(request: Request) -> HTMLResponse:
        check_auth(request, browser=True)
        return HTMLResponse(_asset("index.html"))

    @app.get("/dashboard/app.js")
    async def dashboard_js(request: Request) -> Response:
        check_auth(request, browser=True)
        return Response(_asset("app.js"), media_type="text/javascript")

    @app.get("/dashboard/state")
    async def dashboard_state(request: Request) -> JSONResponse:
        check_auth(request, browser=True)
        snap = engine_loop.snapshot.to_json() if engine_loop.snapshot else {}
        return JSONResponse({**snap, "model": settings.model_name, "ready": engine_loop.ready,
                             "draining": state.draining, "history": engine_loop.metrics.history()})

    openapi_doc: dict[str, Any] = {}  # built on first use, then served as is

    @app.get("/openapi.json")
    async def openapi_json(request: Request) -> JSONResponse:
        check_auth(request)
        if not openapi_doc:
            openapi_doc.update(build_openapi(settings))
        return JSONResponse(openapi_doc)

    return app


def _add_tokenizer_routes(app: FastAPI, state: AppState, check_auth: Callable[[Request], None]) -> None:
    """vLLM's POST /tokenize and /detokenize (``fitserve.server.tokenize``), behind the API key."""
    settings = state.settings

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        check_auth(request)
        raw = await _read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        return JSONResponse(await run_in_threadpool(
            lambda: tokenize(_parse(raw, tokenize_model, TOKENIZE_REJECTED_FIELDS), state.context())))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        check_auth(request)
        raw = await _read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        return JSONResponse(await run_in_threadpool(
            lambda: detokenize(_parse(raw, DetokenizeRequest, TOKENIZE_REJECTED_FIELDS), state.context())))


def _asset(name: str) -> str:
    return resources.files("fitserve.server").joinpath("dashboard", name).read_text(encoding="utf-8")


async def _read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, at most ``limit`` bytes (else 413), received in full within ``timeout_s`` (else 408)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body is larger than {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive in full within {timeout_s:g} s ({size} bytes came)",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)


def _given_key(request: Request) -> str:
    """The key a request offers: a Bearer token, or the password of HTTP Basic credentials."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return ""
    return ""


def _parse(raw: bytes, model: type[_M] | Callable[[dict[str, Any]], type[_M]],
           rejected: dict[str, str] = REJECTED_FIELDS) -> _M:
    """Validate a request body (runs in a worker thread with the rest of request preparation).

    ``model`` is the pydantic model, or a function of the parsed JSON object that picks it.
    """
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    except Exception:  # noqa: BLE001 - bad UTF-8, bad JSON: all the client's
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    for name, why in rejected.items():
        if data.get(name) not in (None, [], {}):
            raise APIError(400, why, param=name, code="unsupported_parameter")
    chosen: type[_M] = model if isinstance(model, type) else model(data)
    try:
        return chosen.model_validate_json(raw)
    except ValidationError as exc:
        field = _lone_surrogate_field(data)
        if field is not None:  # pydantic's JSON parser names it only as a bad escape
            raise APIError(400, f"{field} contains a lone UTF-16 surrogate escape (\\ud800-\\udfff without "
                                "its pair): it is not valid Unicode text", param=field) from None
        raise APIError(400, _validation_message(exc), param=_validation_param(exc)) from None


def _lone_surrogate_field(data: dict[str, Any]) -> str | None:
    """The top-level field of ``data`` holding a string that is not valid Unicode, if any."""
    def bad(v: Any) -> bool:
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
            return False
        if isinstance(v, dict):
            return any(bad(k) or bad(x) for k, x in v.items())
        if isinstance(v, list):
            return any(bad(x) for x in v)
        return False

    return next((str(k) for k, v in data.items() if bad(k) or bad(v)), None)


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

