"""A whole plan as data: sections of lines, each with its formula's name and the arithmetic."""

from __future__ import annotations

from dataclasses import dataclass, field

from fitserve.plan.errors import PlanError
from fitserve.plan.formats import dtype_bytes, resolve_kv_dtype
from fitserve.plan.hardware import Hardware, get_hardware
from fitserve.plan.kv import check_tp
from fitserve.plan.model_source import ModelEntry, resolve_model
from fitserve.plan.weights import model_weight_bytes

GIB = 1 << 30


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
    block_size: int = 16
    memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int | None = None  # None: = concurrency
    workspace_bytes: int | None = None  # None: 1 GiB on a GPU, 0 on cpu
    allow_longer_context: bool = False


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
    act = "bf16" if entry.dtype not in ("bf16", "f16") else entry.dtype
    gguf_main = entry.native_weights.removeprefix("gguf-file:")
    weights = req.weights or gguf_main
    model_weight_bytes(spec, weights, tp=req.tp)  # validates the format name early
    kv = resolve_kv_dtype(req.kv or "auto", act)
    if entry.file_weight_bytes is not None and req.weights is None:
        warnings.append(f"GGUF file: the weights line is the file's own tensor bytes "
                        f"({entry.file_weight_bytes:,} B); {weights} lines are the ledger's")
    ws = req.workspace_bytes if req.workspace_bytes is not None else (
        0 if hw.name == "cpu" else GIB)
    return Resolved(req, entry, hw, weights, kv, dtype_bytes(act),
                    req.max_num_seqs or req.concurrency, ws, hypothetical, tuple(warnings))
