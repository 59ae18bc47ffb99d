"""The server's OpenAPI 3.1 document, with the real request and response schemas.

FastAPI would derive one from the route signatures, but the routes read their bodies by hand
(a size cap, strict validation, every mistake an OpenAI-style 4xx), so that document would have
no request bodies and empty responses. This one is assembled from the pydantic models of
:mod:`fitserve.server.protocol` instead: the request models' validation schemas (with the
bounds the server enforces), the response models' serialization schemas (closed: no key the
server does not write), the error shape on every error status, and the API key as a bearer
scheme on every operation but /health (the one the server leaves open).

It depends on the server's settings: the served model's id is the only ``model`` accepted, and
without ``--api-key`` nothing needs a key. The ops router (``routers.ops``) builds it once and serves it at
GET /openapi.json (which needs the key, like the rest of the API).
"""

from __future__ import annotations

import copy
from importlib import metadata
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from fitserve.server.protocol.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from fitserve.server.protocol.common import (
    REJECTED_FIELDS,
    TOKENIZE_REJECTED_FIELDS,
    ErrorResponse,
    ModelList,
)
from fitserve.server.protocol.completions import Completion, CompletionChunk, CompletionRequest
from fitserve.server.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

if TYPE_CHECKING:
    from fitserve.server.settings import ServerSettings

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{model}"
# (model, mode): requests are described as validated, responses as serialized
_MODELS: tuple[tuple[type[BaseModel], Any], ...] = (
    (CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
    (Completion, "serialization"), (ChatCompletion, "serialization"),
    (CompletionChunk, "serialization"), (ChatCompletionChunk, "serialization"),
    (ErrorResponse, "serialization"), (ModelList, "serialization"),
    (TokenizeCompletionRequest, "validation"), (TokenizeChatRequest, "validation"),
    (DetokenizeRequest, "validation"), (TokenizeResponse, "serialization"), (DetokenizeResponse, "serialization"),
)
# request models with a `model` field (only the served model is a 200)
_WITH_MODEL = ("CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest", "TokenizeChatRequest",
               "DetokenizeRequest")
_ERRORS = {
    400: "Invalid request: bad JSON, a wrong type, a value out of range, a prompt longer than the "
         "context; `error.param` names the field",
    401: "Missing or wrong API key",
    404: "Unknown model (`error.param` is `model`)",
    408: "The request body did not arrive in full within the server's --body-timeout",
    413: "Request body over the server's --max-body-bytes",
    429: "Turned away by the slo scheduling policy (predicted to miss its TTFT target)",
    500: "Internal error (the server log has the traceback)",
    503: "The model is still loading, the engine is not running, the queue is full (--max-waiting) "
         "or the server is shutting down",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                "schema": {"type": "integer", "minimum": 0}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _error(status: int, description: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description or _ERRORS[status],
                           "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    if status in (429, 503):
        out["headers"] = _RETRY_AFTER
    return out


def _event_stream(chunk: str) -> dict[str, Any]:
    """text/event-stream: OpenAPI 3.1 has no keyword for a stream's items, so (as OpenAPI 3.2's
    ``itemSchema`` would, and as schemathesis reads a 3.1 event-stream schema) this describes one
    event: its ``data`` is a JSON chunk, an error object, or the final ``[DONE]``."""
    return {"schema": {
        "type": "object",
        "description": f"Each server-sent event is `data: <{chunk} as JSON>`; an error after the stream "
                       "started is one `data: <ErrorResponse>` event; the stream ends with `data: [DONE]`.",
        "required": ["data"],
        "properties": {"data": {
            "type": "string",
            "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}},
        }},
    }}


def _generate(summary: str, request: str, body: str, chunk: str) -> dict[str, Any]:
    rejected = ", ".join(f"`{k}`" for k in REJECTED_FIELDS)
    return {"post": {
        "summary": summary,
        "operationId": f"create{body}",
        "tags": ["OpenAI"],
        "requestBody": {
            "required": True,
            "description": "Validated strictly (`\"5\"` is not an integer). Unknown fields are ignored, "
                           f"except these, which are a 400 unless null or empty: {rejected}.",
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {
            "200": {"description": f"The {body}; with `stream: true`, server-sent events of {chunk}s.",
                    "content": {"application/json": {"schema": _ref(body)},
                                "text/event-stream": _event_stream(chunk)}},
            **{str(s): _error(s) for s in _ERRORS},
        },
    }}


def _tokenizer_paths() -> dict[str, Any]:
    """vLLM's POST /tokenize and /detokenize."""
    rejected = ", ".join(f"`{k}`" for k in TOKENIZE_REJECTED_FIELDS)
    errors = {str(s): _error(s, "A bad request: a wrong type, a token id outside the vocabulary, a "
                                "conversation the chat template cannot render" if s == 400 else None)
              for s in (400, 401, 404, 408, 413, 500, 503)}

    def op(op_id: str, summary: str, request: dict[str, Any], response: str) -> dict[str, Any]:
        return {"post": {
            "summary": summary, "operationId": op_id, "tags": ["Tokenizer"],
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}},
                            "description": "Validated strictly; unknown fields are ignored, except these, "
                                           f"which are a 400 unless null or empty: {rejected}."},
            "responses": {"200": {"description": response,
                                  "content": {"application/json": {"schema": _ref(response)}}}, **errors},
        }}

    return {
        "/tokenize": op("tokenize", "Token ids of a prompt, or of a conversation with the chat template applied "
                                    "(vLLM)",
                        {"anyOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]},
                        "TokenizeResponse"),
        "/detokenize": op("detokenize", "The text of token ids (vLLM)", _ref("DetokenizeRequest"),
                          "DetokenizeResponse"),
    }


def _plain(summary: str, media_type: str, description: str, *, op_id: str, tag: str,
           errors: tuple[int, ...] = (401,), schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"get": {
        "summary": summary, "operationId": op_id, "tags": [tag],
        "responses": {"200": {"description": description,
                              "content": {media_type: {"schema": schema or {"type": "string"}}}},
                      **{str(s): _error(s) for s in errors}},
    }}


def _health_paths() -> dict[str, Any]:
    ok = {"type": "object", "required": ["status"], "additionalProperties": False,
          "properties": {"status": {"const": "ok"}}}
    down = {"type": "object", "required": ["status", "error"], "additionalProperties": False,
            "properties": {"status": {"enum": ["loading", "dead"]},
                           "error": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                     "description": "Why the engine died (repr of the exception)."}}}
    ready = {"type": "object", "required": ["ready"], "additionalProperties": False,
             "properties": {"ready": {"type": "boolean"}}}
    return {
        "/health": {"get": {
            "summary": "Liveness: 200 once the model is loaded", "operationId": "health", "tags": ["Operations"],
            "security": [],
            "responses": {"200": {"description": "Serving", "content": {"application/json": {"schema": ok}}},
                          "503": {"description": "Loading, or the engine died",
                                  "content": {"application/json": {"schema": down}}}},
        }},
        "/ready": {"get": {
            "summary": "Readiness: 200 while serving and not shutting down", "operationId": "ready",
            "tags": ["Operations"],
            "responses": {"200": {"description": "Ready", "content": {"application/json": {"schema": ready}}},
                          "401": _error(401),
                          "503": {"description": "Loading or draining",
                                  "content": {"application/json": {"schema": ready}}}},
        }},
    }


def build_openapi(settings: ServerSettings) -> dict[str, Any]:
    """The document for a server with these settings (a fresh dict each call)."""
    _, defs = models_json_schema(list(_MODELS), ref_template=_REF)
    schemas: dict[str, Any] = copy.deepcopy(defs["$defs"])
    for name in _WITH_MODEL:  # only the served model is a 200
        schemas[name]["properties"]["model"]["anyOf"] = [
            {"type": "string", "enum": [settings.model_name]}, {"type": "null"}]

    keyed = settings.api_key is not None
    paths: dict[str, Any] = {
        "/v1/completions": _generate("Text completion (OpenAI)", "CompletionRequest", "Completion",
                                     "CompletionChunk"),
        "/v1/chat/completions": _generate("Chat completion (OpenAI)", "ChatCompletionRequest",
                                          "ChatCompletion", "ChatCompletionChunk"),
        **_tokenizer_paths(),
        "/v1/models": _plain("The served model (OpenAI)", "application/json", "A list of one model card",
                             op_id="listModels", tag="OpenAI", errors=(401, 500, 503), schema=_ref("ModelList")),
        **_health_paths(),
        "/metrics": _plain("Prometheus metrics", "text/plain", "The Prometheus text exposition format",
                           op_id="metrics", tag="Operations", errors=() if settings.metrics_public else (401,)),
        "/openapi.json": _plain("This document", "application/json", "The OpenAPI document",
                                op_id="openapi", tag="Operations", schema={"type": "object"}),
        "/dashboard": _plain("The dashboard page", "text/html", "HTML", op_id="dashboard", tag="Dashboard"),
        "/dashboard/app.js": _plain("The dashboard's script", "text/javascript", "JavaScript",
                                    op_id="dashboardScript", tag="Dashboard"),
        "/dashboard/state": _plain("What the dashboard polls", "application/json",
                                   "The engine's snapshot and the metrics history", op_id="dashboardState",
                                   tag="Dashboard", schema={"type": "object"}),
    }
    if settings.metrics_public:
        paths["/metrics"]["get"]["security"] = []
    for path in ("/dashboard", "/dashboard/app.js", "/dashboard/state"):
        paths[path]["get"]["security"] = [{"bearerAuth": []}, {"basicAuth": []}]
        if keyed:  # the browser's login prompt
            paths[path]["get"]["responses"]["401"]["headers"] = {
                "WWW-Authenticate": {"description": 'Basic realm="fitserve"', "schema": {"type": "string"}}}
    if not keyed:  # no --api-key: nothing needs one, and nothing answers 401
        for item in paths.values():
            for op in item.values():
                op.pop("security", None)
                op["responses"].pop("401", None)

    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "fitserve",
            "version": _version(),
            "description": (f"OpenAI-compatible API of fitserve, serving `{settings.model_name}`. Request "
                            f"bodies over {settings.max_body_bytes} bytes are a 413. Fields that are not "
                            "OpenAI's are marked as vLLM or fitserve extensions."),
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if keyed:
        doc["security"] = [{"bearerAuth": []}]
        doc["components"]["securitySchemes"] = {
            "bearerAuth": {"type": "http", "scheme": "bearer",
                           "description": "The server's --api-key, as `Authorization: Bearer KEY` (every "
                                          "route but /health; /metrics too unless --metrics-public). HTTP "
                                          "Basic with the key as password works too."},
            "basicAuth": {"type": "http", "scheme": "basic",
                          "description": "The --api-key as the password, any user name (what a browser "
                                         "sends after the dashboard's login prompt)."},
        }
    return doc


def _version() -> str:
    try:
        return metadata.version("fitserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"
