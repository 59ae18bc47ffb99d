"""Turn a validated OpenAI request into engine work: token ids, SamplingParams, n children.

Everything a client can get wrong is checked here, before anything reaches the engine thread,
so an invalid request is a 400 with the offending field named and leaves no trace.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fitserve.loading.tokenizer import Tokenizer
from fitserve.sampling import SamplingParams
from fitserve.sampling.beam_search import BeamSearchParams
from fitserve.sampling.params import MAX_LOGPROBS
from fitserve.server.chat_render import render_chat, template_takes_tools
from fitserve.server.engine_commands import Child
from fitserve.server.errors import APIError, bad_request, param_from_message
from fitserve.server.guided_fields import (
    Guided,
    guided_from_request,
    logit_bias_from_request,
    sampling_extras,
    truncate_prompts,
)
from fitserve.server.protocol.chat import ChatCompletionRequest
from fitserve.server.protocol.common import (
    MAX_N,
    MAX_PROMPTS_PER_REQUEST,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
)
from fitserve.server.protocol.completions import CompletionRequest
from fitserve.server.reasoning import prompt_opens_think
from fitserve.server.tool_call_formats import SPECIAL_TOKEN_FORMATS
from fitserve.server.tools import ToolPlan, plan_tools
from fitserve.structured.guided import GuidedDecoding

MAX_STOP_TOKEN_IDS = 64


@dataclass(slots=True)
class ModelContext:
    """Immutable facts about the loaded model that request handling needs."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    created: int
    trust_request_chat_template: bool = False  # a request's own chat_template may run
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: the most top alternatives a request may ask for
    tool_call_parser: str = "hermes"  # --tool-call-parser: the format tool_choice "auto" is parsed for
    reasoning_parser: str | None = None  # --reasoning-parser: <think> split into reasoning_content


@dataclass(slots=True)
class Prepared:
    """A request ready for the engine: ``len(prompts) * n`` children, choice index ``i*n + j``."""

    group: str
    created: int
    model: str
    chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    arrival: float
    beam: BeamSearchParams | None = None  # use_beam_search: one child per prompt, n beams each
    priority: int = 0  # scheduling: vLLM's priority, and this request's own SLO targets (ms)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    tools: ToolPlan | None = None  # chat with tools: what is parsed out of the output
    guided_param: str | None = None  # the request field the output constraint came from
    echo: list[str] | None = None  # completions with echo: each prompt's text, prepended to its choices
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the engine's one token dropped)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field: written in the response
    user: str | None = None  # OpenAI's end-user id (for the request log)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs say `token_id:N`
    reasoning_parser: str | None = None  # chat: split the output's think block off (vLLM's parser name)
    reasoning_opened: bool = False  # the rendered prompt ends inside a think block its template opened

    def children(self) -> list[Child]:
        """The engine requests; a child's id ends in its first choice index."""
        if self.beam is not None:
            return [Child(f"{self.group}-{i * self.n}", ids, self.beam, self.priority)
                    for i, ids in enumerate(self.prompts)]
        out = []
        for i, ids in enumerate(self.prompts):
            for j in range(self.n):
                seed = None if self.params.seed is None else self.params.seed + j
                params = dataclasses.replace(self.params, n=1, seed=seed)
                out.append(Child(f"{self.group}-{i * self.n + j}", ids, params, self.priority,
                                 self.slo_ttft_ms, self.slo_tpot_ms))
        return out

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def check_model(requested: str | None, ctx: ModelContext) -> None:
    if requested is not None and requested != ctx.name:
        raise APIError(404, f"The model `{requested}` does not exist; this server serves `{ctx.name}`",
                       param="model", code="model_not_found")


def _check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}", "stop")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise bad_request(f"stop sequences are limited to {MAX_STOP_LENGTH} characters", "stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed", "stop_token_ids")


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None,
    ctx: ModelContext, guided: GuidedDecoding | None, prompt_logprobs: int | None = None,
) -> SamplingParams:
    fields: dict[str, Any] = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    try:
        return SamplingParams(
            n=1, max_tokens=max_tokens, seed=req.seed, stop=req.stop,
            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=logit_bias_from_request(req.logit_bias, ctx.vocab_size), guided=guided,
            **sampling_extras(req, ctx.vocab_size), **{k: v for k, v in fields.items() if v is not None},
        )
    except ValueError as exc:
        raise bad_request(str(exc), param_from_message(str(exc))) from None


def _check_lengths(
    prompts: list[list[int]], max_tokens: int | None, ctx: ModelContext, param: str = "max_tokens"
) -> None:
    for ids in prompts:
        if not ids:
            raise bad_request("prompt is empty", "prompt")
        if len(ids) >= ctx.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {ctx.max_model_len} tokens; the prompt "
                f"has {len(ids)} tokens, leaving no room to generate", "prompt", "context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > ctx.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {ctx.max_model_len} tokens; you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                "completion)", param, "context_length_exceeded")


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _echo(req: CompletionRequest, raw: list[Any], prompts: list[list[int]], ctx: ModelContext) -> list[str] | None:
    """``echo``: each prompt's text (as sent, or its token ids decoded), else None."""
    if not req.echo:
        return None
    return [item if isinstance(item, str) else ctx.tokenizer.decode(ids, skip_special_tokens=False)
            for item, ids in zip(raw, prompts, strict=True)]


def prepare_completion(req: CompletionRequest, ctx: ModelContext) -> Prepared:
    """Validate a /v1/completions request and tokenize its prompt(s)."""
    check_model(req.model, ctx)
    _check_common(req)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (it must be absent or equal to n)", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= ctx.max_logprobs:
        raise bad_request(f"logprobs must be between 0 and {ctx.max_logprobs} (--max-logprobs), got {req.logprobs}",
                          "logprobs")
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        raw: list[Any] = [p]
    else:
        raw = list(p)  # a batch: list[str] or list[list[int]]
    if not raw:
        raise bad_request("prompt must not be an empty list", "prompt")
    if len(raw) > MAX_PROMPTS_PER_REQUEST:
        raise bad_request(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request", "prompt")
    prompts = []
    for item in raw:
        if isinstance(item, str):
            prompts.append(ctx.tokenizer.encode(item, add_special_tokens=req.add_special_tokens))
        else:
            ids = list(item)
            if any(not 0 <= t < ctx.vocab_size for t in ids):
                raise bad_request(f"prompt token ids must be in [0, {ctx.vocab_size})", "prompt")
            prompts.append(ids)
    prompts = truncate_prompts(prompts, req.truncate_prompt_tokens, ctx.max_model_len)
    # NOTE: max_tokens 0 with echo (lm-eval's loglikelihood) runs as max_tokens 1, the token
    # dropped from the choice, as vLLM does; the prompt's logprobs come from its prefill
    echo_only = req.echo and req.max_tokens == 0
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 (0 only with echo: the prompt alone)", "max_tokens")
    max_tokens = 1 if echo_only else req.max_tokens
    _check_lengths(prompts, max_tokens, ctx)
    echo = _echo(req, raw, prompts, ctx)
    guided = guided_from_request(req)
    # the prefill scores the prompt for the prompt_logprobs field, and for echo with logprobs
    asked = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    params = _sampling_params(req, max_tokens, req.logprobs, ctx, guided.decoding if guided else None,
                              max(asked) if asked else None)
    prep = _prepared("cmpl", False, req, prompts, params, ctx, guided)
    prep.echo, prep.echo_only = echo, echo_only
    return prep


def prepare_chat(req: ChatCompletionRequest, ctx: ModelContext) -> Prepared:
    """Validate a /v1/chat/completions request and render its conversation with the template."""
    check_model(req.model, ctx)
    _check_common(req)
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= ctx.max_logprobs:
            raise bad_request(f"top_logprobs must be between 0 and {ctx.max_logprobs} (--max-logprobs), got "
                              f"{req.top_logprobs}", "top_logprobs")
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    guided = guided_from_request(req)
    tools = plan_tools(req, user_guided=guided is not None)
    if tools is not None and tools.guided is not None:
        guided = Guided(tools.guided, "tools")  # the grammar is built from the tools' schemas
    text = render_chat(ctx.tokenizer, req.messages, tools.shown if tools else [], req,
                       trusted=ctx.trust_request_chat_template)
    prompts = [ctx.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)]
    prompts = truncate_prompts(prompts, req.truncate_prompt_tokens, ctx.max_model_len)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    _check_lengths(prompts, max_tokens, ctx, param)
    try:
        params = _sampling_params(req, max_tokens, logprobs, ctx, guided.decoding if guided else None,
                                  req.prompt_logprobs)
    except APIError as exc:
        if exc.param == "max_tokens":
            exc.param = param
        raise
    if tools is not None and tools.parses:
        # NOTE: a grammar (required / a named function) writes Hermes blocks whatever the parser, and
        # a template that does not read `tools` was shown them Hermes style (chat_render): Hermes then.
        taught_hermes = tools.guided is not None or not template_takes_tools(ctx.tokenizer, req.chat_template)
        tools = dataclasses.replace(tools, parser="hermes" if taught_hermes else ctx.tool_call_parser)
        if tools.parser in SPECIAL_TOKEN_FORMATS:  # their markers are special tokens (vLLM does the same)
            params = dataclasses.replace(params, skip_special_tokens=False)
    prep = _prepared("chatcmpl", True, req, prompts, params, ctx, guided)
    prep.tools = tools if tools is not None and tools.parses else None
    prep.reasoning_parser = ctx.reasoning_parser
    prep.reasoning_opened = ctx.reasoning_parser is not None and prompt_opens_think(text)
    return prep


def _prepared(
    prefix: str, chat: bool, req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]], params: SamplingParams, ctx: ModelContext, guided: Guided | None,
) -> Prepared:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        v = getattr(req, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise bad_request(f"{name} must be a number of milliseconds > 0, got {v}", name)
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available with stream (as vLLM); echo with logprobs "
                          "streams the prompt's logprobs in the first chunk", "prompt_logprobs")
    return Prepared(
        group=_new_id(prefix), created=int(time.time()), model=ctx.name, chat=chat,
        prompts=prompts, params=params, n=req.n, stream=req.stream, include_usage=include_usage,
        arrival=time.monotonic(), beam=_beam_params(req, prompts, params, ctx),
        priority=req.priority, slo_ttft_ms=req.slo_ttft_ms, slo_tpot_ms=req.slo_tpot_ms,
        guided_param=guided.param if guided else None, user=req.user,
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        prompt_logprobs=req.prompt_logprobs,
    )


def _beam_params(req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                 params: SamplingParams, ctx: ModelContext) -> BeamSearchParams | None:
    """vLLM's ``use_beam_search``: ``n`` beams, each returned as a choice, best first."""
    if not req.use_beam_search:
        return None  # length_penalty alone changes nothing (as in vLLM)
    if req.stream:
        raise bad_request("use_beam_search returns the beams at the end: stream is not supported with it",
                          "stream")
    if params.logprobs is not None:
        raise bad_request("logprobs are not supported with use_beam_search", "logprobs")
    if params.prompt_logprobs is not None:
        which = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
        raise bad_request("prompt logprobs (prompt_logprobs, echo with logprobs) are not supported with "
                          "use_beam_search", which)
    if params.stop or params.stop_token_ids:
        raise bad_request("stop and stop_token_ids are not supported with use_beam_search (EOS ends a beam)",
                          "stop")
    masked = next((k for k in ("allowed_token_ids", "bad_words", "min_tokens") if getattr(params, k)), None)
    if masked is not None:
        raise bad_request(f"{masked} is not supported with use_beam_search", masked)
    if params.guided is not None or params.logit_bias:
        which = "logit_bias" if params.logit_bias else "structured output"
        raise bad_request(f"{which} is not supported with use_beam_search", "use_beam_search")
    room = ctx.max_model_len - max(len(p) for p in prompts)
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=min(params.max_tokens or room, room),
                                ignore_eos=req.ignore_eos, length_penalty=req.length_penalty)
    except ValueError as exc:
        raise bad_request(str(exc), param_from_message(str(exc))) from None
