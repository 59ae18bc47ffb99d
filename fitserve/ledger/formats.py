"""The one table of formats: bytes per element, block layouts and scale overhead.

Shared by the loader, the quantization code and the planner. Every weight format is a block:
``block_elements`` weights stored in ``block_bits`` bits (scales and zero points included),
plus optional per-row and per-tensor scales. Plain dtypes are blocks of one element.

    int4-g128 (asymmetric, AWQ/GPTQ style), one group of 128 weights along a row:
    +---------------- 64 bytes ----------------+-- 2 bytes --+-- 4 bits --+
    | 128 x 4-bit codes                         | f16 scale   | int4 zero  |  = 532 bits
    +-------------------------------------------+-------------+------------+

    GGUF Q4_K super-block of 256 weights (ggml block_q4_K): d, dmin (2 x f16) + 12 bytes of
    6-bit sub-block scales/mins + 128 bytes of 4-bit codes = 144 bytes = 4.5 bits/weight.

The engine's packed layouts (``fitserve.quant.packed``; a format with ``packed`` set) keep
float16 scales (and float16 mins) per group, and pad each row to whole groups:

    int4-g32-asym  (= GGUF Q4_1): 16 B codes + f16 scale + f16 min   per 32 = 5.0  bits/weight
    int4-g32-sym   (= GGUF Q4_0): 16 B codes + f16 scale             per 32 = 4.5  bits/weight
    int8-g32       (= GGUF Q8_0): 32 B codes + f16 scale             per 32 = 8.5  bits/weight
    int8-ch        per output channel: K codes (K padded to 32) + one f16 scale per row
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import get_args

from fitserve.config import KVCacheDType, KVCacheScales, WeightsChoice
from fitserve.ledger.errors import PlanError


@dataclass(frozen=True)
class PackedLayout:
    """How the engine holds a format packed (``fitserve.quant.packed.PackedWeight``)."""

    kind: str  # "int4" | "int8"
    group_size: int  # columns per f16 scale; 0 = per output channel (K rounded up to 32)
    symmetric: bool  # no f16 min per group


@dataclass(frozen=True)
class WeightFormat:
    """A weight storage format: ``block_bits`` bits hold ``block_elements`` weights."""

    name: str
    block_elements: int
    block_bits: int
    row_scale_bytes: int = 0  # per output row (per-channel scales), e.g. int8 W8A16
    tensor_scale_bytes: int = 0  # per tensor (per-tensor scale), e.g. fp8
    gguf: bool = False  # a ggml type (GGUF files)
    note: str = ""
    # Groups never straddle rows: with ``rows`` known, each row is padded to whole blocks.
    row_padded: bool = False
    packed: PackedLayout | None = None  # the engine can hold (and run) it packed
    fp8: str = ""  # the engine holds it as fitserve.quant.fp8.Fp8Weight: "e4m3" | "e5m2"
    # 2-D tiles: one f32 scale per tile x tile square of a [rows, cols] matrix (edge tiles
    # partial, codes unpadded); with rows unknown, whole tiles are assumed
    tile: int = 0
    # bytes per input column: the int32 column order of an act-order (GPTQ desc_act) weight
    # held with its columns sorted by group (``-perm`` formats, fitserve.quant.permuted)
    col_index_bytes: int = 0

    @property
    def bits_per_weight(self) -> float:
        """Bits per weight from the block layout alone (row/tensor scales excluded)."""
        return self.block_bits / self.block_elements


def _gguf(name: str, block: int, nbytes: int, layout: str) -> WeightFormat:
    return WeightFormat(name, block, nbytes * 8, gguf=True, note=f"ggml {layout}")


_INT4_RE = re.compile(r"^int4-g(\d+)(-sym|-asym)?(-perm)?$")
_INT8_RE = re.compile(r"^int8-g(\d+)(-perm)?$")
PERM_SUFFIX = "-perm"  # an engine packed layout whose input columns are held permuted


def int4_format(group: int, *, symmetric: bool = False, zero: str = "int4") -> WeightFormat:
    """int4 weights in groups of ``group`` along a row: f16 scale (+ a zero point) each.

    ``zero="int4"``: a 4-bit zero point (AWQ/GPTQ checkpoints, ``int4-g128``); ``zero="f16"``:
    an f16 min, the engine's packed asymmetric layout (``int4-g128-asym``, GGUF Q4_1 at G=32).
    Groups that are a multiple of 32 in the engine's layouts (sym or f16 min) can be held packed.
    """
    if group <= 0 or group % 2:
        raise PlanError(f"int4 group size must be a positive even number, got {group}")
    zero_bits = 0 if symmetric else (16 if zero == "f16" else 4)
    suffix = "-sym" if symmetric else ("-asym" if zero == "f16" else "")
    how = "" if symmetric else (" + f16 min" if zero == "f16" else " + int4 zero point")
    engine = (symmetric or zero == "f16") and group % 32 == 0
    return WeightFormat(f"int4-g{group}{suffix}", group, group * 4 + 16 + zero_bits,
                        note=f"int4 codes, per group of {group}: f16 scale{how}",
                        row_padded=True,
                        packed=PackedLayout("int4", group, symmetric) if engine else None)


def _int8_group(group: int) -> WeightFormat:
    if group <= 0 or group % 32:
        raise PlanError(f"int8 group size must be a positive multiple of 32, got {group}")
    return WeightFormat(f"int8-g{group}", group, group * 8 + 16, row_padded=True,
                        packed=PackedLayout("int8", group, True),
                        note=f"int8 codes, per group of {group}: f16 scale")


def _permuted(f: WeightFormat) -> WeightFormat:
    """``f`` held with its input columns sorted by group (GPTQ act-order): + an int32 index
    per input column."""
    if f.packed is None:
        raise PlanError(f"{f.name}{PERM_SUFFIX}: only the engine's packed layouts are permuted")
    return replace(f, name=f.name + PERM_SUFFIX, col_index_bytes=4,
                   note=f.note + ", + int32 column order (act-order)")


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("f32", 1, 32, note="IEEE float32"),
        WeightFormat("bf16", 1, 16, note="bfloat16"),
        WeightFormat("f16", 1, 16, note="IEEE float16"),
        WeightFormat("fp8", 1, 8, tensor_scale_bytes=4,
                     note="float8 e4m3, one f32 scale per tensor"),
        WeightFormat("fp8-block", 1, 8, tile=128,
                     note="float8 e4m3, one f32 scale per 128x128 tile (DeepSeek-V3)"),
        WeightFormat("fp8-ch", 1, 8, row_scale_bytes=4, fp8="e4m3",
                     note="float8 e4m3, one f32 scale per output channel (--weights fp8)"),
        WeightFormat("fp8_e5m2-ch", 1, 8, row_scale_bytes=4, fp8="e5m2",
                     note="float8 e5m2, one f32 scale per output channel"),
        WeightFormat("int8", 1, 8, row_scale_bytes=4,
                     note="int8 symmetric, one f32 scale per output channel"),
        WeightFormat("mxfp4", 32, 32 * 4 + 8,
                     note="OCP MX fp4 e2m1, one e8m0 scale byte per 32 (gpt-oss experts)"),
        _gguf("Q4_0", 32, 18, "block_q4_0: f16 d + 16 B of 4-bit codes"),
        _gguf("Q4_1", 32, 20, "block_q4_1: f16 d, f16 m + 16 B of 4-bit codes"),
        _gguf("Q5_0", 32, 22, "block_q5_0: f16 d + 4 B high bits + 16 B codes"),
        _gguf("Q5_1", 32, 24, "block_q5_1: f16 d, m + 4 B high bits + 16 B codes"),
        _gguf("Q8_0", 32, 34, "block_q8_0: f16 d + 32 int8 codes"),
        _gguf("Q2_K", 256, 84, "block_q2_K: 16 B scales + 64 B codes + f16 d, dmin"),
        _gguf("Q3_K", 256, 110, "block_q3_K: 32 B hmask + 64 B codes + 12 B scales + f16 d"),
        _gguf("Q4_K", 256, 144, "block_q4_K: f16 d, dmin + 12 B scales + 128 B codes"),
        _gguf("Q5_K", 256, 176, "block_q5_K: f16 d, dmin + 12 B scales + 32 B qh + 128 B"),
        _gguf("Q6_K", 256, 210, "block_q6_K: 128 B ql + 64 B qh + 16 B scales + f16 d"),
        _gguf("Q8_K", 256, 292, "block_q8_K: f32 d + 256 int8 + 16 int16 bsums"),
        _gguf("IQ4_NL", 32, 18, "block_iq4_nl: f16 d + 16 B of 4-bit non-linear codes"),
        _gguf("IQ4_XS", 256, 136, "block_iq4_xs: f16 d + 2 B + 4 B 6-bit scales + 128 B codes"),
        # the rest of the ggml types gguf-py reads (the engine dequantizes them at load)
        *(_gguf(n, 256, b, "i-quant / ternary block (gguf.GGML_QUANT_SIZES)") for n, b in (
            ("IQ2_XXS", 66), ("IQ2_XS", 74), ("IQ2_S", 82), ("IQ3_XXS", 98), ("IQ3_S", 110),
            ("IQ1_S", 50), ("IQ1_M", 56), ("TQ1_0", 54), ("TQ2_0", 66))),
        _gguf("NVFP4", 64, 36, "block_nvfp4: 4 x fp8 scales + 32 B of fp4 e2m1 codes"),
        WeightFormat("int8-ch", 32, 32 * 8, row_scale_bytes=2, row_padded=True,
                     packed=PackedLayout("int8", 0, True),
                     note="int8 codes, K padded to 32, one f16 scale per output channel"),
        *(_int8_group(g) for g in (32, 64, 128)),
        *(int4_format(g, symmetric=sym, zero="f16") for g in (32, 64, 128) for sym in (False,
                                                                                      True)),
    )
}

# GGUF blocks the engine holds packed as they are stored (a 1:1 split of each block into its
# f16 scale(s) and its codes; no float round trip). Other ggml types are dequantized on load.
GGUF_PACKED: dict[str, str] = {"Q4_0": "int4-g32-sym", "Q4_1": "int4-g32-asym",
                               "Q8_0": "int8-g32"}
# GGUF types the engine holds as the file's raw ggml blocks, byte for byte (format = the type's
# own name; fitserve.quant.ggml_blocks.GgmlBlockWeight). Any other quantized ggml type gguf-py
# reads (Q2_K, Q3_K, IQ2_*, TQ*, ...) is dequantized on load to the model dtype.
GGML_HELD_TYPES: tuple[str, ...] = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS",
                                    "MXFP4")

# GGUF types held as another type's blocks, converted exactly at load (the same values bit for
# bit: fitserve.quant.ggml_repack): Q3_K's per-16-column (6-bit scale - 32, 3-bit code - 4) is
# a Q6_K super-block with codes 28..35 (1.9x the file's bytes instead of bf16's 4.65x); the
# ternary TQ1_0 / TQ2_0 (d * t per 256) are Q4_0 blocks with q = t + 8, held packed as Q4_0 is.
GGML_REPACKED: dict[str, str] = {"Q3_K": "Q6_K", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0"}


def repacked_format(stored: str) -> str | None:
    """The engine format a GGML_REPACKED type is held in (its target's held or packed format),
    None for any other type."""
    target = GGML_REPACKED.get(stored.upper())
    if target is None:
        return None
    return target if target in GGML_HELD_TYPES else GGUF_PACKED[target]

# Spellings accepted for the same format (config.json torch_dtype, ggml names, CLI habits).
ALIASES: dict[str, str] = {
    "float32": "f32", "fp32": "f32", "F32": "f32",
    "bfloat16": "bf16", "BF16": "bf16",
    "float16": "f16", "fp16": "f16", "half": "f16", "F16": "f16",
    "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8", "fp8-e4m3": "fp8",
    "w8a16": "int8", "int4": "int4-g128", "w4a16": "int4-g128", "MXFP4": "mxfp4",
}

def packed_format_name(kind: str, group_size: int, *, symmetric: bool,
                       per_channel: bool = False) -> str:
    """The table's name of an engine packed layout: ``int4-g32-asym``, ``int8-ch`` ..."""
    if kind == "int8":
        return "int8-ch" if per_channel else f"int8-g{group_size}"
    if kind == "int4":
        return f"int4-g{group_size}-{'sym' if symmetric else 'asym'}"
    raise PlanError(f"unknown packed kind {kind!r} (int4 or int8)")


def weight_format(fmt: str) -> WeightFormat:
    """Look a weight format up by name or alias ("bf16", "fp8", "int4-g64", "Q4_K", ...)."""
    name = ALIASES.get(fmt, fmt)
    if name in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[name]
    upper = name.upper()
    if upper in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[upper]
    m = _INT4_RE.match(name.lower())
    if m:
        f = int4_format(int(m.group(1)), symmetric=m.group(2) == "-sym",
                        zero="f16" if m.group(2) == "-asym" else "int4")
        return _permuted(f) if m.group(3) else f
    m = _INT8_RE.match(name.lower())
    if m:
        return _permuted(_int8_group(int(m.group(1)))) if m.group(2) else _int8_group(
            int(m.group(1)))
    known = ", ".join([*WEIGHT_FORMATS, "int4-g<N>[-sym|-asym]", "int8-g<N>"])
    raise PlanError(f"unknown weight format {fmt!r}; known: {known}")


def weight_bytes(num_elements: int, fmt: str, *, rows: int = 0) -> int:
    """Bytes to store one tensor of ``num_elements`` weights in ``fmt``.

    ``ceil(num_elements / block_elements)`` blocks of ``block_bits``, rounded up to a byte, plus
    ``rows x row_scale_bytes`` (per-channel formats: ``rows`` = output channels, required) plus
    ``tensor_scale_bytes`` once. Row-padded formats (the engine's packed ones) with ``rows``
    given count ``rows x ceil(cols / block_elements)`` blocks (each row padded to whole groups).
    A mix such as Q4_K_M is not one format: see ``plan.mixes``.
    """
    if num_elements < 0:
        raise PlanError(f"negative element count {num_elements}")
    f = weight_format(fmt)
    if f.row_scale_bytes and rows <= 0:
        raise PlanError(f"{f.name} has per-channel scales: pass rows= (output channels)")
    if f.tile:
        t = f.tile
        if rows > 0:
            if num_elements % rows:
                raise PlanError(f"{num_elements} elements do not split into {rows} rows")
            tiles = -(-rows // t) * -(-(num_elements // rows) // t)
        else:
            tiles = -(-num_elements // (t * t))
        return num_elements + 4 * tiles + f.tensor_scale_bytes
    blocks = -(-num_elements // f.block_elements)
    if f.col_index_bytes and rows <= 0:
        raise PlanError(f"{f.name} has a per-column index: pass rows= (output channels)")
    cols = num_elements // rows if f.col_index_bytes else 0
    if f.row_padded and rows > 0:
        if num_elements % rows:
            raise PlanError(f"{num_elements} elements do not split into {rows} rows")
        blocks = rows * -(-(num_elements // rows) // f.block_elements)
    return (-(-blocks * f.block_bits // 8) + rows * f.row_scale_bytes + f.tensor_scale_bytes
            + cols * f.col_index_bytes)


# The engine's ``--weights`` choices (EngineConfig.weights; `fitserve plan --gpu cpu --weights`).
ENGINE_WEIGHT_CHOICES: tuple[str, ...] = get_args(WeightsChoice)  # the engine's --weights
# NOTE: what RTN at load makes of (linear layers, embedding + lm_head). int4: asymmetric g32,
# llama.cpp Q4_1's layout (a 135M model loses most at coarse groups; the f16 min follows a
# skewed group); the embedding / lm_head in per-channel int8, as llama.cpp keeps token_embd
# near Q8_0 (the lm_head reads every row each step: int8 halves it without an int4's damage).
# int8: per channel everywhere (W8A16; torch's _weight_int8pack_mm runs it).
# fp8: e4m3 per output channel (vLLM's --quantization fp8 keeps one scale per tensor; a scale
# per row costs 4 B a row and follows rows of very different size), the embedding and lm_head
# as for int4/int8.
RTN_FORMATS: dict[str, tuple[str, str]] = {"int4": ("int4-g32-asym", "int8-ch"),
                                           "int8": ("int8-ch", "int8-ch"),
                                           "fp8": ("fp8-ch", "int8-ch")}
TENSOR_ROLES = ("matrix", "embedding", "vector")
_DENSE_CHOICES = {"bf16": "bfloat16", "float32": "float32", "float16": "float16"}
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "lm_head.weight")


def resolve_engine_weights(weights: str, quantization: str | None, dtype: str) -> tuple[str, str]:
    """The engine's ``(weights choice, --dtype)`` from its ``--weights``, ``--quantization`` and
    ``--dtype`` (a pure function: the engine and `fitserve plan` both call it).

    The choice is "as-stored", "int4", "int8", or a dense table name ("bf16", "f32", "f16");
    a dense ``--weights`` is also the model dtype: it fills ``--dtype auto`` and must agree with
    any other ``--dtype``. Raises PlanError on a conflict or an unknown value.
    """
    if weights not in ENGINE_WEIGHT_CHOICES:
        raise PlanError(f"unknown --weights {weights!r}; known: {', '.join(ENGINE_WEIGHT_CHOICES)}")
    if quantization is not None:
        if quantization not in RTN_FORMATS:
            raise PlanError(f"unknown --quantization {quantization!r}; known: "
                            f"{', '.join(RTN_FORMATS)}")
        if weights not in ("auto", quantization):
            raise PlanError(f"--weights {weights} conflicts with --quantization {quantization}")
        weights = quantization
    if weights in ("auto", "as-stored"):
        return "as-stored", dtype
    if weights in RTN_FORMATS:
        return weights, dtype
    wanted = _DENSE_CHOICES[weights]
    if dtype not in ("auto", wanted):
        raise PlanError(f"--weights {weights} holds every weight dense in {wanted}, the model "
                        f"dtype, but --dtype is {dtype}: pass --dtype {wanted} (or auto)")
    return weight_format(weights).name, wanted


def tensor_role(hf_name: str, ndim: int) -> str:
    """A tensor's role for ``engine_tensor_format``: "vector" (norms, biases), "embedding"
    (token embedding, lm_head) or "matrix" (every other weight: the projections)."""
    if ndim < 2:
        return "vector"
    return "embedding" if hf_name.endswith(_EMBEDDING_SUFFIXES) else "matrix"


def engine_tensor_format(choice: str, stored: str, role: str, dtype: str) -> str:
    """The format the engine holds one tensor in, for a ``--weights`` choice.

    ``choice``: "auto"/"as-stored" (GGUF Q4_0/Q4_1/Q8_0 packed as stored, see GGUF_PACKED;
    the GGML_HELD_TYPES as their raw blocks, the format being the type, GGML_REPACKED types
    as the blocks of the type they convert to exactly; a `fitserve quantize`
    checkpoint's engine layouts such as "int4-g128-sym" as they are; anything else
    dequantized or converted to the model dtype), "int4"/"int8" (RTN at load,
    RTN_FORMATS), or a dense dtype ("bf16", "float32": every tensor in it). ``stored``: the
    file's type of the tensor ("Q4_1", "F32", "bf16" ...). ``role``: "matrix" (a projection),
    "embedding" (token embedding, lm_head), "vector" (norms, biases: always the model dtype).
    ``dtype``: the model dtype ("bf16", "f32").
    """
    if role not in TENSOR_ROLES:
        raise PlanError(f"unknown tensor role {role!r}; known: {', '.join(TENSOR_ROLES)}")
    model = weight_format(dtype).name
    if role == "vector":
        return model
    if choice in ("auto", "as-stored"):
        name = ALIASES.get(stored, stored)
        if name.startswith(("int4-", "int8-")) and weight_format(name).packed is not None:
            return weight_format(name).name  # an engine layout as stored (fitserve quantize)
        if name.upper() in GGML_HELD_TYPES:
            return name.upper()
        return repacked_format(name) or GGUF_PACKED.get(name.upper(), model)
    if choice in RTN_FORMATS:
        return RTN_FORMATS[choice][0 if role == "matrix" else 1]
    if choice in ENGINE_WEIGHT_CHOICES or choice in _DENSE_CHOICES.values() or choice in (
            "f32", "f16"):
        return weight_format(choice).name  # dense: every tensor in that dtype
    raise PlanError(f"unknown --weights {choice!r}; known: {', '.join(ENGINE_WEIGHT_CHOICES)}")


@dataclass(frozen=True)
class KVFormat:
    """A KV-cache element format and where its scales live.

    ``scale_bytes_per_head``: bytes of scale per token per KV head, for V, and for K when
    ``key_scales`` is "token". ``key_scales="channel"``: K's scales are per block, one per KV
    head per channel (``scale_bytes`` each), not per token. ``scale_bytes_per_layer``: fixed
    per-layer scales (K and V together). ``codec``: the element codec the engine runs
    (``fitserve.quant.kv_cache.CODECS``), "" for dense formats and planner-only ones.

        int8-kc, one layer, one KV head, a block of bs tokens of head_dim D:
        K codes bs x D x 1 B | K scales D x 4 B (per channel) | V codes bs x D x 1 B | V scales bs x 4 B
    """

    name: str
    element_bytes: int
    scale_bytes_per_head: int = 0
    scale_bytes_per_layer: int = 0
    note: str = ""
    key_scales: str = "token"
    scale_bytes: int = 4
    codec: str = ""

    @property
    def key_token_scale_bytes(self) -> int:
        """K's scale bytes per token per KV head (0 with per-channel key scales)."""
        return self.scale_bytes_per_head if self.key_scales == "token" else 0


def _engine_kv(codec: str, channel_keys: bool) -> KVFormat:
    how = ("K: f32 scale per block per KV head per channel (the block's absmax); "
           "V: f32 scale per token per KV head") if channel_keys else (
        "f32 scale per token per KV head, for K and V each")
    name = codec + ("-kc" if channel_keys else "")
    return KVFormat(name, 1, scale_bytes_per_head=4, key_scales="channel" if channel_keys
                    else "token", codec=codec, note=f"{codec} codes; {how}")


KV_FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("f32", 4, note="float32"),
        KVFormat("bf16", 2, note="bfloat16"),
        KVFormat("f16", 2, note="float16"),
        KVFormat("fp8", 1, scale_bytes_per_layer=8,
                 note="float8 e4m3; one f32 scale for K and one for V per layer"),
        *(_engine_kv(c, ch) for c in ("int8", "fp8_e4m3", "fp8_e5m2") for ch in (False, True)),
    )
}

# The engine's --kv-cache-dtype choices (vLLM's names; "fp8" is e4m3 as in vLLM) and
# --kv-cache-scales layouts.
ENGINE_KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDType)  # the engine's --kv-cache-dtype
KV_CACHE_SCALES: tuple[str, ...] = get_args(KVCacheScales)
# NOTE: measured (benchmarks/bench_quant.py, SmolLM2, KL vs the bf16 cache): per-channel keys
# help int8 (0.0055 vs 0.0060 nats/token), whose uniform grid an outlier channel stretches,
# and hurt fp8 (e4m3 0.0127 vs 0.0105): a float format keeps its relative precision under one
# scale per token, and a block's grown scale requantizes its earlier codes.
KV_SCALES_AUTO = {"int8": "channel-key", "fp8_e4m3": "token", "fp8_e5m2": "token"}


def resolve_engine_kv_format(kv_cache_dtype: str, kv_cache_scales: str, model_dtype: str) -> str:
    """The KV format name (a KV_FORMATS key) the engine runs for ``--kv-cache-dtype`` and
    ``--kv-cache-scales`` (a pure function: the engine and `fitserve plan` both call it).

    "auto" dtype = the model dtype (dense). Quantized dtypes take ``kv_cache_scales``: "token"
    (K and V per token) or "channel-key" (K per channel per block, V per token). Its "auto" is
    "channel-key" for int8 and "token" for fp8 (KV_SCALES_AUTO). Scales given for a dense
    cache, or an unknown value, raise PlanError.
    """
    if kv_cache_dtype not in ENGINE_KV_CACHE_DTYPES:
        raise PlanError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; known: "
                        f"{', '.join(ENGINE_KV_CACHE_DTYPES)}")
    if kv_cache_scales not in KV_CACHE_SCALES:
        raise PlanError(f"unknown --kv-cache-scales {kv_cache_scales!r}; known: "
                        f"{', '.join(KV_CACHE_SCALES)}")
    codec = {"fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype)
    if codec not in ("int8", "fp8_e4m3", "fp8_e5m2"):
        if kv_cache_scales != "auto":
            raise PlanError(f"--kv-cache-scales {kv_cache_scales} applies to a quantized KV "
                            f"cache (int8, fp8_e4m3, fp8_e5m2), not {kv_cache_dtype}")
        return resolve_kv_dtype("auto" if codec == "auto" else codec, model_dtype)
    scales = KV_SCALES_AUTO[codec] if kv_cache_scales == "auto" else kv_cache_scales
    return codec + ("" if scales == "token" else "-kc")


def kv_format(kv_dtype: str) -> KVFormat:
    """Look a KV format up by name or alias; "auto" must be resolved first (resolve_kv_dtype)."""
    if kv_dtype in KV_FORMATS:
        return KV_FORMATS[kv_dtype]
    name = ALIASES.get(kv_dtype, kv_dtype)
    if name in KV_FORMATS:
        return KV_FORMATS[name]
    if name == "auto":
        raise PlanError('kv dtype "auto" must be resolved to the model dtype first')
    raise PlanError(f"unknown KV format {kv_dtype!r}; known: {', '.join(KV_FORMATS)}")


def resolve_kv_dtype(kv_dtype: str, model_dtype: str) -> str:
    """"auto" -> the model (activation) dtype, else the canonical name of ``kv_dtype``."""
    return kv_format(model_dtype if kv_dtype == "auto" else kv_dtype).name


def kv_element_bytes(kv_dtype: str) -> float:
    """Bytes per stored K or V element, scales excluded (see ``kv_scale_bytes_per_head``)."""
    return float(kv_format(kv_dtype).element_bytes)


def kv_scale_bytes_per_head(kv_dtype: str) -> int:
    """Scale bytes per token per KV head, for K and for V each (0 for unscaled formats)."""
    return kv_format(kv_dtype).scale_bytes_per_head


def dtype_bytes(dtype: str) -> int:
    """Bytes of a plain activation dtype (f32/bf16/f16)."""
    f = weight_format(dtype)
    if f.block_elements != 1 or f.row_scale_bytes or f.tensor_scale_bytes:
        raise PlanError(f"{dtype!r} is not a plain activation dtype")
    return f.block_bits // 8
