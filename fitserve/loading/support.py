"""Can the engine run this file? One torch-free check, for the engine's loader and the planner.

Reads only a GGUF header (or an HF config.json) and names *every* part the engine lacks, not
the first: the architecture (``fitserve.config.SUPPORTED_ARCHITECTURES``, then what the
strict header reader and ``spec_problems`` refuse for a supported one), each tensor type the
loader cannot read (``SUPPORTED_GGUF_TYPES``) and the tokenizer model
(``SUPPORTED_GGUF_TOKENIZER_MODELS``). Those lists live here or in fitserve.config, once:
the loader checks against the same tuples, so widening one widens the engine and this check
together.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fitserve.config import (
    GEMMA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelSpec,
)
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.gguf_spec import (
    SUPPORTED_GGUF_TYPES,
    GGUFHeader,
    spec_from_gguf_header,
    unsupported_types,
)

# tokenizer.ggml.model values fitserve.loading.gguf.tokenizer_from_gguf builds
from fitserve.loading.gguf_vocab import (
    SUPPORTED_TOKENIZER_MODELS as SUPPORTED_GGUF_TOKENIZER_MODELS,
)
from fitserve.loading.hf_config import (
    FITSERVE_QUANT_METHOD,
    check_engine_spec,
    packed_formats,
    read_json,
    spec_from_hf_config,
)
from fitserve.loading.hf_quant_config import (
    MXFP4_METHOD,
    PREQUANT_METHODS,
    quant_method,
    quant_problems,
)

# NOTE: tensors the GGUF loader skips (llama3 RoPE factors, read as metadata).
SKIPPED_GGUF_TENSORS = frozenset({"rope_freqs.weight"})


class EngineCannotRunError(ModelLoadError):
    """The engine lacks one or more parts this model needs; ``missing`` names each."""

    def __init__(self, source: object, missing: tuple[str, ...]) -> None:
        self.missing = missing
        super().__init__(f"{source}: the engine cannot run this model ({'; '.join(missing)})")


@dataclass(frozen=True, slots=True)
class EngineSupport:
    """What the engine lacks for one model file (empty ``missing``: it can run it)."""

    source: str
    missing: tuple[str, ...] = ()

    @property
    def runnable(self) -> bool:
        return not self.missing

    def require(self) -> None:
        """Raise :class:`EngineCannotRunError` naming every missing part, if any."""
        if self.missing:
            raise EngineCannotRunError(self.source, self.missing)


def spec_problems(spec: ModelSpec) -> list[str]:
    """What the engine's model code cannot run in a spec it could read (each in words)."""
    out = []
    if spec.architecture not in SUPPORTED_ARCHITECTURES:
        out.append(f"architecture {spec.architecture!r} is not supported by the engine "
                   f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    out += _moe_problems(spec)
    act = "gelu_pytorch_tanh" if spec.architecture in GEMMA_ARCHITECTURES else "silu"
    if spec.hidden_act != act:
        out.append(f"activation {spec.hidden_act!r} is not supported for {spec.architecture} "
                   f"(only {act})")
    if spec.num_heads % spec.num_kv_heads:
        out.append(f"num_heads={spec.num_heads} is not a multiple of "
                   f"num_kv_heads={spec.num_kv_heads}")
    return out


def _moe_problems(spec: ModelSpec) -> list[str]:
    """What the expert block (fitserve.model.moe) cannot run in a mixture-of-experts spec."""
    if not spec.num_experts:
        return []
    if spec.architecture not in MOE_ARCHITECTURES:
        return [f"mixture-of-experts {spec.architecture!r} is not supported by the engine "
                f"(experts run for {', '.join(MOE_ARCHITECTURES)})"]
    if spec.kv_lora_rank or spec.num_shared_experts:
        return ["DeepSeek-style MLA / shared experts are not supported by the engine"]
    if not 1 <= spec.num_experts_per_token <= spec.num_experts:
        return [f"num_experts_per_tok={spec.num_experts_per_token} is not in 1..num_experts="
                f"{spec.num_experts}"]
    return []


def gguf_support(header: GGUFHeader) -> EngineSupport:
    """Every part of a GGUF file the engine lacks: architecture, tensor types, tokenizer."""
    return EngineSupport(str(header.path), (*_architecture(header), *_tensor_types(header),
                                            *_tokenizer(header)))


def gguf_tokenizer_support(header: GGUFHeader) -> EngineSupport:
    """What the engine lacks to build a GGUF file's tokenizer (the file's other parts aside)."""
    return EngineSupport(str(header.path), tuple(_tokenizer(header)))


def hf_support(config_path: Path) -> EngineSupport:
    """What the engine lacks for an HF folder's config.json: its quantization (a pre-quantized
    checkpoint's parts the engine cannot hold, ``hf_quant_config.quant_problems``, or a
    quant_method it does not read), then its strict reader's refusal of the rest."""
    try:
        config = read_json(config_path)
    except ModelLoadError as exc:
        return EngineSupport(str(config_path), (f"architecture: {_without_source(exc, config_path)}",))
    quant = _quantization(config)
    try:
        if not quant:
            packed_formats(config, config_path)  # a `fitserve quantize` checkpoint's formats
        spec = spec_from_hf_config({k: v for k, v in config.items()
                                    if k != "quantization_config" or not quant},
                                   source=config_path, require_supported=True)
        check_engine_spec(spec, config_path)
    except ModelLoadError as exc:
        return EngineSupport(str(config_path), (*quant, f"architecture: "
                                                f"{_without_source(exc, config_path)}"))
    return EngineSupport(str(config_path), (*quant, *(f"architecture: {p}"
                                                      for p in spec_problems(spec))))


def _quantization(config: dict[str, object]) -> tuple[str, ...]:
    method = quant_method(config)
    if method is None or method == FITSERVE_QUANT_METHOD:
        return ()
    if method == MXFP4_METHOD:  # gpt-oss's experts, held as MXFP4 blocks (loading.mxfp4)
        arch = config.get("model_type")
        return () if arch == "gpt_oss" else (
            f"quantization: quant_method 'mxfp4' on {arch!r} (the engine reads it for gpt_oss)",)
    if method not in PREQUANT_METHODS:
        return (f"quantization: quant_method {method!r} (the engine reads "
                f"{', '.join(map(repr, (*PREQUANT_METHODS, FITSERVE_QUANT_METHOD)))})",)
    return tuple(f"quantization: {p}" for p in quant_problems(config))


def _architecture(header: GGUFHeader) -> list[str]:
    arch = header.fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        shown = repr(arch) if arch else "(general.architecture missing)"
        return [f"architecture {shown} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"]
    try:
        spec = spec_from_gguf_header(header, require_supported=True)
    except ModelLoadError as exc:  # a supported family with a setting the engine lacks
        return [f"architecture: {_without_source(exc, header.path)}"]
    return [f"architecture: {p}" for p in spec_problems(spec)]


def _tensor_types(header: GGUFHeader) -> list[str]:
    bad = {name: type_name for name, type_name in unsupported_types(header).items()
           if name not in SKIPPED_GGUF_TENSORS}
    counts = Counter(bad.values())
    first = {type_name: name for name, type_name in reversed(bad.items())}
    return [f"tensor type {name} ({n} tensor{'s' * (n > 1)}, e.g. {first[name]!r}; supported: "
            f"{', '.join(SUPPORTED_GGUF_TYPES)})" for name, n in counts.items()]


def _tokenizer(header: GGUFHeader) -> list[str]:
    model = header.fields.get("tokenizer.ggml.model")
    if model not in SUPPORTED_GGUF_TOKENIZER_MODELS:
        return [f"tokenizer model {model!r} (tokenizer.ggml.model; supported: "
                f"{', '.join(SUPPORTED_GGUF_TOKENIZER_MODELS)})"]
    if not header.fields.get("tokenizer.ggml.tokens"):
        return ["tokenizer: tokenizer.ggml.tokens missing from metadata"]
    if model == "gpt2" and not header.fields.get("tokenizer.ggml.merges"):
        return ["tokenizer: tokenizer.ggml.merges missing from metadata (a gpt2 vocabulary)"]
    return []


def _without_source(exc: Exception, source: object) -> str:
    """The error's message without its leading ``source: `` (the caller names the file)."""
    return str(exc).removeprefix(f"{source}: ")
