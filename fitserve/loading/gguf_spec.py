"""A GGUF file's header -> :class:`ModelSpec` and tensor inventory, for engine and planner.

Torch-free (the ``gguf`` package and numpy only): the planner imports this module. Reading a
header maps the file and parses its metadata and tensor list (name, ggml type, shape, bytes);
no tensor data is read, except ``rope_freqs.weight`` (a few floats: llama3 RoPE scaling is
stored as that tensor, not as metadata).

One reader, two modes, as for config.json (``fitserve.loading.hf_config``):
``require_supported=True`` (the engine) raises :class:`ModelLoadError` for what the engine
cannot run (an architecture, a RoPE scaling, per-layer head counts); ``False`` (the planner)
describes any model and takes the largest of per-layer values (an upper bound for KV).
"""

from __future__ import annotations

import math
import mmap
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from fitserve.config import GEMMA_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelSpec, RopeScaling
from fitserve.loading import hf_defaults
from fitserve.loading.errors import ModelLoadError, UnsupportedArchitectureError

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")
# llama.cpp's sliding-window layer pattern per architecture (hparams.set_swa_pattern): every
# period-th layer is full attention, the others slide. Planner only (the engine runs none).
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}
_GELU_ARCHS = ("gemma", "gemma2", "gemma3")
# RoPE data stored as tensors (a few floats each), read with the header: llama3's divisors,
# LongRoPE's short and long factors (llama.cpp's Phi-3 converter)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
# llama.cpp's layer count of the 27B models (llm_load_hparams), whose attention scale is
# (hidden / heads)**-0.5 instead of head_dim**-0.5; the files store no query_pre_attn_scalar
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_NORMS_PER_LAYER = {"gemma2": 4, "gemma3": 4}
# llama.cpp's architecture names of the MoE families, as transformers names them (a GGUF spec
# carries the HF name; "llama" with an expert count is Mixtral)
_HF_ARCH = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
# llama.cpp's build_moe_ffn norm_w per architecture (hard-coded in its graphs, no metadata):
# the top-k weights renormalised to sum 1 (Mixtral, Qwen3-MoE) or not (Qwen2-MoE, OLMoE)
_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False,
                        "gpt-oss": True}


def _dequantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` reads this type (probed on one zero block)."""
    if qtype not in GGML_QUANT_SIZES:
        return False
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


# NOTE: every tensor type the engine loads is every type the installed gguf-py dequantizes
# (probed, not listed: a newer gguf brings its new types along). How each is held under a
# --weights choice is ledger.formats.engine_tensor_format's rule. The planner's "can the
# engine run this file" and the loader's refusal both read this one tuple.
SUPPORTED_GGUF_TYPES: tuple[str, ...] = tuple(
    q.name for q in GGMLQuantizationType if _dequantizable(q))


def unsupported_types(header: GGUFHeader) -> dict[str, str]:
    """GGUF tensor name -> its type, for every tensor the engine cannot load (empty: all load)."""
    return {t.name: t.type_name for t in header.tensors
            if t.type_name not in SUPPORTED_GGUF_TYPES}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file's inventory (its data is not read)."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    type_name: str  # ggml type, e.g. "Q4_1", "F32"
    shape: tuple[int, ...]  # rows first (numpy / Hugging Face order; GGUF lists ne reversed)
    n_bytes: int  # bytes of its data in the file

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF header holds: metadata (key -> value) and the tensor inventory."""

    path: Path
    fields: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]
    rope_freqs: tuple[float, ...] | None = None  # rope_freqs.weight, when the file has one
    # Phi-3's LongRoPE: rope_factors_short.weight / rope_factors_long.weight, when present
    rope_factors: dict[str, tuple[float, ...]] = field(default_factory=dict)

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tensors)

    @property
    def file_weight_bytes(self) -> int:
        """Bytes of all tensor data in the file."""
        return sum(t.n_bytes for t in self.tensors)


class _UnknownTensorType(ValueError):
    """A tensor's ggml type id is not one of gguf-py's GGMLQuantizationType."""

    def __init__(self, tensor: str, type_id: int) -> None:
        super().__init__(f"tensor {tensor!r}: unknown ggml type {type_id}")
        self.tensor, self.type_id = tensor, type_id


_KNOWN_TYPE_IDS = frozenset(int(t) for t in GGMLQuantizationType)


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of the memmap.

    NOTE: slicing an ``np.memmap`` runs Python-level ``__array_finalize__`` per slice; the
    reader slices once per metadata string (~100k for a vocabulary), so a plain view makes
    opening SmolLM2 ~3x faster and dequantizing ~3x faster too.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)
        self._mapping: mmap.mmap | None = getattr(value, "_mmap", None)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        # NOTE: gguf-py turns each tensor's type id into GGMLQuantizationType here and fails on
        # an id newer than it without naming the tensor; the tensor infos are parsed by then
        for info in fields:
            name_data, raw_dtype = info.parts[1], info.parts[4]
            if int(raw_dtype[0]) not in _KNOWN_TYPE_IDS:
                raise _UnknownTensorType(bytes(name_data).decode("utf-8", "replace"),
                                         int(raw_dtype[0]))
        super()._build_tensors(start_offs, fields)

    def release_pages(self, arr: np.ndarray) -> None:
        """Drop the file's pages from the start of the mapping to the end of ``arr`` (a view of
        this reader's data: what a loader reading tensor by tensor has copied out) from the
        process's resident set.

        NOTE: the mapping is read-only and file-backed, so MADV_DONTNEED loses nothing (a later
        read faults the page in again from the page cache); without it every page a load read
        stays resident next to its copy until the reader is dropped (a 1 GB file peaked at
        2.3 GB). From the start, not just ``arr``'s pages: a page fault maps the cached pages
        around it too (the kernel's fault-around, 64 KiB), so earlier tensors' edges come back."""
        if self._mapping is None or arr.size == 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        end = arr.__array_interface__["data"][0] - self._plain.__array_interface__["data"][0]
        end += arr.size * arr.itemsize
        if 0 < end <= self._plain.nbytes:  # else not a view of this mapping: nothing to drop
            self._mapping.madvise(mmap.MADV_DONTNEED, 0, end)


def release_file_pages(reader: GGUFReader, arr: np.ndarray) -> None:
    """Drop ``reader``'s mapped file pages up to the end of ``arr`` from the resident set (see
    ``_PlainArrayReader.release_pages``); no-op for other readers."""
    if isinstance(reader, _PlainArrayReader):
        reader.release_pages(arr)


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file, turning any parse failure into a :class:`ModelLoadError`."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return _PlainArrayReader(path)
    except _UnknownTensorType as exc:
        raise ModelLoadError(
            f"{path}: tensor {exc.tensor!r} has ggml type {exc.type_id}, which the gguf library "
            f"(gguf-py {_gguf_version()}) does not know: a type newer than it (made by a newer "
            f"llama.cpp) or a corrupt file. Known types: "
            f"{', '.join(t.name for t in GGMLQuantizationType)}; re-quantize the model to one "
            "of them (e.g. Q4_K_M, Q8_0)") from exc
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on bad data
        raise ModelLoadError(
            f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})"
        ) from exc


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown version"


    return None


def gguf_fields(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata key of an open file with its Python value."""
    return {k: f.contents() for k, f in reader.fields.items()}


def header_from_reader(
    reader: GGUFReader, path: Path, fields: dict[str, Any] | None = None
) -> GGUFHeader:
    """The header of an already open file (``fields``: its metadata, if already parsed)."""
    tensors = []
    small: dict[str, tuple[float, ...]] = {}
    for t in reader.tensors:
        type_name = GGMLQuantizationType(t.tensor_type).name
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        tensors.append(GGUFTensor(t.name, type_name, shape, int(t.n_bytes)))
        if t.name in ROPE_TENSORS:
            try:
                values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)
            except Exception as exc:
                raise ModelLoadError(f"{path}: tensor {t.name!r} is corrupt: {exc}") from exc
            small[t.name] = tuple(float(x) for x in values.reshape(-1))
    return GGUFHeader(path, gguf_fields(reader) if fields is None else fields, tuple(tensors),
                      small.pop("rope_freqs.weight", None), small)


def read_gguf_header(path: Path) -> GGUFHeader:
    """Open ``path`` and read its header (raises :class:`ModelLoadError` on a bad file)."""
    return header_from_reader(open_gguf(path), path)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None if it has none."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def stored_types(header: GGUFHeader) -> dict[str, str]:
    """Hugging Face tensor name -> the ggml type the file stores it in (named tensors only; a
    3-D ``ffn_*_exps`` names each expert's slice, as the engine holds them)."""
    out = {}
    for t in header.tensors:
        m = _EXPERTS_RE.fullmatch(t.name)
        if m is not None:
            for e in range(t.shape[0]):
                out[f"model.layers.{m.group(1)}.mlp.experts.{e}.{m.group(2)}_proj."
                    f"{m.group(3)}"] = t.type_name
            continue
        hf = hf_tensor_name(t.name)
        if hf is not None:
            out[hf] = t.type_name
    return out


def llama3_factors(theta: float, head_dim: int, rs: RopeScaling) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor for llama3 scaling (the divisor of each frequency)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(rs.factor)
        else:
            smooth = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor
            )
            out.append(1 / ((1 - smooth) / rs.factor + smooth))
    return np.asarray(out, dtype=np.float32)


def infer_llama3(factors: np.ndarray, theta: float, head_dim: int) -> RopeScaling | None:
    """The llama3 rope-scaling parameters that give a ``rope_freqs`` tensor (exact match only).

    The published parameter sets are tried first (so a Llama 3.x file shows its config's own
    numbers); otherwise they are solved for. Only the two wavelength thresholds and the smooth
    ramp between them shape the factors, so (original context, low, high) is fixed only up to
    a common scale: the original context is taken as the low threshold's wavelength, rounded."""
    factors = np.asarray(factors, dtype=np.float32)
    factor = float(factors.max())
    for orig in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low in (1.0, 2.0, 0.5, 4.0):
            for high in (4.0, 2.0, 8.0, 1.5, 3.0):
                rs = RopeScaling("llama3", factor, low, high, orig)
                if _factors_match(rs, factors, theta, head_dim):
                    return rs
    solved = _solve_llama3(factors, factor, theta, head_dim)
    return solved if solved is not None and _factors_match(solved, factors, theta,
                                                           head_dim) else None


def _factors_match(rs: RopeScaling, factors: np.ndarray, theta: float, head_dim: int) -> bool:
    return bool(np.allclose(llama3_factors(theta, head_dim, rs), factors, rtol=1e-5, atol=1e-6))


def _solve_llama3(factors: np.ndarray, factor: float, theta: float,
                  head_dim: int) -> RopeScaling | None:
    """llama3 parameters from the factors. In x = 1 / wavelength, a frequency is divided by 1
    above x_high, by ``factor`` below x_low, and between them by 1 / ((1 - s) / factor + s) with
    s = (x - x_low) / (x_high - x_low). Two or more factors on that ramp fix the line; with one
    or none, any thresholds between the plateaus' nearest frequencies that keep the ramp's
    factor give the same tensor, and some are picked."""
    if factor <= 1.0 or len(factors) == 0:
        return None
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    x = (freqs.astype(np.float64) / (2 * math.pi))[: len(factors)]
    f = factors.astype(np.float64)
    ones, tops = np.isclose(f, 1.0, rtol=1e-6), np.isclose(f, factor, rtol=1e-6)
    ramp = ~(ones | tops)
    s = (1.0 / f[ramp] - 1.0 / factor) / (1.0 - 1.0 / factor)
    below = x[tops].max() if tops.any() else 0.0  # x_low lies above every top's x
    above = x[ones].min() if ones.any() else math.inf  # x_high lies below every one's x
    if ramp.sum() >= 2:
        slope, icpt = np.polyfit(x[ramp], s, 1)
        if slope <= 0:
            return None
        x_low, x_high = -icpt / slope, (1.0 - icpt) / slope
    elif ramp.sum() == 1:
        xw, sw = float(x[ramp][0]), float(s[0])
        room_up = (above - xw) / (1.0 / sw - 1.0) if sw < 1 else math.inf
        d = 0.5 * min(xw - below, room_up)
        x_low, x_high = xw - d, xw + d * (1.0 / sw - 1.0)
    else:
        if below >= above:
            return None
        top = above if math.isfinite(above) else 2 * below
        x_low, x_high = below + (top - below) / 3, below + 2 * (top - below) / 3
    if not 0 < x_low < x_high:
        return None
    orig = max(1, round(1.0 / x_low))  # an int field: low / high keep the thresholds exact
    return RopeScaling("llama3", factor, orig * x_low, orig * x_high, orig)


@dataclass(frozen=True)
class _Meta:
    """Metadata access for one architecture, raising ModelLoadError on what is missing."""

    fields: Mapping[str, Any]
    arch: str
    path: Path
    engine: bool

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{self.path}: missing metadata key {self.arch}.{key}")
        return value

    def one(self, key: str, default: Any = None) -> int:
        """A per-model count that some files write per layer (a list): one value, or refuse.

        NOTE: the planner takes the largest per-layer value (an upper bound for KV and
        weights); the engine runs one value for all layers, so it refuses a list that varies.
        """
        value = self.get(key, default)
        if not isinstance(value, list):
            return int(value)
        values = sorted({int(v) for v in value})
        if not values:
            raise ModelLoadError(f"{self.path}: metadata key {self.arch}.{key} is an empty list")
        if len(values) > 1 and self.engine:
            raise ModelLoadError(
                f"{self.path}: {self.arch}.{key} differs per layer ({', '.join(map(str, values))}"
                f" across {len(value)} layers); the engine runs one value for every layer"
            )
        return values[-1]


def _longrope(header: GGUFHeader, m: _Meta, context: int) -> RopeScaling:
    """LongRoPE as llama.cpp's converter stores it: the factor tensors, the original context
    and the attention factor it computed (sqrt(1 + ln(ctx / orig) / ln orig))."""
    short = header.rope_factors.get("rope_factors_short.weight")
    long = header.rope_factors.get("rope_factors_long.weight")
    if short is None or long is None:
        raise ModelLoadError(f"{m.path}: rope_factors_long.weight without rope_factors_short.weight"
                             " (or the reverse)")
    orig = int(m.get("rope.scaling.original_context_length"))
    attn = float(m.fields.get(f"{m.arch}.rope.scaling.attn_factor") or 1.0)
    return RopeScaling("longrope", factor=context / orig, original_max_position_embeddings=orig,
                       short_factor=short, long_factor=long, attention_factor=attn)


def _rope_scaling(header: GGUFHeader, m: _Meta, theta: float, head_dim: int) -> RopeScaling | None:
    kind = m.fields.get(f"{m.arch}.rope.scaling.type")
    if header.rope_factors:
        return _longrope(header, m, int(m.get("context_length", 2048)))
    if header.rope_freqs is not None:
        factors = np.asarray(header.rope_freqs, dtype=np.float32)
        found = infer_llama3(factors, theta, head_dim)
        if found is None and m.engine:
            raise ModelLoadError(
                f"{m.path}: rope_freqs tensor does not match any llama3 rope scaling")
        return found or RopeScaling("llama3", float(factors.max()))
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(m.get("rope.scaling.factor", 1.0)))
    if kind == "yarn":
        return _yarn(m)
    if m.engine:
        raise ModelLoadError(
            f"{m.path}: unsupported rope scaling type {kind!r}; supported: linear, llama3, yarn")
    orig = m.fields.get(f"{m.arch}.rope.scaling.original_context_length")
    return RopeScaling(str(kind), float(m.get("rope.scaling.factor", 1.0)),
                       original_max_position_embeddings=int(orig or 8192))


def _yarn(m: _Meta) -> RopeScaling:
    """YaRN as llama.cpp runs it: the file's factor, original context and betas (llama.cpp's
    defaults 32 / 1), the ramp's ends floored / ceiled (ggml_rope_yarn_corr_dims always
    truncates; transformers only with truncate=True), cos/sin times 0.1 ln(factor) + 1 unless
    the file says ``yarn_attn_factor``."""
    factor = float(m.get("rope.scaling.factor", 1.0))
    orig = int(m.fields.get(f"{m.arch}.rope.scaling.original_context_length")
               or m.get("context_length", 2048))
    attn = m.fields.get(f"{m.arch}.rope.scaling.yarn_attn_factor")
    if attn is None:
        attn = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return RopeScaling("yarn", factor, original_max_position_embeddings=orig,
                       attention_factor=float(attn),
                       beta_fast=float(m.fields.get(f"{m.arch}.rope.scaling.yarn_beta_fast") or 32),
                       beta_slow=float(m.fields.get(f"{m.arch}.rope.scaling.yarn_beta_slow") or 1),
                       truncate=True)


def _layer_kinds(m: _Meta, window: int | None, n: int) -> tuple[str, ...] | None:
    """Per-layer kinds: ``attention.sliding_window_pattern`` (an int period, or one bool per
    layer, True = sliding), else llama.cpp's built-in pattern of the architecture."""
    if window is None:
        return None
    pattern = m.fields.get(f"{m.arch}.attention.sliding_window_pattern", _SWA_PERIOD.get(m.arch))
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ModelLoadError(f"{m.path}: sliding_window_pattern has {len(pattern)} entries "
                                 f"for {n} layers")
        sliding = [bool(x) for x in pattern]
    elif pattern:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n)]
    else:
        return None
    if all(sliding):
        return None
    if not any(sliding):
        return ("full",) * n
    if m.engine and m.arch not in (*GEMMA_ARCHITECTURES, "gpt-oss"):
        raise ModelLoadError(f"{m.path}: {n - sum(sliding)} of {n} layers are full attention and "
                             "the rest sliding; the engine runs mixed layer kinds for Gemma 2/3 "
                             "and gpt-oss only")
    return tuple("sliding" if x else "full" for x in sliding)


def _vocab(header: GGUFHeader, m: _Meta) -> int:
    vocab = m.fields.get(f"{m.arch}.vocab_size")
    if vocab:
        return int(vocab)
    embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embd is not None and len(embd.shape) == 2:
        return embd.shape[0]
    return len(m.fields.get("tokenizer.ggml.tokens") or [])


def _planner_fields(m: _Meta, head_dim: int) -> dict[str, Any]:
    """MoE and MLA facts (ModelSpec's planner-only fields) from llama.cpp's metadata keys."""
    kv_lora = int(m.fields.get(f"{m.arch}.attention.kv_lora_rank") or 0)
    rope_dim = int(m.fields.get(f"{m.arch}.rope.dimension_count") or 0)
    out: dict[str, Any] = dict(
        num_experts=int(m.fields.get(f"{m.arch}.expert_count") or 0),
        num_experts_per_token=int(m.fields.get(f"{m.arch}.expert_used_count") or 0),
        moe_intermediate_size=int(m.fields.get(f"{m.arch}.expert_feed_forward_length") or 0),
        num_shared_experts=int(m.fields.get(f"{m.arch}.expert_shared_count") or 0),
        first_k_dense=int(m.fields.get(f"{m.arch}.leading_dense_block_count") or 0),
    )
    if m.engine and kv_lora:
        raise ModelLoadError(f"{m.path}: multi-head latent attention (MLA) models are not "
                             f"supported (kv_lora_rank {kv_lora})")
    if out["num_experts"]:
        norm = m.fields.get(f"{m.arch}.expert_weights_norm")
        out.update(
            norm_topk_prob=bool(_EXPERT_WEIGHTS_NORM.get(m.arch, False) if norm is None else norm),
            shared_expert_intermediate_size=int(
                m.fields.get(f"{m.arch}.expert_shared_feed_forward_length") or 0))
    if kv_lora:
        out.update(kv_lora_rank=kv_lora, qk_rope_head_dim=rope_dim,
                   qk_nope_head_dim=head_dim - rope_dim,
                   q_lora_rank=int(m.fields.get(f"{m.arch}.attention.q_lora_rank") or 0),
                   v_head_dim=int(m.fields.get(f"{m.arch}.attention.value_length") or head_dim))
    return out


def _gemma_fields(m: _Meta, head_dim: int, hidden: int, heads: int, layers: int
                  ) -> dict[str, Any]:
    """Gemma 2/3's scale, soft-caps and local RoPE base as llama.cpp reads them: the scale is
    derived (llm_load_hparams), the local base is ``rope.freq_base_swa`` or llama.cpp's 10000."""
    if m.arch not in GEMMA_ARCHITECTURES:
        return {}
    big = layers == _GEMMA_27B_LAYERS.get(m.arch)
    attn_cap = m.fields.get(f"{m.arch}.attn_logit_softcapping")
    final_cap = m.fields.get(f"{m.arch}.final_logit_softcapping")
    out: dict[str, Any] = {
        "query_pre_attn_scalar": float(hidden // heads if big else head_dim),
        "attn_logit_softcapping": None if attn_cap is None else float(attn_cap),
        "final_logit_softcapping": None if final_cap is None else float(final_cap),
    }
    if m.arch == "gemma3":
        out["sliding_rope_theta"] = float(m.fields.get(f"{m.arch}.rope.freq_base_swa") or 10000.0)
    return out


def spec_from_gguf_header(header: GGUFHeader, *, require_supported: bool = True) -> ModelSpec:
    """Build a :class:`ModelSpec` from a GGUF header (see the module docstring for the modes).

    Tensors decide what metadata does not say: ``output.weight`` absent means tied
    embeddings, ``blk.0.attn_q.bias`` a q/k/v bias, ``blk.0.attn_q_norm.weight`` q/k norms.
    """
    f, path = header.fields, header.path
    arch = str(f.get("general.architecture", ""))
    if require_supported and arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(arch or "(general.architecture missing)", path)
    m = _Meta(f, arch, path, require_supported)
    name = str(f.get("general.name") or path.stem)
    hidden, heads = int(m.get("embedding_length")), m.one("attention.head_count")
    head_dim = int(f.get(f"{arch}.attention.key_length") or hidden // heads)
    value_dim = f.get(f"{arch}.attention.value_length")
    if require_supported and value_dim is not None and int(value_dim) != head_dim:
        raise ModelLoadError(f"{path}: value_length {value_dim} != key_length {head_dim} is not "
                             "supported")
    theta = float(m.get("rope.freq_base", 10000.0))
    names = header.tensor_names
    eos = [f[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                          "tokenizer.ggml.eom_token_id") if f.get(k) is not None]
    window = f.get(f"{arch}.attention.sliding_window")
    window = int(window) if window else None
    layers = int(m.get("block_count"))
    kinds = _layer_kinds(m, window, layers)
    if kinds is not None and "sliding" not in kinds:
        window, kinds = None, None  # a window no layer uses
    extra: dict[str, float | int | str] = {}
    if arch in _NORMS_PER_LAYER:
        extra["norms_per_layer"] = _NORMS_PER_LAYER[arch]
    if "blk.0.attn_output.bias" in names:
        extra["o_proj_bias"] = 1
    if arch == "gpt-oss":  # what transformers' config class says (llama.cpp hard-codes them)
        extra.update(hf_defaults.EXTRAS["gpt_oss"], swiglu_alpha=1.702, swiglu_limit=7.0)
    # llama.cpp writes Mistral as "llama"; transformers' GGUF loader tells them apart by name.
    # NOTE: the window is the file's own key (llama.cpp writes none for "llama": full attention).
    spec_arch = "mistral" if arch == "llama" and "mistral" in name.lower() else arch
    if arch == "llama" and f.get(f"{arch}.expert_count"):
        spec_arch = "mixtral"
    spec_arch = _HF_ARCH.get(spec_arch, spec_arch)
    return ModelSpec(
        architecture=spec_arch,
        vocab_size=_vocab(header, m),
        hidden_size=hidden,
        intermediate_size=m.one("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=m.one("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=int(m.get("context_length", 2048)),
        rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(header, m, theta, head_dim),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        qk_norm_scope="projection" if arch == "olmoe" else "head",
        sliding_window=window,
        layer_types=kinds,
        hidden_act="gelu_pytorch_tanh" if arch in _GELU_ARCHS else "silu",
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos)),
        name=name,
        extra=extra,
        **_planner_fields(m, head_dim),
        **_gemma_fields(m, head_dim, hidden, heads, layers),
    )
