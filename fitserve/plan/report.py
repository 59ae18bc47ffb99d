"""A whole plan as data: sections of lines, each with its formula's name and the arithmetic."""

from __future__ import annotations

from dataclasses import dataclass, field

from fitserve.config import EngineConfig
from fitserve.plan.errors import PlanError
from fitserve.plan.formats import dtype_bytes, resolve_kv_dtype, weight_format
from fitserve.plan.hardware import Hardware, cpu_engine_dtype, get_hardware
from fitserve.plan.kv import check_tp
from fitserve.plan.memory import DEFAULT_GPU_WORKSPACE_BYTES
from fitserve.plan.model_source import ModelEntry, resolve_model
from fitserve.plan.weights import model_weight_bytes

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


@dataclass(frozen=True)
class Section:
    title: str
    lines: tuple[Line, ...]
    notes: tuple[str, ...] = ()


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
    block_size: int = ENGINE_DEFAULTS.block_size
    memory_utilization: float = ENGINE_DEFAULTS.gpu_memory_utilization
    max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens
    max_num_seqs: int | None = None  # None: the engine's default, raised to concurrency
    workspace_bytes: int | None = None  # None: 1 GiB on a GPU, 0 on cpu
    allow_longer_context: bool = False
    dtype: str = "auto"  # the engine's --dtype: model/activation dtype ("auto" as the engine)
    kv_cache_memory_bytes: int | None = None  # the engine's --kv-cache-memory
    num_kv_blocks: int | None = None  # the engine's --num-kv-blocks


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

    @property
    def on_cpu(self) -> bool:
        """Planning fitserve's own engine on this machine's CPU (host memory, fixed KV pool)."""
        return self.hw.name == "cpu"


def resolve(req: PlanRequest) -> Resolved:
    """Validate a request (raises PlanError with a clear message) and fill in defaults."""
    entry = resolve_model(req.model)
    hw = get_hardware(req.gpu)
    spec = entry.spec
    check_tp(spec, req.tp)
    if req.gpus < req.tp:
        raise PlanError(f"--tp {req.tp} needs at least {req.tp} GPUs, --gpus is {req.gpus}")
    if req.gpus % req.tp:
        raise PlanError(f"--gpus {req.gpus} is not a multiple of --tp {req.tp}")
    if req.concurrency < 1 or req.block_size < 1:
        raise PlanError("--concurrency and --block-size must be >= 1")
    warnings: list[str] = []
    hypothetical = req.context > spec.max_position_embeddings
    if hypothetical:
        limit = f"{spec.name}'s maximum context is {spec.max_position_embeddings} tokens"
        if not req.allow_longer_context:
            raise PlanError(f"--context {req.context_text} = {req.context} tokens, but {limit}; "
                            f"pass --allow-longer-context for a hypothetical plan")
        warnings.append(f"HYPOTHETICAL: {limit}; this plan is for a context the model was "
                        f"not trained for")
    act = _act_dtype(req, entry, hw)
    gguf_main = entry.native_weights.removeprefix("gguf-file:")
    on_cpu = hw.name == "cpu"
    weights = req.weights or (act if on_cpu else gguf_main)
    base = act if on_cpu else "bf16"
    model_weight_bytes(spec, weights, tp=req.tp, base_dtype=base)  # validates the format early
    kv = resolve_kv_dtype(req.kv or "auto", act)
    if on_cpu:
        warnings += _cpu_engine_warnings(req, weights, kv, act)
    elif entry.file_weight_bytes is not None and req.weights is None:
        warnings.append(f"GGUF file: the weights line is the file's own tensor bytes "
                        f"({entry.file_weight_bytes:,} B); {weights} lines are the ledger's")
    ws = req.workspace_bytes if req.workspace_bytes is not None else (
        0 if on_cpu else DEFAULT_GPU_WORKSPACE_BYTES)
    seqs = req.max_num_seqs or max(ENGINE_DEFAULTS.max_num_seqs, req.concurrency)
    return Resolved(req, entry, hw, weights, kv, dtype_bytes(act), seqs, ws, hypothetical,
                    tuple(warnings), act, base, _weights_note(entry, weights, act, on_cpu))


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
    if kv != act:
        out.append(f"HYPOTHETICAL for fitserve on cpu: the engine's KV cache is in the model "
                   f"dtype ({act}), not {kv}")
    return out


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
