"""Security basics of the server, without loading a model: the API key on every route but
/health, CORS off unless --allowed-origins, dashboard code that never renders data as HTML, and
no unpickling anywhere in the package."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
from fastapi.routing import iter_route_contexts

import fitserve
from fitserve.config import EngineConfig
from fitserve.server.app import create_app
from fitserve.server.engine_loop import EngineLoop
from fitserve.server.metrics import Metrics
from fitserve.server.settings import ServerSettings

PACKAGE = Path(fitserve.__file__).parent


def _app(**settings: object):  # type: ignore[no-untyped-def]
    loop = EngineLoop(EngineConfig(), Metrics(), engine_factory=lambda _c: None)  # type: ignore[arg-type,return-value]
    return create_app(loop, ServerSettings(**settings))  # type: ignore[arg-type]


def _call(app, method: str, path: str, **kw: object) -> httpx.Response:  # type: ignore[no-untyped-def]
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)  # type: ignore[arg-type]

    return asyncio.run(go())


def test_the_api_key_covers_every_route_but_health() -> None:
    app = _app(api_key="secret")
    # NOTE: the routes sit in APIRouters, which FastAPI includes as a whole: walk their routes
    routes = [(m, r.path) for r in iter_route_contexts(app.routes) for m in sorted(r.methods or [])
              if m in ("GET", "POST")]
    assert len(routes) >= 9, routes
    for method, path in routes:
        r = _call(app, method, path, json={})
        if path == "/health":
            assert r.status_code == 503, (path, r.status_code)  # open (the model is not loaded here)
            continue
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"
        wrong = _call(app, method, path, json={}, headers={"Authorization": "Bearer secreT"})
        assert wrong.status_code == 401, (method, path)
        right = _call(app, method, path, json={}, headers={"Authorization": "Bearer secret"})
        assert right.status_code != 401, (method, path)


def test_cors_is_off_unless_origins_are_given() -> None:
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    off = _call(_app(), "OPTIONS", "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in off.headers
    plain = _call(_app(), "GET", "/health", headers={"Origin": "https://ui.example"})
    assert "access-control-allow-origin" not in plain.headers

    app = _app(allowed_origins=["https://ui.example"])
    ok = _call(app, "OPTIONS", "/v1/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"
    other = _call(app, "OPTIONS", "/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"


def test_allowed_origins_flag_takes_vllm_json_or_a_comma_list() -> None:
    from fitserve.cli.serve import _origins

    assert _origins('["https://a", "https://b"]') == ["https://a", "https://b"]
    assert _origins("https://a, https://b") == ["https://a", "https://b"]
    with pytest.raises(Exception, match="JSON"):
        _origins('["https://a"')


def test_the_dashboard_renders_request_data_as_text() -> None:
    dash = PACKAGE / "server" / "dashboard"
    js = (dash / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, f"app.js uses {sink}: request data could be parsed as HTML or code"
    html = (dash / "index.html").read_text()
    assert not re.search(r"\son[a-z]+\s*=", html), "inline event handlers in index.html"
    assert "{{" not in html and "%s" not in html, "the page is static: no server-side templating of data"


UNPICKLING = re.compile(r"\b(pickle|cPickle|dill|marshal|shelve|joblib)\b|torch\.load\s*\(|allow_pickle\s*=\s*True"
                        r"|yaml\.load\s*\(|jsonpickle")


def test_no_unpickling_anywhere_in_the_package() -> None:
    hits = []
    for path in PACKAGE.rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if UNPICKLING.search(line):
                hits.append(f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}")
    assert not hits, "model files and clients must never reach an unpickler:\n" + "\n".join(hits)
