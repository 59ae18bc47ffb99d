"""A server's limits and identity (ServerSettings): what the CLI's flags set and the app, its
routes and its OpenAPI document read."""

from __future__ import annotations

from dataclasses import dataclass, field

from fitserve.loading.generation_defaults import (
    DefaultSampling,
    GenerationConfigMode,
    GenerationDefaults,
    resolve_default_sampling,
)
from fitserve.sampling.params import MAX_LOGPROBS


@dataclass(slots=True)
class ServerSettings:
    """Limits and identity of a server; the CLI fills these from its flags."""

    model_name: str = "smollm2-135m"
    api_key: str | None = None
    max_waiting: int = 256  # requests queued (submitted, not yet scheduled) before new ones get 503
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a body not received in full by then is a 408
    send_timeout_s: float | None = 60.0  # a stream write waiting this long (client not reading): abort
    allowed_origins: list[str] = field(default_factory=list)  # CORS: off unless origins are given
    retry_after_s: int = 1
    metrics_public: bool = False  # serve /metrics without the API key (for Prometheus scrapers)
    generation_config: GenerationConfigMode = "auto"  # "vllm": ignore the model's sampling defaults
    default_sampling: dict[str, float | int | None] = field(default_factory=dict)  # --default-* given
    trust_request_chat_template: bool = False  # run a chat_template a request sends (vLLM's flag)
    generation_defaults: GenerationDefaults | None = None  # --generation-config FOLDER: used instead of the model's
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: a request asking more is a 400
    tool_call_parser: str = "hermes"  # --tool-call-parser (vLLM's names)
    reasoning_parser: str | None = None  # --reasoning-parser (vLLM's names)

    def resolve_sampling(self, model: GenerationDefaults) -> DefaultSampling:
        """The defaults omitted request fields get with this model (see generation_defaults)."""
        chosen = self.generation_defaults if self.generation_defaults is not None else model
        return resolve_default_sampling(chosen, self.generation_config, self.default_sampling)
