"""Weight bytes of a whole model in a format or a per-tensor mix, per tensor-parallel rank.

A plain format (``bf16``, ``fp8``, ``int8``, ``int4-g128``, ``Q4_0`` ...) applies to the
decoder's linear layers; the embedding, lm_head, router and vectors stay in the base dtype, as in
the published fp8/AWQ/GPTQ checkpoints. A mix (``Q4_K_M``, ``gpt-oss-mxfp4``) is data: rules
that pick a format per tensor, as llama.cpp's quantizer does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from fitserve import envs
from fitserve.config import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import (
    engine_tensor_format,
    tensor_role,
    weight_bytes,
    weight_format,
)
from fitserve.ledger.params import Tensor, rank_elements, tensors
from fitserve.ledger.weight_names import expected_weight_shapes


@dataclass(frozen=True)
class MixRule:
    """Tensors named in ``names`` get ``fmt``; on ``layers`` = "more_bits" only in the layers
    llama.cpp's ``use_more_bits`` picks (first n/8, last n/8, every third between), and on
    "first_eighth" only in layers i < n/8; elsewhere the mix's default."""

    names: tuple[str, ...]
    fmt: str
    layers: str = "all"


@dataclass(frozen=True)
class WeightMix:
    name: str
    default: str  # every matrix not matched by a rule
    vectors: str  # norms, biases
    rules: tuple[MixRule, ...]
    source: str


_DOWN = ("ffn_down", "expert_down", "shared_down")
_OUT = MixRule(("lm_head",), "Q6_K")
# Source for the GGUF mixes: llama.cpp src/llama-quant.cpp, llama_tensor_get_type (simplified:
# the GQA and MoE special cases and the fallbacks for rows not divisible by 256 are left out).
_LLAMA_CPP = "llama.cpp llama-quant.cpp llama_tensor_get_type (simplified)"
MIXES: dict[str, WeightMix] = {
    m.name: m
    for m in (
        WeightMix("Q4_K_M", "Q4_K", "f32", (
            _OUT, MixRule(("attn_v", *_DOWN), "Q6_K", "more_bits")), _LLAMA_CPP),
        WeightMix("Q4_K_S", "Q4_K", "f32", (
            _OUT, MixRule(_DOWN, "Q5_K", "first_eighth")), _LLAMA_CPP),
        WeightMix("Q5_K_M", "Q5_K", "f32", (
            _OUT, MixRule(("attn_v", *_DOWN), "Q6_K", "more_bits")), _LLAMA_CPP),
        WeightMix("Q6_K", "Q6_K", "f32", (_OUT,), _LLAMA_CPP),
        WeightMix("Q8_0", "Q8_0", "f32", (), _LLAMA_CPP),
        WeightMix("Q4_0", "Q4_0", "f32", (_OUT,), _LLAMA_CPP),
        WeightMix("Q4_1", "Q4_1", "f32", (_OUT,), _LLAMA_CPP),
        WeightMix("gpt-oss-mxfp4", "bf16", "bf16", (
            MixRule(("expert_gate", "expert_up", "expert_down"), "mxfp4"),),
            "openai/gpt-oss model card: MoE weights in MXFP4, everything else bf16"),
    )
}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's pick of layers that get more bits in *_M mixes."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def _layers_matching(rule: MixRule, n_layers: int) -> int:
    if rule.layers == "all":
        return n_layers
    if rule.layers == "more_bits":
        return sum(use_more_bits(i, n_layers) for i in range(n_layers))
    if rule.layers == "first_eighth":
        return n_layers // 8
    raise PlanError(f"unknown mix layer selection {rule.layers!r}")


def plain_mix(fmt: str, base_dtype: str = "bf16") -> WeightMix:
    """A plain format as a mix: decoder linear layers in ``fmt``, the rest in ``base_dtype``."""
    f = weight_format(fmt)
    if f.gguf:  # a GGUF file quantizes the embedding too and keeps vectors in f32
        return WeightMix(f.name, f.name, "f32", (), "GGUF: every matrix in one type")
    keep = MixRule(("embedding", "lm_head", "router"), base_dtype)
    return WeightMix(f.name, f.name, base_dtype, (keep,), "decoder linear layers quantized")


def roofline_base_dtype(fmt: str) -> str:
    """The dtype a roofline holds a format's other tensors in: a plain dtype ("bf16", "f32")
    holds every tensor in itself; a quantized format or a per-tensor mix ("int4-g128",
    "gpt-oss-mxfp4") keeps the embedding, lm_head and vectors in bf16."""
    if fmt in MIXES or fmt.upper() in MIXES:
        return "bf16"
    f = weight_format(fmt)
    plain = f.block_elements == 1 and not f.row_scale_bytes and not f.tensor_scale_bytes
    return f.name if plain else "bf16"


def roofline_weight_bytes(spec: ModelSpec, fmt: str, *, tp: int = 1) -> WeightBytes:
    """``model_weight_bytes`` with ``roofline_base_dtype``: the weights the roofline models
    (step time, capacity, W1's limit) count, for a format or a mix name."""
    return model_weight_bytes(spec, fmt, tp=tp, base_dtype=roofline_base_dtype(fmt))


def resolve_mix(fmt: str, base_dtype: str = "bf16") -> WeightMix:
    if fmt in MIXES:
        return MIXES[fmt]
    upper = fmt.upper()
    if upper in MIXES:
        return MIXES[upper]
    return plain_mix(fmt, base_dtype)


@dataclass(frozen=True)
class TensorBytes:
    name: str
    fmt: str
    copies: int  # copies held by one rank (layers x experts)
    bytes: int  # all copies, one rank


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes held by ONE tensor-parallel rank, tensor by tensor."""

    mix: str
    tp: int
    lines: tuple[TensorBytes, ...]
    num_params: int  # all parameters of the model (not per rank)
    mix_is_per_tensor: bool = False  # counted tensor by tensor in each one's own format

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)

    @property
    def bits_per_weight(self) -> float:
        """Effective bits per weight, for tp=1 (all the model's weights on one device)."""
        return self.total * 8 * self.tp / self.num_params


def _tensor_bytes(t: Tensor, spec: ModelSpec, fmt: str, copies: int, tp: int) -> int:
    elements = rank_elements(t, spec, tp)
    rows = elements // t.cols if t.cols else 0
    return copies * weight_bytes(elements, fmt, rows=rows)


def model_weight_bytes(spec: ModelSpec, fmt: str, *, tp: int = 1,
                       base_dtype: str = "bf16") -> WeightBytes:
    """Bytes of all weights on one of ``tp`` ranks, for a format or a mix name."""
    mix = resolve_mix(fmt, base_dtype)
    lines: list[TensorBytes] = []
    for t in tensors(spec):
        if t.kind == "other":
            lines.append(TensorBytes(t.name, mix.vectors, t.count,
                                     _tensor_bytes(t, spec, mix.vectors, t.count, tp)))
            continue
        rule = next((r for r in mix.rules if t.name in r.names), None)
        if rule is None or t.layers == 1 and rule.layers != "all":
            lines.append(TensorBytes(t.name, mix.default, t.count,
                                     _tensor_bytes(t, spec, mix.default, t.count, tp)))
            continue
        hit = _layers_matching(rule, t.layers) * t.per_layer
        lines.append(TensorBytes(t.name, rule.fmt, hit, _tensor_bytes(t, spec, rule.fmt, hit, tp)))
        if hit < t.count:
            rest = t.count - hit
            lines.append(TensorBytes(t.name, mix.default, rest,
                                     _tensor_bytes(t, spec, mix.default, rest, tp)))
    total_params = sum(t.elements * t.count for t in tensors(spec))
    return WeightBytes(mix.name, tp, tuple(lines), total_params)


# -- the weights fitserve's engine holds ---------------------------------------------------------
#
# NOTE: the engine counts what it holds tensor by tensor through these functions, and the
# planner's `--gpu cpu` weights line is the same call, so they cannot disagree. Without a
# rule every tensor is held in the model dtype; weights held as stored (GGUF Q4_0/Q4_1/Q8_0
# packed, K-quants / Q5 / IQ4 as raw ggml blocks, a checkpoint's packed layouts) are a
# ``rule``: bytes = f(inventory, format per tensor), each at its format's exact bits.

# (Hugging Face name, ndim, the format the file stores it in or None) -> the format held in
FormatRule = Callable[[str, int, str | None], str]


def engine_format_rule(choice: str, dtype: str) -> FormatRule:
    """The engine's rule for a resolved ``--weights`` choice (``formats.resolve_engine_weights``)
    in model dtype ``dtype``: ``formats.engine_tensor_format`` per tensor, the one the loaders
    use (a tensor whose stored format is unknown counts as stored in ``dtype``)."""

    def rule(name: str, ndim: int, stored: str | None) -> str:
        return engine_tensor_format(choice, stored or dtype, tensor_role(name, ndim), dtype)

    return rule


@dataclass(frozen=True)
class EngineTensor:
    """One tensor as the engine holds it: Hugging Face name, shape (rows first), format."""

    name: str
    shape: tuple[int, ...]
    fmt: str  # a weight format of plan.formats ("bf16", "f32", "Q4_0" ...)


def panel_bytes(t: EngineTensor) -> int:
    """Bytes of the M > 1 layout the engine makes once at load beside a projection held in a
    packed format (``fitserve.model.linear.PackedLinear.prepack``, qlinear_prepack.h): per row,
    its codes and fp32 scales (int4: + fp32 offsets). None for the embedding / lm_head and the
    experts (``panels_apply``)."""
    packed = weight_format(t.fmt).packed
    if (packed is None or len(t.shape) != 2 or tensor_role(t.name, 2) != "matrix"
            or ".experts." in t.name):
        return 0
    rows, cols = t.shape
    group = packed.group_size or -(-cols // 32) * 32  # 0: per output channel
    groups = -(-cols // group)
    bits = 4 if packed.kind == "int4" else 8
    return rows * (groups * group * bits // 8 + groups * 4 * (2 if bits == 4 else 1))


def held_bytes(tensors_held: Iterable[EngineTensor], *, panels: bool = True) -> int:
    """Bytes of ``tensors_held``, each in its own format (``formats.weight_bytes``), with the
    prepacked panels (``panel_bytes``) unless ``panels`` is False (the C++ kernels absent)."""
    total = 0
    for t in tensors_held:
        rows = t.shape[0] if len(t.shape) >= 2 else 0
        total += weight_bytes(math.prod(t.shape), t.fmt, rows=rows)
        total += panel_bytes(t) if panels else 0
    return total


def tensor_mix_bytes(mix: str, tensors_held: Iterable[EngineTensor]) -> WeightBytes:
    """A per-tensor mix as WeightBytes (tp=1), one line per format: the real mix of a file
    (a Q4_K_M GGUF is Q4_K, Q6_K and Q5_0/Q8_0 rows, each at its own exact bits per weight) or
    of what the engine holds. Bytes per tensor are ``formats.weight_bytes`` (as ``held_bytes``)."""
    by_fmt: dict[str, tuple[int, int]] = {}
    params = 0
    for t in tensors_held:
        rows = t.shape[0] if len(t.shape) >= 2 else 0
        n = math.prod(t.shape)
        count, total = by_fmt.get(t.fmt, (0, 0))
        by_fmt[t.fmt] = (count + 1, total + weight_bytes(n, t.fmt, rows=rows))
        params += n
    lines = tuple(TensorBytes(f"{count} tensors", fmt, count, b)
                  for fmt, (count, b) in sorted(by_fmt.items(), key=lambda kv: -kv[1][1]))
    return WeightBytes(mix, 1, lines, params, mix_is_per_tensor=True)


def stored_format_rule(dtype: str) -> FormatRule:
    """Each tensor in the format its file stores it in (``dtype`` where the file says none)."""

    def rule(name: str, ndim: int, stored: str | None) -> str:
        return weight_format(stored or dtype).name

    return rule


def engine_runs(spec: ModelSpec) -> bool:
    """Whether fitserve's engine builds this architecture (the dense Llama-family decoders, and
    the mixture-of-experts families whose expert block it runs)."""
    return (spec.architecture in SUPPORTED_ARCHITECTURES
            and (not spec.num_experts or spec.architecture in MOE_ARCHITECTURES)
            and not spec.kv_lora_rank and not spec.num_shared_experts and not spec.first_k_dense)


def engine_held_tensors(spec: ModelSpec, dtype: str, *, stored: Mapping[str, str] | None = None,
                        rule: FormatRule | None = None) -> tuple[EngineTensor, ...]:
    """Every tensor the engine holds for ``spec`` (a tied embedding once) and its format.

    Without ``rule`` each is held in ``dtype`` (converted or dequantized on load); with one,
    in ``rule(name, ndim, stored.get(name))``, ``stored`` being the file's format per tensor.
    """
    out = []
    for name, shape in expected_weight_shapes(spec).items():
        as_stored = stored.get(name) if stored is not None else None
        fmt = dtype if rule is None else rule(name, len(shape), as_stored)
        out.append(EngineTensor(name, shape, fmt))
    return tuple(out)


def engine_weight_bytes(spec: ModelSpec, dtype: str, *, stored: Mapping[str, str] | None = None,
                        rule: FormatRule | None = None, panels: bool | None = None) -> int:
    """Bytes of the weights the engine holds for ``spec`` (see ``engine_held_tensors``), with
    the prepacked layout (``panel_bytes``) where ``panels``; None: as FITSERVE_PREPACK_PANELS
    says (the planner assumes the C++ kernels are built, as the default install does)."""
    if panels is None:
        panels = envs.FITSERVE_PREPACK_PANELS()
    return held_bytes(engine_held_tensors(spec, dtype, stored=stored, rule=rule), panels=panels)


def engine_plan_weight_bytes(spec: ModelSpec, dtype: str, *,
                             stored: Mapping[str, str] | None = None,
                             rule: FormatRule | None = None) -> int:
    """The planner's weights line for fitserve's engine on cpu: ``engine_weight_bytes`` for a
    model the engine runs; for any other, the ledger's count of the model in ``dtype``."""
    if engine_runs(spec):
        return engine_weight_bytes(spec, dtype, stored=stored, rule=rule)
    return model_weight_bytes(spec, dtype, base_dtype=dtype).total


def engine_held_formats(spec: ModelSpec, dtype: str, *, stored: Mapping[str, str] | None,
                        rule: FormatRule) -> dict[str, int]:
    """Elements per held format over the engine's tensors (largest first): what a rule makes
    of a model, e.g. {"int4-g32-asym": 99.5M, "int8-g32": 28.3M, "bf16": 34.6k}."""
    counts: dict[str, int] = {}
    for t in engine_held_tensors(spec, dtype, stored=stored, rule=rule):
        counts[t.fmt] = counts.get(t.fmt, 0) + math.prod(t.shape)
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def engine_main_format(spec: ModelSpec, dtype: str, *, stored: Mapping[str, str] | None,
                       rule: FormatRule) -> str:
    """The format holding most of the engine's weights (the speed lines' weight format)."""
    counts = engine_held_formats(spec, dtype, stored=stored, rule=rule)
    return next(iter(counts)) if counts else dtype


def engine_read_weight_bytes(spec: ModelSpec, dtype: str, *,
                             stored: Mapping[str, str] | None = None,
                             rule: FormatRule | None = None) -> WeightBytes:
    """The weights a decode step of fitserve's engine reads (tp=1), each tensor at the bytes
    it is held in (``engine_held_tensors``), for the speed lines: one line per (kind, format),
    the routed experts' named ``expert_*`` (a step reads the experts it touches,
    ``moe.moe_step_weight_read``), the rest ``dense_*``.

    NOTE: not ``model_weight_bytes`` of the main format, which keeps the embedding / lm_head
    in bf16: the default Q4_1 file's tied table is held as int8 (its Q8_0 blocks, 30.1 MB)
    and read whole by the lm_head every step, not 56.6 MB of bf16 (123.0 vs 96.5 MB in all).
    An untied embedding is a lookup (one row a token) and is left out; the prepacked M > 1
    panels are a second layout of the same weights, not read beside them."""
    lines: dict[tuple[str, str], tuple[int, int]] = {}
    params = 0
    untied = not spec.tie_word_embeddings
    for t in engine_held_tensors(spec, dtype, stored=stored, rule=rule):
        n = math.prod(t.shape)
        params += n
        if untied and t.name.endswith("embed_tokens.weight"):
            continue
        kind = "expert" if ".experts." in t.name else "dense"
        rows = t.shape[0] if len(t.shape) >= 2 else 0
        count, total = lines.get((kind, t.fmt), (0, 0))
        lines[(kind, t.fmt)] = (count + 1, total + weight_bytes(n, t.fmt, rows=rows))
    return WeightBytes("engine", 1, tuple(TensorBytes(f"{kind}_{fmt}", fmt, count, b) for
                                          (kind, fmt), (count, b) in sorted(lines.items())),
                       params)
