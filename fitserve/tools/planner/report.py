"""A whole plan as data: sections of lines, each with its formula's name and the arithmetic."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fitserve.config import EngineConfig, ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import (
    ENGINE_WEIGHT_CHOICES,
    GGML_HELD_TYPES,
    dtype_bytes,
    kv_format,
    resolve_engine_weights,
    resolve_kv_dtype,
    weight_format,
)
from fitserve.ledger.hardware import Hardware, cpu_engine_dtype, get_hardware
from fitserve.ledger.kv import check_tp
from fitserve.ledger.memory import DEFAULT_GPU_WORKSPACE_BYTES
from fitserve.ledger.tp_split import check_tp_split
from fitserve.ledger.units import fmt_bytes
from fitserve.ledger.weights import (
    MIXES,
    WeightBytes,
    engine_format_rule,
    engine_held_formats,
    engine_main_format,
    engine_read_weight_bytes,
    engine_runs,
    model_weight_bytes,
)
from fitserve.tools.planner.model_source import ModelEntry, resolve_model

GIB = 1 << 30
# NOTE: the planner's engine knobs default to the engine's own defaults, read from EngineConfig
# so that `fitserve plan` and `fitserve generate/serve` cannot drift apart.
ENGINE_DEFAULTS = EngineConfig()


@dataclass(frozen=True)
class Line:
    """One figure: ``formula`` names the ledger formula; ``explain`` fills in its numbers."""

    name: str
    formula: str
    value: float | int | str | None
    shown: str
    explain: str = ""
    miss: str = ""  # non-empty: this line is why the plan does not fit, and by how much


@dataclass(frozen=True)
class Section:
    title: str
    lines: tuple[Line, ...]
    notes: tuple[str, ...] = ()


# NOTE: PlanRequest.context == MODEL_CONTEXT plans at the model's own trained context (a GGUF's
# context_length, a config's max_position_embeddings), as the engine's --max-model-len defaults
# and vLLM's max_model_len does; nothing bounds it further (a context that does not fit is a
# miss with "would fit: --context N", vLLM's "estimated maximum model length").
MODEL_CONTEXT = 0


@dataclass(frozen=True)
class PlanRequest:
    model: str
    gpu: str = "h100"
    gpus: int = 1
    tp: int = 1
    context: int = 8192
    context_text: str = "8192"
    weights: str | None = None  # None: the checkpoint's native format
    kv: str | None = None  # None: the activation dtype
    concurrency: int = 1
    block_size: int = ENGINE_DEFAULTS.cache.block_size
    memory_utilization: float = ENGINE_DEFAULTS.cache.gpu_memory_utilization
    max_num_batched_tokens: int = ENGINE_DEFAULTS.scheduler.max_num_batched_tokens
    max_num_seqs: int | None = None  # None: the engine's default, raised to concurrency
    workspace_bytes: int | None = None  # None: 1 GiB on a GPU, 0 on cpu
    dtype: str = "auto"  # the engine's --dtype: model/activation dtype ("auto" as the engine)
    kv_cache_memory_bytes: int | None = None  # the engine's --kv-cache-memory
    num_kv_blocks: int | None = None  # the engine's --num-kv-blocks
    gpu_memory_bytes: int | None = None  # what-if: replaces the accelerator's memory
    gpu_bandwidth: float | None = None  # what-if: replaces its memory bandwidth, B/s
    # KV sharing: ``share`` sequences (n samples or beams) over one prompt of ``prompt_tokens``
    # (None: the context less new_tokens), each generating ``new_tokens``; 1 = no section
    share: int = 1
    prompt_tokens: int | None = None
    new_tokens: int = 0
    # speculative decoding economics: (k draft tokens, acceptance alpha, draft step / target
    # step); None = no section
    speculative: tuple[int, float, float] | None = None
    # SLO scheduling: a TPOT target (ms) prices the step-time model's chunk cap and knee;
    # None = no section
    slo_tpot_ms: float | None = None
    # the workload section (vllm bench throughput's --input-len / --output-len and a batch of
    # --batch-size requests); defaults: benchmarks/bench_engine.py's W2 shape
    input_len: int = 128
    output_len: int = 128
    batch_size: int = 32


@dataclass(frozen=True)
class Resolved:
    """The inputs of a plan after defaults and validation."""

    req: PlanRequest
    entry: ModelEntry
    hw: Hardware
    weights: str
    kv_dtype: str
    act_bytes: int
    max_num_seqs: int
    workspace_bytes: int
    hypothetical: bool
    warnings: tuple[str, ...] = field(default=())
    act_dtype: str = "bf16"
    base_dtype: str = "bf16"  # embedding / lm_head / vectors of a plain weight format
    weights_note: str = ""
    # fitserve's engine on cpu: its resolved --weights choice ("as-stored", "int4", "int8" or a
    # dense dtype; plan.formats.resolve_engine_weights); None for a hypothetical format
    engine_weights: str | None = None

    @property
    def on_cpu(self) -> bool:
        """Planning fitserve's own engine on this machine's CPU (host memory, fixed KV pool)."""
        return self.hw.name == "cpu"


def resolve(req: PlanRequest, *, entry: ModelEntry | None = None,
            hw: Hardware | None = None) -> Resolved:
    """Validate a request (raises PlanError with a clear message) and fill in defaults.

    ``entry`` and ``hw`` skip looking the model and the accelerator up again (variants of one
    request, see ``plan.fit``). Input that cannot be planned raises; a plan that does not fit
    does not: ``plan.fit`` says by how much it misses.
    """
    entry = entry or resolve_model(req.model)
    if req.context == MODEL_CONTEXT:
        own = entry.spec.max_position_embeddings
        req = dataclasses.replace(req, context=own, context_text=f"{own} (the model's own)")
    check_inputs(req)
    hw = hw or _with_overrides(get_hardware(req.gpu), req)
    spec = entry.spec
    check_tp(spec, req.tp)
    if req.gpus < req.tp:
        raise PlanError(f"--tp {req.tp} needs at least {req.tp} GPUs, --gpus is {req.gpus}")
    if req.gpus % req.tp:
        raise PlanError(f"--gpus {req.gpus} is not a multiple of --tp {req.tp}")
    warnings = _override_warnings(req, hw)
    hypothetical = req.context > spec.max_position_embeddings
    if hypothetical:
        warnings.append(_longer_context_warning(req, spec))
    act = _act_dtype(req, entry, hw)
    gguf_main = entry.native_weights.removeprefix("gguf-file:")
    on_cpu = hw.name == "cpu"
    engine_weights: str | None = None
    moe_as_stored = on_cpu and req.weights is None and spec.num_experts and gguf_main in MIXES
    if moe_as_stored:
        # NOTE: an MoE checkpoint whose experts are stored quantized (gpt-oss: MXFP4) runs its
        # experts as stored on cpu and the rest in the checkpoint's bf16: the mix itself.
        weights = gguf_main
    elif on_cpu and (req.weights is None or req.weights in ENGINE_WEIGHT_CHOICES):
        # the engine's own --weights rule (a dense choice is also the model dtype)
        engine_weights, dtype_arg = resolve_engine_weights(req.weights or "auto", None, req.dtype)
        if dtype_arg != req.dtype:
            act = weight_format(dtype_arg).name
        weights = engine_main_format(spec, act, stored=entry.stored_formats,
                                     rule=engine_format_rule(engine_weights, act))
    else:
        weights = req.weights or (act if on_cpu else gguf_main)
    base = act if on_cpu else "bf16"
    model_weight_bytes(spec, weights, tp=req.tp, base_dtype=base)  # validates the format early
    check_tp_split(spec, req.tp, weights, base)  # the engine's split rule for this format
    kv = resolve_kv_dtype(req.kv or "auto", act)
    if on_cpu:
        warnings += _cpu_engine_warnings(req, act if engine_weights else weights, kv, act)
    elif entry.file_weight_bytes is not None and req.weights is None:
        warnings.append(f"GGUF file: the weights line is the file's own tensor bytes "
                        f"({entry.file_weight_bytes:,} B); {weights} lines are the ledger's")
    ws = req.workspace_bytes if req.workspace_bytes is not None else (
        0 if on_cpu else DEFAULT_GPU_WORKSPACE_BYTES)
    seqs = req.max_num_seqs or max(ENGINE_DEFAULTS.scheduler.max_num_seqs, req.concurrency)
    note = (f"{weights} checkpoint: routed experts held as stored, the rest as the mix "
            f"stores them ({MIXES[weights].source})" if moe_as_stored
            else _engine_weights_note(entry, engine_weights, act) if engine_weights
            else _weights_note(entry, weights, act, on_cpu))
    return Resolved(req, entry, hw, weights, kv, dtype_bytes(act), seqs, ws, hypothetical,
                    tuple(warnings), act, base, note, engine_weights)


def speed_weights(r: Resolved) -> WeightBytes:
    """The weights the speed lines read per step on one rank: on cpu (tp 1, a model the
    engine runs under its --weights rule) the tensors as the engine holds them
    (``engine_read_weight_bytes``: the default Q4_1 file's tied lm_head as int8, not bf16);
    else the ledger's count of the format or mix."""
    s = r.entry.spec
    if r.on_cpu and r.engine_weights is not None and r.req.tp == 1 and engine_runs(s):
        return engine_read_weight_bytes(s, r.act_dtype, stored=r.entry.stored_formats,
                                        rule=engine_format_rule(r.engine_weights, r.act_dtype))
    return model_weight_bytes(s, r.weights, tp=r.req.tp, base_dtype=r.base_dtype)


def check_inputs(req: PlanRequest) -> None:
    """Raise PlanError for input no machine could plan: sizes < 0, counts < 1, no bandwidth."""
    counts = {"--concurrency": req.concurrency, "--block-size": req.block_size,
              "--gpus": req.gpus, "--max-num-batched-tokens": req.max_num_batched_tokens,
              "--max-num-seqs": 1 if req.max_num_seqs is None else req.max_num_seqs,
              "--context": req.context, "--input-len": req.input_len,
              "--output-len": req.output_len, "--batch-size": req.batch_size}
    for flag, n in counts.items():
        if n < 1:
            raise PlanError(f"{flag} must be >= 1, got {n}")
    sizes = {"--workspace-gib": req.workspace_bytes, "--kv-cache-memory": req.kv_cache_memory_bytes}
    for flag, b in sizes.items():
        if b is not None and b < 0:
            raise PlanError(f"{flag} must be >= 0, got {b:,} B")
    if not 0.0 < req.memory_utilization <= 1.0:
        raise PlanError(f"--memory-utilization must be in (0, 1], got {req.memory_utilization}")
    if req.gpu_memory_bytes is not None and req.gpu_memory_bytes <= 0:
        raise PlanError(f"--gpu-memory must be > 0 bytes, got {req.gpu_memory_bytes:,}")
    if req.slo_tpot_ms is not None and not 0 < req.slo_tpot_ms < math.inf:
        raise PlanError(f"--slo-tpot-ms must be > 0 and finite, got {req.slo_tpot_ms:g}")
    if req.gpu_bandwidth is not None and not 0 < req.gpu_bandwidth < math.inf:
        raise PlanError(f"--gpu-bandwidth must be > 0 B/s and finite, got "
                        f"{req.gpu_bandwidth:g}: a roofline needs a real bandwidth")


def _with_overrides(hw: Hardware, req: PlanRequest) -> Hardware:
    """The accelerator with --gpu-memory / --gpu-bandwidth in place of its sheet figures."""
    if req.gpu_memory_bytes is not None:
        hw = dataclasses.replace(hw, memory_bytes=req.gpu_memory_bytes)
    if req.gpu_bandwidth is not None:
        hw = dataclasses.replace(hw, mem_bytes_per_s=req.gpu_bandwidth)
    return hw


def _override_warnings(req: PlanRequest, hw: Hardware) -> list[str]:
    out: list[str] = []
    if req.gpu_memory_bytes is not None:
        out.append(f"WHAT-IF: {hw.name} with {fmt_bytes(hw.memory_bytes)} "
                   f"({hw.memory_bytes:,} B) of memory per device (--gpu-memory)")
    if req.gpu_bandwidth is not None:
        out.append(f"WHAT-IF: {hw.name} with {hw.mem_bytes_per_s:.4g} B/s of memory bandwidth "
                   f"(--gpu-bandwidth)")
    return out


def _longer_context_warning(req: PlanRequest, spec: ModelSpec) -> str:
    """Past the trained context the ledger still holds (bytes and FLOPs grow as they do), but
    nothing says the model's output does: plan it, say so (vLLM refuses such a max_model_len
    unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; a planner answers the question instead)."""
    trained = spec.max_position_embeddings
    rope = spec.rope_scaling
    how = (f" (its {rope.kind} RoPE scaling x{rope.factor:g} was fitted up to {trained:,})"
           if rope is not None else "")
    return (f"HYPOTHETICAL: --context {req.context_text} = {req.context:,} tokens is "
            f"{req.context / trained:.3g}x {spec.name or spec.architecture}'s trained maximum of "
            f"{trained:,} tokens (max_position_embeddings){how}; the memory and speed lines "
            f"hold, output quality past {trained:,} tokens is unknown; the engine needs "
            f"--max-model-len {req.context}")


def _act_dtype(req: PlanRequest, entry: ModelEntry, hw: Hardware) -> str:
    """The engine's model dtype: --dtype, or "auto" resolved as the engine resolves it."""
    if req.dtype != "auto":
        name = weight_format(req.dtype).name
        dtype_bytes(name)  # only plain float dtypes
        return name
    if hw.name == "cpu":
        return cpu_engine_dtype()  # bf16 where the CPU has AVX512-BF16/AMX, else f32
    return "bf16" if entry.dtype not in ("bf16", "f16") else entry.dtype


def _cpu_engine_warnings(req: PlanRequest, weights: str, kv: str, act: str) -> list[str]:
    out = []
    if req.weights is not None and weights != act:
        out.append(f"HYPOTHETICAL for fitserve on cpu: the engine holds weights in the model "
                   f"dtype ({act}), not {weights}")
    if kv != act and not kv_format(kv).codec:  # quantized formats the engine runs have a codec
        out.append(f"HYPOTHETICAL for fitserve on cpu: the engine's KV cache is in the model "
                   f"dtype ({act}) or one of its quantized formats (int8, fp8_e4m3, fp8_e5m2, "
                   f"with -kc for per-channel keys), not {kv}")
    return out


def _engine_weights_note(entry: ModelEntry, choice: str, act: str) -> str:
    """How fitserve's engine holds the weights for a --weights choice, in words."""
    counts = engine_held_formats(entry.spec, act, stored=entry.stored_formats,
                                 rule=engine_format_rule(choice, act))
    packed = [f for f in counts if weight_format(f).packed is not None or f in GGML_HELD_TYPES]
    if not packed:
        return _weights_note(entry, act, act, True)
    stored = entry.engine_file_format or entry.native_weights.removeprefix("gguf-file:")
    kind = "file" if entry.engine_file_format or entry.file_weight_bytes is not None else (
        "checkpoint")
    how = "held as stored" if choice == "as-stored" else f"RTN-quantized to {choice} on load"
    return f"{stored} {kind} {how}: {', '.join(packed)} packed, the rest in {act}"


def _weights_note(entry: ModelEntry, weights: str, act: str, on_cpu: bool) -> str:
    if not on_cpu or weights != act:
        return ""
    stored = entry.engine_file_format or entry.native_weights.removeprefix("gguf-file:")
    kind = "file" if entry.engine_file_format or entry.file_weight_bytes is not None else (
        "checkpoint")
    try:
        how = "dequantized" if weight_format(stored).gguf else "converted"
    except PlanError:
        how = "converted"
    if stored == act:
        return f"{stored} {kind} loaded as {act}"
    return f"{stored} {kind} {how} to {act} on load"
