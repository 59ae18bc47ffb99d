"""vLLM's tokenizer routes: POST /tokenize and POST /detokenize, behind the API key."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from fitserve.server.auth import require_api_key
from fitserve.server.protocol.common import TOKENIZE_REJECTED_FIELDS
from fitserve.server.protocol.tokenize import DetokenizeRequest, tokenize_model
from fitserve.server.request_body import parse_body, read_body
from fitserve.server.serving_tokenization import detokenize, tokenize
from fitserve.server.state import StateDep

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/tokenize")
async def tokenize_route(request: Request, state: StateDep) -> JSONResponse:
    settings = state.settings
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    return JSONResponse(await run_in_threadpool(
        lambda: tokenize(parse_body(raw, tokenize_model, TOKENIZE_REJECTED_FIELDS), state.context())))


@router.post("/detokenize")
async def detokenize_route(request: Request, state: StateDep) -> JSONResponse:
    settings = state.settings
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    return JSONResponse(await run_in_threadpool(
        lambda: detokenize(parse_body(raw, DetokenizeRequest, TOKENIZE_REJECTED_FIELDS), state.context())))
