"""The state one app's routes share (:class:`AppState`), and the dependency that hands it to them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from fitserve.loading.generation_defaults import DefaultSampling
from fitserve.server.choices import token_text_fn
from fitserve.server.engine_loop import EngineLoop
from fitserve.server.errors import APIError
from fitserve.server.protocol.chat import ChatCompletionRequest
from fitserve.server.protocol.completions import CompletionRequest
from fitserve.server.serving import ModelContext
from fitserve.server.settings import ServerSettings

_Req = TypeVar("_Req", CompletionRequest, ChatCompletionRequest)


class AppState:
    """Mutable server state shared by the routes (one per app, at ``app.state.fitserve``)."""

    def __init__(self, engine_loop: EngineLoop, settings: ServerSettings) -> None:
        self.loop = engine_loop
        self.settings = settings
        self.draining = False
        self._ctx: ModelContext | None = None
        self.defaults = DefaultSampling()  # resolved with the context, once the model is loaded
        self.token_text: Callable[[int], str] = str  # replaced by the tokenizer's once loaded
        self.openapi_doc: dict[str, Any] | None = None  # built on first use, then served as is

    def context(self) -> ModelContext:
        """The loaded model's facts; a 503 while it is loading or once the engine is gone."""
        if not self.loop.ready or self.loop.engine is None:
            raise APIError(503, "the model is still loading" if self.loop.alive else "the engine is not running",
                           headers={"Retry-After": "5"})
        if self._ctx is None:
            e = self.loop.engine
            self._ctx = ModelContext(self.settings.model_name, e.tokenizer, e.max_model_len,
                                     e.spec.vocab_size, int(self.loop.snapshot.time) if self.loop.snapshot else 0,
                                     trust_request_chat_template=self.settings.trust_request_chat_template,
                                     max_logprobs=self.settings.max_logprobs,
                                     tool_call_parser=self.settings.tool_call_parser,
                                     reasoning_parser=self.settings.reasoning_parser)
            self.token_text = token_text_fn(e.tokenizer)
            self.defaults = self.settings.resolve_sampling(e.loaded.generation_defaults)
        return self._ctx

    def fill_defaults(self, body: _Req) -> _Req:
        """``body`` with its omitted sampling fields set to the defaults in force."""
        self.context()  # resolves the defaults once the model is loaded (503 before)
        return body.with_defaults(self.defaults.values)


def app_state(request: Request) -> AppState:
    """The AppState of the app serving ``request``."""
    state: AppState = request.app.state.fitserve
    return state


async def _state_dependency(request: Request) -> AppState:
    # NOTE: async so that FastAPI calls it on the event loop, not in its thread pool
    return app_state(request)


StateDep = Annotated[AppState, Depends(_state_dependency)]
"""A route parameter of this type receives the app's AppState."""
