"""Request bodies, read by hand and validated strictly: every client mistake is an OpenAI-style 4xx.

:func:`read_body` receives a body with a size cap (413) and a deadline (408) on the event loop;
:func:`parse_body` validates it against a pydantic model in strict mode, in a worker thread with
the rest of request preparation (a 1 MiB prompt must not stall other streams).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from fitserve.server.errors import APIError
from fitserve.server.protocol.common import ACCEPTED_VALUES, REJECTED_FIELDS

_M = TypeVar("_M", bound=BaseModel)
log = logging.getLogger("fitserve.server")


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
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


def parse_body(raw: bytes, model: type[_M] | Callable[[dict[str, Any]], type[_M]],
               rejected: dict[str, str] = REJECTED_FIELDS) -> _M:
    """Validate a request body (runs in a worker thread with the rest of request preparation).

    ``model`` is the pydantic model, or a function of the parsed JSON object that picks it;
    a field of ``rejected`` that is set (not null or empty) is a 400 with its reason.
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
        value = data.get(name)
        if value not in (None, [], {}) and value not in ACCEPTED_VALUES.get(name, ()):
            raise APIError(400, why, param=name, code="unsupported_parameter")
    chosen: type[_M] = model if isinstance(model, type) else model(data)
    _warn_unknown(data, chosen, rejected)
    try:
        return chosen.model_validate_json(raw)
    except ValidationError as exc:
        field = _lone_surrogate_field(data)
        if field is not None:  # pydantic's JSON parser names it only as a bad escape
            raise APIError(400, f"{field} contains a lone UTF-16 surrogate escape (\\ud800-\\udfff without "
                                "its pair): it is not valid Unicode text", param=field) from None
        raise APIError(400, _validation_message(exc), param=_validation_param(exc)) from None


def _warn_unknown(data: dict[str, Any], model: type[BaseModel], rejected: dict[str, str]) -> None:
    """Log the fields ``model`` does not have (vLLM's rule: ignored, with a warning naming them)."""
    known = {f.alias or name for name, f in model.model_fields.items()} | set(model.model_fields) | set(rejected)
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        # NOTE: as vLLM (extra="allow" + a warning), not a 400: clients send fields of newer API
        # versions; every field vLLM or OpenAI defines is either a model field or in REJECTED_FIELDS.
        log.warning("The following fields were present in the request but ignored: %s", unknown[:16])


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
