"""Build an engine's parts from its config: load, size, wire. The core loop gets them as one
frozen record and builds nothing itself.

    config -> device, dtype, weights choice -> load the model -> build it (or rank 0's shard
    under --tp) -> check the weights against the ledger -> size the KV pool with the ledger ->
    KV manager, scheduler, runner (checked against the ledger too) -> compiled decode steps ->
    the speculative proposer

Every size comes from the ledger (fitserve.ledger, through fitserve.engine.sizing), and the two
checks here (weights held, KV cache allocated) fail start-up if the engine and the ledger ever
disagree.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from fitserve.config import EngineConfig, ModelSpec, SpeculativeConfig
from fitserve.dist.engine_tp import TPModelRunner, start_tensor_parallel
from fitserve.dist.group import TPGroup
from fitserve.engine.sizing import KVPoolSize, check_pool_fits, engine_kv_format, size_kv_pool
from fitserve.kv.group import KVGroup
from fitserve.kv.manager import KVCacheManager
from fitserve.ledger.formats import resolve_engine_weights
from fitserve.ledger.sampler_memory import prompt_logprob_chunk_rows
from fitserve.ledger.weights import engine_format_rule, engine_weight_bytes
from fitserve.loading import LoadedModel, load_model
from fitserve.loading.tokenizer import Tokenizer
from fitserve.model.ggml_linear import runs_ggml_kernels
from fitserve.model.linear import (
    cpp_ops_available,
    hold_linears_as_panels,
    holds_panels,
    set_activation_quant,
)
from fitserve.model.llama import CausalLM
from fitserve.model.loader import build_model, check_supported, held_weight_bytes
from fitserve.quant.convert import loaded_weights_choice
from fitserve.runner.model_runner import ModelRunner
from fitserve.runner.placement import (
    check_max_model_len,
    dtype_name,
    release_freed_host_memory,
    resolve_device,
    resolve_dtype,
)
from fitserve.sched.scheduler import Scheduler
from fitserve.spec_decode.rejection import verify as verify_drafts
from fitserve.spec_decode.speculative import SpeculativeDecoding, build_proposer

log = logging.getLogger("fitserve.engine")

COMPILED_BATCH_SIZES = (1, 2, 17)
"""Decode batch sizes whose compiled steps are built at start-up (one per batch class)."""


@dataclass(frozen=True, slots=True)
class EngineParts:
    """Everything an engine runs with, built once by :func:`build_engine_parts`."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    loaded: LoadedModel  # its weights dict is emptied once the model holds them
    weights_choice: str  # "as-stored", "int4", "int8" or a dense dtype: how tensors are held
    spec: ModelSpec  # the whole model's
    tokenizer: Tokenizer
    max_model_len: int
    tp_group: TPGroup | None  # the tensor-parallel group this process leads (None: no --tp)
    pool: KVPoolSize  # the KV pool and the ledger lines it was sized from
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner  # a TPModelRunner under --tp
    spec_decode: SpeculativeDecoding | None
    startup_seconds: dict[str, float] = field(default_factory=dict)  # "load", "compile"


def build_engine_parts(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """Load ``config.model`` (or take ``loaded``) and build every part sized by the ledger;
    ValueError for a bad setting (before anything is loaded where it can be told then)."""
    t_start = time.perf_counter()
    cfg = config
    device = resolve_device(cfg.device)
    choice, dtype_arg = resolve_engine_weights(cfg.weights, cfg.quantization, cfg.dtype)
    dtype = resolve_dtype(dtype_arg, device)
    engine_kv_format(cfg, dtype)  # a bad --kv-cache-dtype/-scales fails before loading
    cfg.validate()  # and every other bad setting (--scheduling-policy, SLO targets, ...)
    given = loaded is not None
    if loaded is None:
        loaded = load_model(cfg.model, dtype=dtype, weights=choice)
        log.info("read %s (%s %s) in %.1f s", loaded.path.name, loaded.file_format,
                 loaded.weight_format, time.perf_counter() - t_start)
    explicit = cfg.weights != "auto" or cfg.quantization is not None
    weights_choice = loaded_weights_choice(loaded.weights_choice, choice, explicit=explicit,
                                           dtype=dtype)
    if (device.type == "cpu" and weights_choice in ("as-stored", "int4", "int8")
            and not cpp_ops_available()):
        log.warning("packed weights (%s) but the C++ int4/int8 kernels are unavailable: they "
                    "run on the pure-torch path, ~10x slower than dense; pass --weights "
                    "bf16 (or install a C++ compiler) for speed", weights_choice)
    spec = loaded.spec
    check_supported(spec)
    max_model_len = check_max_model_len(cfg.max_model_len, spec)
    tp_group: TPGroup | None = None
    shard_spec = spec  # the spec of the shard this process holds: rank 0's under --tp
    if cfg.tensor_parallel_size > 1:
        tp_group, model, shard_spec = start_tensor_parallel(
            cfg, loaded, dtype=dtype, device=device, max_positions=max_model_len)
    else:
        # NOTE: a model this builder loaded hands its weights over (the engine keeps none of
        # them, see below), so each fused part is freed as it goes and the load peaks at the
        # ledger's weights; a given LoadedModel keeps its dict (the caller may build again)
        weights = loaded.weights
        if not given:
            loaded.weights = {}
        model = build_model(spec, weights, dtype=dtype, device=device,
                            max_positions=max_model_len, consume=not given)
        del weights
        log.info("built the model (%s, %d layers) at %.1f s", spec.architecture, spec.num_layers,
                 time.perf_counter() - t_start)
    log.info(set_activation_quant(model, cfg.activation_quant, dtype))
    log.info(hold_linears_as_panels(model))
    try:
        pool, kv, scheduler, runner = _size_and_wire(
            cfg, model, spec, shard_spec, loaded, tp_group, weights_choice=weights_choice,
            dtype=dtype, device=device, max_model_len=max_model_len, given=given)
        startup = {"load": time.perf_counter() - t_start}
        _compile_decode_steps(cfg, runner, startup)
        spec_decode = None if cfg.speculative is None else _speculative(
            cfg.speculative, spec, runner, kv, dtype=dtype, device=device,
            max_model_len=max_model_len)
    except BaseException:
        if tp_group is not None:
            tp_group.shutdown()  # the workers would wait for steps that never come
        raise
    return EngineParts(cfg, device, dtype, loaded, weights_choice, spec, loaded.tokenizer,
                       max_model_len, tp_group, pool, kv, scheduler, runner, spec_decode, startup)


def _size_and_wire(cfg: EngineConfig, model: CausalLM, spec: ModelSpec, shard_spec: ModelSpec,
                   loaded: LoadedModel, tp_group: TPGroup | None, *, weights_choice: str,
                   dtype: torch.dtype, device: torch.device, max_model_len: int, given: bool
                   ) -> tuple[KVPoolSize, KVCacheManager, Scheduler, ModelRunner]:
    """Check the built model against the weight ledger, size the KV pool from the ledger, and
    build the KV manager, the scheduler and the runner (whose cache is checked too)."""
    if not given:
        loaded.weights = {}  # the model holds its own copies; don't keep two
    if device.type == "cpu":
        # Hand the loader's freed scratch back to the OS before the KV pool is allocated,
        # so the process peak is what the ledger says (see release_freed_host_memory).
        release_freed_host_memory()
    # One ledger: the planner's function counts the weights; the model must hold exactly that.
    dname = dtype_name(dtype)
    held = held_weight_bytes(model)  # parameters and packed buffers, each tensor once
    weight_bytes = engine_weight_bytes(shard_spec, dname, stored=loaded.stored_formats,
                                       rule=engine_format_rule(weights_choice, dname),
                                       panels=holds_panels(model))
    if held != weight_bytes:
        raise RuntimeError(f"the model holds {held:,} B of weights, the ledger says "
                           f"{weight_bytes:,} B (fitserve.ledger.weights.engine_weight_bytes)")
    pool = size_kv_pool(cfg, shard_spec, dtype, device, weight_bytes,
                        output_staging=runs_ggml_kernels(model, dtype))
    log.info("weights %.1f MiB as the ledger counts them; KV cache %d blocks, %.1f MiB",
             weight_bytes / 2**20, pool.num_blocks, pool.allocated_bytes / 2**20)
    sched = cfg.scheduler
    check_pool_fits(pool, max_model_len, min(sched.max_num_batched_tokens,
                                             sched.long_prefill_token_threshold or max_model_len))
    cache = cfg.cache
    kv, groups = _kv_manager(pool, cfg, spec)
    if tp_group is not None:
        tp_group.send_startup(pool.num_blocks, groups if len(groups) > 1 else [])
    # the scheduler's max_model_len is the one resolved from the config and the model (as vLLM)
    scheduler = Scheduler(replace(cfg.scheduler, max_model_len=max_model_len), kv)
    runner = (ModelRunner if tp_group is None else TPModelRunner)(
        model, shard_spec, num_blocks=pool.num_blocks, block_size=cache.block_size,  # type: ignore[arg-type]
        kv_dtype=dtype, device=device,
        # NOTE: under --tp every step runs eager (collectives inside a compiled graph: later)
        # NOTE: nor for a mixture-of-experts model: which experts run (and over how many
        # tokens) is data, so the step is no single graph (_compile_decode_steps says so)
        compile_decode=not cfg.enforce_eager and tp_group is None and not spec.num_experts,
        kv_cache_dtype=cache.kv_cache_dtype, kv_cache_scales=cache.kv_cache_scales,
        verify=None if cfg.speculative is None else verify_drafts,
        kv_groups=groups if len(groups) > 1 else (),
        prompt_logprob_chunk_rows=prompt_logprob_chunk_rows(spec.vocab_size,
                                                            cfg.scheduler.max_num_seqs),
    )
    if isinstance(runner, TPModelRunner):
        assert tp_group is not None
        runner.attach(tp_group, spec, dtype)
    if runner.kv_cache_bytes != pool.allocated_bytes:
        raise RuntimeError(f"the KV cache holds {runner.kv_cache_bytes:,} B, the ledger says "
                           f"{pool.allocated_bytes:,} B ({pool.num_blocks} blocks of "
                           f"{pool.block_bytes:,} B)")
    return pool, kv, scheduler, runner


def _kv_manager(pool: KVPoolSize, cfg: EngineConfig, spec: ModelSpec
                ) -> tuple[KVCacheManager, list[KVGroup]]:
    """The KV manager over the ledger's pools: one per layer group for a model with
    sliding-window layers (their blocks are freed behind the window), else the one pool."""
    cache = cfg.cache
    caching = cache.enable_prefix_caching
    if caching and spec.rope_scaling is not None and spec.rope_scaling.kind == "longrope":
        # NOTE: a LongRoPE key's rotation depends on its sequence (long factors when the prompt
        # passes the original context, fitserve.runner.rope_rows): a block hashed by its
        # tokens alone could hand a short-prompt request long-rotated keys
        log.warning("prefix caching is off for LongRoPE models (%s): cached keys' rotation "
                    "depends on the prompt length", spec.architecture)
        caching = False
    plan_groups = pool.memory_plan.kv_groups if pool.memory_plan is not None else ()
    if not plan_groups:
        return KVCacheManager(pool.num_blocks, cache.block_size, enable_caching=caching), []
    if len(plan_groups) > 1 and cfg.speculative is not None and cfg.speculative.method == "draft_model":
        raise ValueError("a model mixing sliding-window and full-attention layers cannot use a "
                         "draft model yet (its lookahead slots come from one block table); use "
                         "--speculative-method ngram")
    groups = [KVGroup(g.kind, g.num_blocks, g.window, g.layers) for g in plan_groups]
    return KVCacheManager.from_groups(groups, cache.block_size, enable_caching=caching), groups


def _compile_decode_steps(cfg: EngineConfig, runner: ModelRunner, startup: dict[str, float]
                          ) -> None:
    """Build the compiled decode steps at start-up (cold: builds code; warm: loads it from
    $FITSERVE_HOME/compile), timing it into ``startup["compile"]``."""
    if runner.compiled is not None:
        t0 = time.perf_counter()
        sizes = [n for n in COMPILED_BATCH_SIZES if n <= cfg.scheduler.max_num_seqs]
        per_class = runner.warm_up_compiled(sizes)
        startup["compile"] = time.perf_counter() - t0
        log.info("decode step compiled in %.1f s (%s)", startup["compile"],
                 ", ".join(f"{k}: {v:.1f} s" for k, v in per_class.items()))
    elif not cfg.enforce_eager and runner.spec.num_experts:
        log.warning("--compile: the decode step of a mixture-of-experts model runs eager (its "
                    "expert routing is data-dependent: no single graph)")
    elif not cfg.enforce_eager:
        log.warning("--compile: the decode step runs eager here (compiled steps need the "
                    "CPU device and the C++ paged attention kernel)")


def _speculative(config: SpeculativeConfig, spec: ModelSpec, runner: ModelRunner,
                 kv: KVCacheManager, *, dtype: torch.dtype, device: torch.device,
                 max_model_len: int) -> SpeculativeDecoding:
    proposer = build_proposer(config, target=spec, runner=runner, kv=kv, dtype=dtype,
                              device=device, max_model_len=max_model_len)
    return SpeculativeDecoding(config, proposer, max_model_len=max_model_len)
