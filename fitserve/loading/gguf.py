"""GGUF files (llama.cpp) -> ModelSpec, Hugging Face-named float weights, and a tokenizer.

Tensors are dequantized with ``gguf.quants.dequantize``, or, for the engine's ``--weights``
choices, held as stored (Q4_0/Q4_1/Q8_0 blocks split into packed codes and f16 scales, see
``fitserve.quant.gguf_map``; Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS as the file's raw
ggml blocks, see ``fitserve.quant.ggml_blocks``) or RTN-packed at load. Every other type
gguf-py reads (Q2_K, Q3_K, IQ2_*, TQ*, ...) is dequantized at load, one log line per type. llama.cpp's converter permutes the
rows of Q and K for the llama architecture (so that its interleaved RoPE matches HF's
split-halves RoPE); we undo that here, so the weights equal the original HF checkpoint's
(up to quantization) and the model needs only split-halves RoPE::

    HF rows of one head (d = head_dim):   [x0 .. x(d/2-1) | y0 .. y(d/2-1)]   (halves rotate as pairs)
    GGUF rows after llama.cpp's permute:  [x0 y0 x1 y1 ... ]                    (adjacent pairs)

(packed tensors are un-permuted the same way: their rows move whole, which is exact).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from fitserve.config import GEMMA_ARCHITECTURES, ModelSpec
from fitserve.ledger.formats import GGML_HELD_TYPES, GGML_REPACKED, GGUF_PACKED, repacked_format
from fitserve.ledger.weight_names import expected_weight_shapes
from fitserve.loading.errors import ModelLoadError, UnsupportedTensorTypeError
from fitserve.loading.fused_weights import fused_parts
from fitserve.loading.generation_defaults import GenerationDefaults, from_gguf_metadata
from fitserve.loading.gguf_names import gguf_to_hf_names
from fitserve.loading.gguf_spec import (  # noqa: F401 (the spec part lives there; re-exported)
    ROPE_TENSORS,
    SUPPORTED_GGUF_TYPES,
    gguf_fields,
    header_from_reader,
    hf_tensor_name,
    llama3_factors,
    open_gguf,
    release_file_pages,
    spec_from_gguf_header,
)
from fitserve.loading.gguf_vocab import GGUFVocab, VocabError, backend_from_vocab
from fitserve.loading.hf_config import check_weights
from fitserve.loading.support import (
    gguf_support,
    gguf_tokenizer_support,
)
from fitserve.loading.tokenizer import Tokenizer
from fitserve.quant.convert import held_format, hold
from fitserve.quant.ggml_blocks import ggml_from_gguf
from fitserve.quant.ggml_repack import repacked
from fitserve.quant.gguf_map import packed_from_gguf
from fitserve.quant.held import HeldTensor, dtype_table_name

log = logging.getLogger("fitserve.loading")
_FLOAT_TYPES = ("F32", "F16", "BF16")
_PERMUTED_ARCHS = ("llama", "mistral", "mixtral")
# the 3-D ffn_*_exps (and gpt-oss's 2-D expert biases), cut along the expert axis
_EXPERT_PROJ = ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight",
                "mlp.experts.down_proj.weight", "mlp.experts.gate_proj.bias",
                "mlp.experts.up_proj.bias", "mlp.experts.down_proj.bias")


def _fields(reader: GGUFReader) -> dict[str, Any]:
    return gguf_fields(reader)


def spec_from_gguf(
    reader: GGUFReader, path: Path, fields: dict[str, Any] | None = None
) -> ModelSpec:
    """The engine's :class:`ModelSpec` of an open GGUF file: the one header reader
    (``fitserve.loading.gguf_spec``) in its strict mode, which the planner shares."""
    return spec_from_gguf_header(header_from_reader(reader, path, fields), require_supported=True)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` (rows per head: pairs back to halves)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _row_order(hf: str, spec: ModelSpec, rows: int) -> np.ndarray | None:
    """The row order that undoes llama.cpp's Q/K permutation (None: keep the file's order)."""
    if spec.architecture not in _PERMUTED_ARCHS:
        return None
    if ".self_attn.q_proj." in hf:
        return _unpermute(np.arange(rows), spec.num_heads)
    if ".self_attn.k_proj." in hf:
        return _unpermute(np.arange(rows), spec.num_kv_heads)
    return None


def _dequantized(t: Any, type_name: str, shape: tuple[int, ...], order: np.ndarray | None,
                 path: Path) -> torch.Tensor:
    """One tensor dequantized to float32 (rows in HF order), as a writable torch tensor."""
    try:
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    except Exception as exc:
        raise ModelLoadError(f"{path}: tensor {t.name!r} ({type_name}) is corrupt: {exc}") from exc
    if order is not None:
        arr = arr[order]
    if not (arr.flags.writeable and arr.flags.c_contiguous):
        arr = np.array(arr, order="C")  # F32 tensors are read-only views of the file
    return torch.from_numpy(arr)


def read_gguf_weights(
    reader: GGUFReader, spec: ModelSpec, path: Path, dtype: torch.dtype = torch.float32,
    weights: str | None = None,
) -> tuple[dict[str, HeldTensor], str, dict[str, str]]:
    """Every tensor under its HF name; also the dominant stored type, and each tensor's ggml
    type (HF name -> "Q4_1", "F32" ...: what the ledger's format rule reads).

    ``weights`` None: every tensor dequantized to ``dtype``. Otherwise a ``--weights`` choice
    ("as-stored", "int4", "int8", a dtype): each tensor in the format
    ``fitserve.quant.convert.held_format`` picks. Q4_0/Q4_1/Q8_0 held as stored become
    PackedWeights by splitting their blocks, the GGML_HELD_TYPES GgmlBlockWeights of the
    file's bytes (no float copy is made); the rest is dequantized one tensor at a time (then
    RTN-packed or cast), with one log line per quantized type dequantized. Names come from
    gguf-py's tensor map (fitserve.loading.gguf_names); Phi-3's fused attn_qkv / ffn_up are
    split by rows, and the 1 llama.cpp's converter adds to every Gemma norm weight is taken
    off again.
    """
    arch = str(reader.fields["general.architecture"].contents())
    names = gguf_to_hf_names(spec, arch, path)
    expected = expected_weight_shapes(spec)
    out: dict[str, HeldTensor] = {}
    stored: dict[str, str] = {}
    elements: Counter[str] = Counter()
    dequantized: dict[str, list[str]] = {}  # quantized type -> the formats its tensors went to
    repacked_as: dict[str, int] = {}  # GGML_REPACKED type -> its tensors held converted
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue
        hf = names.get(t.name)
        if hf is None:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for {spec.architecture}")
        type_name = GGMLQuantizationType(t.tensor_type).name
        if type_name not in SUPPORTED_GGUF_TYPES:
            raise UnsupportedTensorTypeError(t.name, type_name, SUPPORTED_GGUF_TYPES, path)
        shape = _shape_as_written(tuple(int(x) for x in reversed(t.shape.tolist())),
                                  expected.get(hf))
        for part, rows, one, one_shape in _pieces(t, spec, hf, shape, path):
            stored[part] = type_name
            out[part], fmt = _held(one, part, rows, type_name, one_shape, spec, path, dtype,
                                   weights)
            if fmt is not None and type_name not in _FLOAT_TYPES:
                dequantized.setdefault(type_name, []).append(fmt)
            elif fmt is None and type_name in GGML_REPACKED:
                repacked_as[type_name] = repacked_as.get(type_name, 0) + 1
        if len(shape) >= 2:
            elements[type_name] += int(np.prod(shape))
        release_file_pages(reader, t.data)  # copied out up to here: the file's pages may go
    release_file_pages(reader, reader.data)  # the last tensor's fault-around pages past its end
    for type_name, count in repacked_as.items():
        log.info("%s: %d %s tensor(s) held as %s blocks (converted exactly at load)",
                 path.name, count, type_name, GGML_REPACKED[type_name])
    for type_name, fmts in dequantized.items():
        log.info("%s: %d %s tensor(s) dequantized at load, held as %s", path.name, len(fmts),
                 type_name, ", ".join(sorted(set(fmts))))
    check_weights(out, spec, path)
    dominant = elements.most_common(1)[0][0] if elements else "F32"
    return out, dominant, stored


def _shape_as_written(shape: tuple[int, ...], want: tuple[int, ...] | None) -> tuple[int, ...]:
    """The tensor's shape with the size-1 dimensions its writer had. NOTE: llama.cpp's
    quantizer writes each tensor with ggml_n_dims dimensions, which drops trailing size-1 ones:
    Qwen2-MoE's shared-expert gate, [1, hidden] in the converter's file, comes back [hidden]."""
    if want is None or shape == want or math.prod(shape) != math.prod(want):
        return shape
    return want if [d for d in shape if d != 1] == [d for d in want if d != 1] else shape


@dataclass(frozen=True)
class _ExpertSlice:
    """One expert's [rows, cols] of a 3-D ``ffn_*_exps`` tensor, read like a 2-D tensor."""

    name: str
    tensor_type: Any
    data: np.ndarray  # its slice of the file's data along the expert axis (no copy)


def _pieces(t: Any, spec: ModelSpec, hf: str, shape: tuple[int, ...], path: Path
            ) -> list[tuple[str, np.ndarray | None, Any, tuple[int, ...]]]:
    """(HF name, rows, the tensor or its expert slice, its shape) of each weight a file tensor holds: a
    3-D expert tensor cut along the expert axis (its data is [E, rows, bytes per row], so each
    slice is whole rows of ggml blocks), else ``_parts``."""
    if hf.endswith(_EXPERT_PROJ) and len(shape) == (3 if hf.endswith(".weight") else 2):
        if shape[0] != spec.num_experts:
            raise ModelLoadError(f"{path}: tensor {t.name!r} holds {shape[0]} experts, the "
                                 f"metadata says {spec.num_experts}")
        base, _, suffix = hf.rpartition(".")
        stem = base.rpartition(".")
        return [(f"{stem[0]}.{e}.{stem[2]}.{suffix}", None,
                 _ExpertSlice(f"{t.name}[{e}]", t.tensor_type, t.data[e]), shape[1:])
                for e in range(shape[0])]
    return [(name, rows, t, shape) for name, rows in _parts(spec, hf, shape[0], path)]


def _parts(spec: ModelSpec, hf: str, rows: int, path: Path) -> list[tuple[str, np.ndarray | None]]:
    """(HF name, the file's rows it takes, None = all) of one tensor: one entry, or the parts of
    a fused tensor (Phi-3)."""
    parts = fused_parts(spec, hf)
    if parts is None:
        return [(hf, None)]
    if rows != sum(r for _, r in parts):
        raise ModelLoadError(f"{path}: tensor {hf!r} has {rows} rows, expected "
                             f"{' + '.join(str(r) for _, r in parts)}")
    bounds = np.cumsum([0] + [r for _, r in parts])
    return [(name, np.arange(bounds[i], bounds[i + 1])) for i, (name, _) in enumerate(parts)]


def _held(t: Any, hf: str, rows: np.ndarray | None, type_name: str, shape: tuple[int, ...],
          spec: ModelSpec, path: Path, dtype: torch.dtype, weights: str | None
          ) -> tuple[HeldTensor, str | None]:
    """One (part of a) tensor in the format the engine holds it in, and that format when the
    tensor was dequantized to get there (None: held from the file's blocks as they are)."""
    order = _row_order(hf, spec, shape[0])
    if rows is not None:
        order = rows if order is None else order[rows]
    part_shape = shape if rows is None else (len(rows), *shape[1:])
    fmt = (dtype_table_name(dtype) if weights is None
           else held_format(weights, hf, len(shape), type_name, dtype))
    as_blocks = fmt == type_name and type_name in GGML_HELD_TYPES
    repack = repacked_format(type_name) == fmt
    if len(shape) == 2 and (GGUF_PACKED.get(type_name) == fmt or as_blocks or repack):
        blocks_type, data = type_name, t.data
        try:
            if repack:  # the target type's blocks, the same values exactly (ggml_repack)
                blocks_type = GGML_REPACKED[type_name]
                data = repacked(t.data, type_name, blocks_type, (shape[0], shape[1]))
            make = ggml_from_gguf if blocks_type in GGML_HELD_TYPES else packed_from_gguf
            return make(data, blocks_type, (shape[0], shape[1]), order), None
        except ValueError as exc:
            raise ModelLoadError(f"{path}: tensor {t.name!r} ({type_name}) is corrupt: "
                                 f"{exc}") from exc
    tensor = _dequantized(t, type_name, shape, order, path)
    assert tuple(tensor.shape) == part_shape
    if spec.architecture in GEMMA_ARCHITECTURES and hf.endswith("norm.weight"):
        # NOTE: llama.cpp's Gemma converters store w + 1 (the (1 + w) of Gemma's RMSNorm); for
        # |w| < 0.5 the float32 (w + 1) - 1 is exact (Sterbenz), so 1 + w is the file's value
        tensor -= 1.0
    return hold(tensor, fmt), fmt


def tokenizer_from_gguf(fields: dict[str, Any], spec: ModelSpec, path: Path) -> Tokenizer:
    """Build the tokenizer (byte-level BPE or SentencePiece) and chat template stored in GGUF
    metadata (see :mod:`fitserve.loading.gguf_vocab`)."""
    try:
        vocab = GGUFVocab.from_fields(fields, str(fields.get("general.architecture") or ""))
        backend = backend_from_vocab(vocab)
    except VocabError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    special = {
        "bos_token": vocab.token(vocab.bos_token_id),
        "eos_token": vocab.token(vocab.eos_token_id),
        "unk_token": vocab.token(vocab.unk_token_id),
        "pad_token": vocab.token(vocab.pad_token_id),
    }
    return Tokenizer(
        backend,
        bos_token_id=vocab.bos_token_id,
        eos_token_ids=spec.eos_token_ids,
        chat_template=fields.get("tokenizer.chat_template"),
        add_bos_token=vocab.add_bos_token,
        special_tokens=special,
    )


def read_gguf(
    path: Path, dtype: torch.dtype = torch.float32, weights: str | None = None
) -> tuple[ModelSpec, dict[str, HeldTensor], Tokenizer, str, GenerationDefaults,
           dict[str, str]]:
    """Everything a GGUF file holds: (spec, HF-named weights, tokenizer, dominant tensor type,
    the ``general.sampling.*`` defaults, each tensor's ggml type); ``weights`` as in
    :func:`read_gguf_weights`."""
    reader = open_gguf(path)
    fields = _fields(reader)
    header = header_from_reader(reader, path, fields)
    gguf_support(header).require()  # every missing part at once, before any tensor is read
    spec = spec_from_gguf_header(header, require_supported=True)
    tokenizer = tokenizer_from_gguf(fields, spec, path)
    generation = from_gguf_metadata(fields, str(path))
    drop_vocabulary_metadata(reader, fields)
    held, fmt, stored = read_gguf_weights(reader, spec, path, dtype, weights)
    return spec, held, tokenizer, fmt, generation, stored


def drop_vocabulary_metadata(reader: GGUFReader, fields: dict[str, Any]) -> None:
    """Forget the ``tokenizer.ggml.*`` arrays once the tokenizer is built.

    NOTE: a 256k vocabulary (Gemma) is ~180 MiB of Python objects, parsed twice (the reader's
    per-string views and the lists of ``fields``); dropped before any weight is read, it is no
    part of the load's peak RSS beside the weights and the file's mapped pages
    (docs/benchmarks.md, 'Gemma 3 and Phi-3 shapes')."""
    for key in [k for k in reader.fields if k.startswith("tokenizer.ggml.")]:
        del reader.fields[key]
        fields.pop(key, None)


def read_gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a GGUF file, reading metadata only (of any architecture: the spec's
    lenient mode, which the planner uses, supplies the end-of-sequence ids)."""
    reader = open_gguf(path)
    fields = _fields(reader)
    header = header_from_reader(reader, path, fields)
    # NOTE: only the tokenizer must be supported: a vocabulary reads alone (the planner, tests)
    # whatever the architecture; loading the model checks every part (read_gguf).
    gguf_tokenizer_support(header).require()
    return tokenizer_from_gguf(fields, spec_from_gguf_header(header, require_supported=False), path)
