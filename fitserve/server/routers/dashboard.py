"""The dashboard: its page, its script, and the state it polls; behind the API key, which a
browser is asked for (HTTP Basic) when it has none."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, JSONResponse, Response

from fitserve.server.auth import require_dashboard_key
from fitserve.server.state import StateDep

router = APIRouter(dependencies=[Depends(require_dashboard_key)])


@router.get("/dashboard")
async def dashboard() -> HTMLResponse:
    return HTMLResponse(_asset("index.html"))


@router.get("/dashboard/app.js")
async def dashboard_js() -> Response:
    return Response(_asset("app.js"), media_type="text/javascript")


@router.get("/dashboard/state")
async def dashboard_state(state: StateDep) -> JSONResponse:
    """The engine's last snapshot, with the served model, its readiness and the metrics history."""
    engine_loop = state.loop
    snap = engine_loop.snapshot.to_json() if engine_loop.snapshot else {}
    return JSONResponse({**snap, "model": state.settings.model_name, "ready": engine_loop.ready,
                         "draining": state.draining, "history": engine_loop.metrics.history()})


def _asset(name: str) -> str:
    return resources.files("fitserve.server").joinpath("dashboard", name).read_text(encoding="utf-8")
