"""Operations: GET /health (open), /ready, /metrics (open with ``metrics_public``) and
/openapi.json; all but /health behind the API key."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from fitserve.server.auth import require_api_key, require_metrics_key
from fitserve.server.openapi import build_openapi
from fitserve.server.state import StateDep

router = APIRouter()


@router.get("/health")
async def health(state: StateDep) -> JSONResponse:
    engine_loop = state.loop
    if engine_loop.ready:
        return JSONResponse({"status": "ok"})
    status = "loading" if engine_loop.alive else "dead"
    return JSONResponse({"status": status, "error": repr(engine_loop.error) if engine_loop.error else None},
                        status_code=503)


@router.get("/ready", dependencies=[Depends(require_api_key)])
async def ready(state: StateDep) -> JSONResponse:
    ok = state.loop.ready and not state.draining
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@router.get("/metrics", dependencies=[Depends(require_metrics_key)])
async def metrics(state: StateDep) -> Response:
    return Response(state.loop.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/openapi.json", dependencies=[Depends(require_api_key)])
async def openapi_json(state: StateDep) -> JSONResponse:
    if state.openapi_doc is None:
        state.openapi_doc = build_openapi(state.settings)
    return JSONResponse(state.openapi_doc)
