"""The OpenAI routes: POST /v1/completions, POST /v1/chat/completions and GET /v1/models.

A request is read and validated, turned into engine work (``fitserve.server.serving``) in a
worker thread, admitted against the queue limit, and answered as a stream or as one body once
finished (``fitserve.server.streaming``).
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from fitserve.server.auth import require_api_key
from fitserve.server.errors import APIError
from fitserve.server.inflight import ClientGone, Run
from fitserve.server.protocol.chat import ChatCompletionRequest
from fitserve.server.protocol.common import ModelCard, ModelList
from fitserve.server.protocol.completions import CompletionRequest
from fitserve.server.request_body import parse_body, read_body
from fitserve.server.serving import Prepared, prepare_chat, prepare_completion
from fitserve.server.state import AppState, StateDep
from fitserve.server.streaming import RunStreamingResponse, collect, stream_events

log = logging.getLogger("fitserve.server")

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions")
async def completions(request: Request, state: StateDep) -> Response:
    settings = state.settings
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    prep = await run_in_threadpool(
        lambda: prepare_completion(state.fill_defaults(parse_body(raw, CompletionRequest)), state.context()))
    return await _generate(request, state, prep)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: StateDep) -> Response:
    settings = state.settings
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    prep = await run_in_threadpool(
        lambda: prepare_chat(state.fill_defaults(parse_body(raw, ChatCompletionRequest)), state.context()))
    return await _generate(request, state, prep)


@router.get("/v1/models")
async def models(state: StateDep) -> JSONResponse:
    ctx = state.context()
    card = ModelCard(id=ctx.name, created=ctx.created, max_model_len=ctx.max_model_len,
                     sampling_defaults=state.defaults.values, sampling_defaults_source=state.defaults.sources)
    return JSONResponse(ModelList(data=[card]).model_dump())


def _token_id_text(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids: a token named by its id."""
    return f"token_id:{token_id}"


async def _generate(request: Request, state: AppState, prep: Prepared) -> Response:
    """Admit a prepared request, run it, and answer it (a stream, or one body once finished)."""
    settings, engine_loop = state.settings, state.loop
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
        engine_loop.metrics.rejected.labels(status="503").inc()
        raise APIError(503, f"the server is overloaded ({engine_loop.queued} requests waiting); retry later",
                       code="overloaded", headers={"Retry-After": str(settings.retry_after_s)})
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
    token_text = _token_id_text if prep.tokens_as_ids else state.token_text
    if prep.stream:
        return RunStreamingResponse(job, stream_events(job, token_text), settings.send_timeout_s)
    try:
        return JSONResponse(await collect(job, request, token_text))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    finally:
        job.close()
