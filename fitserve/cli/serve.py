"""``fitserve serve``: the OpenAI-compatible server on uvicorn, with graceful shutdown.

On SIGTERM/SIGINT the server stops accepting connections, refuses new requests on open ones
(503), lets in-flight requests finish for up to ``--shutdown-timeout`` seconds, aborts the rest,
stops the engine thread and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn

from fitserve import envs
from fitserve.config import EngineConfig
from fitserve.engine.args import (
    DEFAULT_MODEL,
    add_chat_template_arg,
    add_engine_args,
    apply_threads_arg,
    engine_config_from_args,
)
from fitserve.sampling.params import MAX_LOGPROBS
from fitserve.server.connections import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
    GuardedH11Protocol,
    raise_fd_limit,
)


class _GracefulServer(uvicorn.Server):
    """uvicorn.Server that marks the app draining on a signal and does not re-raise it.

    NOTE: uvicorn re-raises the captured signal after a graceful shutdown, which would make
    the process die *by* SIGTERM (exit status -15) instead of exiting 0.
    """

    def __init__(self, config: uvicorn.Config, app_state: Any) -> None:
        super().__init__(config)
        self.app_state = app_state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app_state.draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        sigs = (signal.SIGINT, signal.SIGTERM)
        old = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def add_serve_parser(subparsers: Any) -> None:
    """Register ``fitserve serve`` on the CLI's subparsers."""
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve (as `vllm serve MODEL`; the same as --model/-m)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=envs.FITSERVE_API_KEY(),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(env FITSERVE_API_KEY)")
    p.add_argument("--served-model-name", "--alias", dest="served_model_name", default=None,
                   help="the model id clients use (default: the model as given; llama.cpp's --alias)")
    p.add_argument("--max-logprobs", type=_max_logprobs, default=MAX_LOGPROBS, metavar="N",
                   help=f"the most logprobs (top alternatives) a request may ask for, 0..{MAX_LOGPROBS} "
                        "(vLLM's flag); more is a 400")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests before new ones get 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without --api-key (for Prometheus scrapers); the dashboard still needs it")
    p.add_argument("--allowed-origins", type=_origins, default=[],
                   help="CORS: origins browsers may call the API from, as a JSON list or comma-separated "
                        "('*' for any); CORS is off unless given")
    p.add_argument("--header-timeout", type=_positive, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a connection may stay open without starting a request (idle or slow "
                        "request head) before it is closed")
    p.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                   help="a larger request head gets 431")
    p.add_argument("--body-timeout", type=_positive, default=30.0,
                   help="seconds to receive a request body in full (else 408)")
    p.add_argument("--send-timeout", type=_positive, default=60.0,
                   help="seconds a stream write may wait on a client that does not read before the "
                        "request is aborted")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's global RNG")
    add_chat_template_arg(p)
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="run a chat_template a request sends (a template is code; refused with 400 otherwise)")
    _add_parser_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _add_sampling_default_args(p)
    from fitserve.fleet.args import add_fleet_args

    add_fleet_args(p)
    p.set_defaults(func=run_serve)


def _add_parser_args(p: Any) -> None:
    """vLLM's output parser flags: tool-call format, auto tool choice, reasoning split."""
    from fitserve.server.reasoning import REASONING_PARSERS
    from fitserve.server.tool_call_formats import TOOL_CALL_PARSERS

    p.add_argument("--tool-call-parser", default="hermes", choices=TOOL_CALL_PARSERS,
                   help="the format of the model's tool calls (default hermes: <tool_call> blocks)")
    # NOTE: vLLM refuses tool_choice "auto" without this flag; fitserve always parsed "auto"
    # (its default with tools), so the flag is accepted and changes nothing.
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: tool_choice 'auto' is always on")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split the model's <think> block into the chat message's reasoning_content")


def _positive(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return v


def _max_logprobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= value <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_LOGPROBS}, got {value}")
    return value


def _generation_config(text: str) -> str:
    """``auto``, ``vllm``, or a folder holding ``generation_config.json`` (checked now)."""
    from pathlib import Path

    if text in ("auto", "vllm"):
        return text
    if not (Path(text) / "generation_config.json").is_file():
        raise argparse.ArgumentTypeError(f"must be auto, vllm or a folder with generation_config.json, got {text!r}")
    return text


def resolve_model_tag(args: argparse.Namespace) -> None:
    """``fitserve serve MODEL``: the positional model, which --model/-m may repeat but not contradict."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model not in (DEFAULT_MODEL, tag):
        raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}")
    args.model = tag


def _origins(text: str) -> list[str]:
    """``["https://a", "https://b"]`` (vLLM's form) or ``https://a,https://b``."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return value
    return [o.strip() for o in text.split(",") if o.strip()]


def _add_sampling_default_args(p: Any) -> None:
    """What requests that omit a sampling field get (see fitserve.loading.generation_defaults)."""
    from fitserve.loading.generation_defaults import SERVER_DEFAULTS

    p.add_argument("--generation-config", default="auto", type=_generation_config, metavar="auto|vllm|FOLDER",
                   help="auto: the model's recommended sampling defaults (generation_config.json, "
                        "GGUF general.sampling.*); vllm: ignore them; a folder: read its "
                        "generation_config.json instead (vLLM's flag)")
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                       ("repetition_penalty", float)):
        p.add_argument(f"--default-{name.replace('_', '-')}", type=kind, default=None, dest=f"default_{name}",
                       help=f"{name} of requests that omit it; overrides the model's (built-in default "
                            f"when the model has none: {SERVER_DEFAULTS[name]})")


def _folder_defaults(mode: str) -> Any:
    """--generation-config FOLDER: that folder's sampling defaults (None for auto / vllm)."""
    if mode in ("auto", "vllm"):
        return None
    from pathlib import Path

    from fitserve.loading.generation_defaults import read_generation_defaults

    return read_generation_defaults(Path(mode))


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _run_replicas(args: argparse.Namespace, config: EngineConfig, settings: Any) -> int:
    """--replicas N: the same server, N times on Ray Serve behind one ingress (fitserve.fleet)."""
    from fitserve.fleet.launch import run_fleet
    from fitserve.fleet.routing import RoutingPolicy
    from fitserve.fleet.spec import FleetSpec, ReplicaGroup, ReplicaSpec, share_host_memory

    if config.tensor_parallel_size > 1 or args.threads is not None:
        print("fitserve serve: --replicas takes no --threads (each replica runs --replica-cpus "
              "threads) and no --tensor-parallel-size from the command line yet (a config from "
              "plan capacity --emit-ray-config sets it per group)", file=sys.stderr)
        return 2
    n = args.replicas or 1
    policy = RoutingPolicy(args.routing, balance_abs=args.routing_balance)
    try:
        if args.fleet_config is not None:  # replica groups from a file (plan capacity --emit-ray-config's)
            from fitserve.fleet.fleet_config import fleet_spec_from_args, load_fleet_args

            spec = fleet_spec_from_args(load_fleet_args(args.fleet_config), config, settings, policy,
                                        args.chat_template)
            return run_fleet(spec, args.host, args.port, args.ray_address)
        replica = ReplicaSpec(share_host_memory(config, n), settings, num_cpus=args.replica_cpus,
                              capacity=args.replica_capacity, chat_template=args.chat_template,
                              pull_default=args.model == "smollm2-135m")
        spec = FleetSpec((ReplicaGroup(replica, num_replicas=n),), policy=policy)
    except (ValueError, OSError) as exc:
        print(f"fitserve serve: {exc}", file=sys.stderr)
        return 2
    if args.model == "smollm2-135m":
        from fitserve.loading.pull import pull

        pull(args.model, progress=True)  # here for a local head's replicas; remote nodes pull their own
    return run_fleet(spec, args.host, args.port, args.ray_address)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model in the engine thread while uvicorn already answers /health (503)."""
    from fitserve.engine.core import Engine
    from fitserve.loading.generation_defaults import GenerationDefaults
    from fitserve.server.app import create_app
    from fitserve.server.engine_loop import EngineLoop
    from fitserve.server.metrics import Metrics
    from fitserve.server.protocol.common import DEFAULTED_FIELDS
    from fitserve.server.settings import ServerSettings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    resolve_model_tag(args)  # NOTE: a ValueError here (or below) is main()'s exit 2 with its message
    config: EngineConfig = engine_config_from_args(args)
    if args.seed:
        import dataclasses

        config = dataclasses.replace(config, seed=args.seed)
    settings = ServerSettings(
        model_name=args.served_model_name or args.model, api_key=args.api_key or None,
        max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes, metrics_public=args.metrics_public,
        body_timeout_s=args.body_timeout, send_timeout_s=args.send_timeout, allowed_origins=args.allowed_origins,
        generation_config="auto" if args.generation_config not in ("auto", "vllm") else args.generation_config,
        generation_defaults=_folder_defaults(args.generation_config), max_logprobs=args.max_logprobs,
        default_sampling={k: getattr(args, f"default_{k}") for k in DEFAULTED_FIELDS},
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
    )
    try:
        settings.resolve_sampling(GenerationDefaults())  # a bad --default-* value fails now
        config.validate()  # and a bad --scheduling-policy / SLO setting
    except ValueError as exc:
        print(f"fitserve serve: {exc}", file=sys.stderr)
        return 2
    if args.replicas is not None or args.ray_address is not None or args.fleet_config is not None:
        return _run_replicas(args, config, settings)
    if args.model == "smollm2-135m":
        from fitserve.loading.pull import pull

        pull(args.model, progress=True)  # a first run fetches the default model
    from fitserve.dist.group import launched_externally

    if launched_externally(config.tensor_parallel_size) and int(os.environ["RANK"]) != 0:
        # under torchrun, ranks > 0 serve rank 0's steps, not HTTP (no second bind of the port)
        from fitserve.dist.worker import run_worker

        return run_worker(config, int(os.environ["RANK"]), config.tensor_parallel_size, "env://")

    def load(cfg: EngineConfig) -> Engine:
        apply_threads_arg(args)  # NOTE: here, in the engine thread: OpenMP's thread count is per thread
        logging.getLogger("fitserve.server").info("torch CPU threads of the engine: %d", torch_threads())
        engine = Engine(cfg)
        if args.chat_template is not None:
            engine.tokenizer.chat_template = args.chat_template  # --chat-template replaces the model's
        logging.getLogger("fitserve.server").info(
            "sampling defaults for requests that omit them: %s",
            settings.resolve_sampling(engine.loaded.generation_defaults).describe())
        return engine

    loop = EngineLoop(config, Metrics(), engine_factory=load, warm_up=True)
    app = create_app(loop, settings)
    limits = raise_fd_limit()  # thousands of idle connections must not starve new ones
    if limits is not None and limits[1] < 4096:
        logging.getLogger("fitserve.server").warning(
            "the open-file limit is %d: at most that many connections at once (ulimit -n)", limits[1])
    protocol = GuardedH11Protocol.configured(header_timeout_s=args.header_timeout,
                                             max_header_bytes=args.max_header_bytes,
                                             send_buffer_bytes=256 * 1024)
    uv_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, http=protocol,
        timeout_graceful_shutdown=max(1, int(round(args.shutdown_timeout))), access_log=False,
    )
    server = _GracefulServer(uv_config, app.state.fitserve)
    # A model that cannot load ends the process (exit 1) rather than serving 503s forever.
    loop.on_load_error = lambda _exc: setattr(server, "should_exit", True)
    server.run()
    if loop.error is not None and not loop.ready:
        print(f"fitserve serve: engine failed: {loop.error}")
        return 1
    return 0
