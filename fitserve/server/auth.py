"""The API key, as FastAPI dependencies of the routes that need it.

With an API key set, every route but /health needs it: the /v1 API, the tokenizer routes,
/ready, /openapi.json, /metrics (unless ``metrics_public``, for Prometheus scrapers) and the
dashboard. The key is accepted as ``Authorization: Bearer KEY`` or as the password of HTTP Basic
auth (what a browser sends for the dashboard, which answers 401 with ``WWW-Authenticate: Basic``
so the browser asks for it). A wrong or missing key is a 401 ``invalid_api_key``.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from fastapi import Request

from fitserve.server.errors import APIError
from fitserve.server.state import app_state


async def require_api_key(request: Request) -> None:
    """A 401 unless the request offers the server's API key (if it has one)."""
    _check(request, browser=False)


async def require_dashboard_key(request: Request) -> None:
    """As :func:`require_api_key`, and a 401 asks a browser for it (``WWW-Authenticate: Basic``)."""
    _check(request, browser=True)


async def require_metrics_key(request: Request) -> None:
    """As :func:`require_api_key`, unless the server's /metrics is public."""
    if not app_state(request).settings.metrics_public:
        _check(request, browser=False)


def _check(request: Request, *, browser: bool) -> None:
    key = app_state(request).settings.api_key
    if key is None:
        return
    if not hmac.compare_digest(given_key(request).encode(), key.encode()):
        # A browser only offers its login prompt (for the dashboard) on this header.
        headers = {"WWW-Authenticate": 'Basic realm="fitserve"'} if browser else None
        raise APIError(401, "Incorrect or missing API key", code="invalid_api_key", headers=headers)


def given_key(request: Request) -> str:
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
