"""Quantization methods for `fitserve quantize`: rtn | awq | gptq -> the engine's held tensors.

Which tensors, in which format (``target_formats``):

    linear projections (q/k/v/o, gate/up/down)   the method's, in --bits / --group-size / --sym:
        int4: int4-g{32|64|128}-{asym|sym}          (asymmetric = f16 min per group, Q4_1-like)
        int8: int8-ch (per channel, the default) or int8-g{32|64|128} (always symmetric)
    token embedding and lm_head                  RTN int8-ch, for both bits: the engine's own
                                                 RTN rule (``plan.formats.RTN_FORMATS``)
    norms, biases                                dense float32, as loaded

- rtn: round to nearest (``fitserve.quant.rtn``) on the float32 weights. A tensor the source
  already stores in the target layout (a GGUF Q4_1 tensor for int4-g32-asym, Q8_0 for
  int8-g32) keeps its blocks as they are, exactly as the engine's ``--weights int4`` does at
  load, so the checkpoint holds the very bytes RTN at load would (no second rounding).
- gptq: error compensation from calibration Hessians (``fitserve.tools.quantize.gptq``); any projection
  without statistics falls back to RTN.
- awq: activation-aware scaling of the float weights (``fitserve.tools.quantize.awq``), then RTN.

awq and gptq read calibration text (required); rtn needs none and ignores it (the CLI warns).
The calibration statistics come from one pass of the dense float32 model
(``fitserve.tools.quantize.calibration.collect_linear_stats``) over the text cut into sequences of at
most ``seq_len`` tokens (BOS first where the tokenizer adds one), the first ``max_seqs`` of
them (``calibration.calibration_token_ids``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fitserve.config import ModelSpec
from fitserve.ledger.formats import RTN_FORMATS, packed_format_name, tensor_role, weight_format
from fitserve.loading import LoadedModel, load_model
from fitserve.quant.held import HeldTensor, as_held
from fitserve.quant.packed import PackedWeight, channel_group
from fitserve.quant.rtn import GROUP_SIZES, quantize

METHODS = ("rtn", "awq", "gptq")
CALIBRATED = ("awq", "gptq")


@dataclass(slots=True)
class QuantResult:
    """What a method made of a model: held tensors (HF names) and the checkpoint's
    ``quantization_config`` (without ``quant_method``: the writer adds it)."""

    spec: ModelSpec
    weights: dict[str, HeldTensor]
    metadata: dict[str, Any] = field(default_factory=dict)


def target_formats(bits: int, group_size: int | None, symmetric: bool) -> tuple[str, str]:
    """(projection format, embedding/lm_head format) for ``bits``/``group_size``/``symmetric``.

    int4 needs a group of 32, 64 or 128; int8 takes None (per channel) or one of those and is
    symmetric whatever ``symmetric`` says. ValueError otherwise.
    """
    embedding = RTN_FORMATS["int8"][1]
    if bits == 4:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 needs --group-size 32, 64 or 128, got {group_size}")
        return packed_format_name("int4", group_size, symmetric=symmetric), embedding
    if bits == 8:
        if group_size is not None and group_size not in GROUP_SIZES:
            raise ValueError(f"int8 takes --group-size 32, 64 or 128 (or none: per channel), "
                             f"got {group_size}")
        return packed_format_name("int8", group_size or 0, symmetric=True,
                                  per_channel=group_size is None), embedding
    raise ValueError(f"--bits must be 4 or 8, got {bits}")


def as_float32(t: HeldTensor) -> torch.Tensor:
    """A held tensor in float32: packed (int4/int8, fp8) ones dequantized exactly."""
    return as_held(t).dequantize(torch.float32)


def dense_weights(weights: Mapping[str, HeldTensor]) -> dict[str, torch.Tensor]:
    """float32 copies of held weights (``as_float32``)."""
    return {n: as_float32(t) for n, t in weights.items()}


def _rtn(t: HeldTensor, fmt: str) -> PackedWeight:
    """RTN into ``fmt``; a tensor already packed in ``fmt`` is kept as it is."""
    if isinstance(t, PackedWeight) and t.format == fmt:
        return t
    return quantize(as_float32(t), fmt)


def _matches(pw: PackedWeight, fmt: str) -> bool:
    """Whether ``pw`` has the layout of ``fmt`` (int8-gK on a K-wide row names itself int8-ch)."""
    layout = weight_format(fmt).packed
    assert layout is not None
    return (pw.kind, pw.group_size, pw.symmetric) == (
        layout.kind, layout.group_size or channel_group(pw.K), layout.symmetric)


def _collect_stats(spec: ModelSpec, dense: Mapping[str, torch.Tensor],
                   chunks: list[list[int]]) -> dict[str, Any]:
    """Per-linear calibration statistics from one pass of the dense float32 model."""
    from fitserve.model.loader import build_model
    from fitserve.tools.quantize.calibration import collect_linear_stats

    model = build_model(spec, dict(dense), dtype=torch.float32, device="cpu",
                        max_positions=max(len(c) for c in chunks))
    with torch.inference_mode():
        stats: dict[str, Any] = collect_linear_stats(model, spec, chunks)
    return stats


def _calibrated(loaded: LoadedModel, method: str, bits: int, group_size: int | None,
                symmetric: bool, chunks: list[list[int]], options: Mapping[str, Any]
                ) -> tuple[dict[str, HeldTensor], dict[str, PackedWeight], dict[str, Any]]:
    """(weights to RTN, weights the method packed itself, the method's details)."""
    dense = dense_weights(loaded.weights)
    stats = _collect_stats(loaded.spec, dense, chunks)
    matrices = {n: w for n, w in dense.items() if tensor_role(n, w.dim()) == "matrix"}
    if method == "gptq":
        from fitserve.tools.quantize.gptq import gptq_quantize_weights

        damp, act_order = float(options.get("damp", 0.01)), bool(options.get("act_order", True))
        packed = gptq_quantize_weights(matrices, stats, bits=bits, group_size=group_size,
                                       symmetric=symmetric, damp=damp, act_order=act_order)
        details = {"damp": damp, "act_order": act_order, "sequential": False,
                   "rtn_fallback": sorted(set(matrices) - set(packed))}
        return dict(dense), packed, {"gptq": details}
    from fitserve.tools.quantize.awq import awq_transform

    grid = int(options.get("grid", 20))
    scaled = awq_transform(dense, loaded.spec, stats, bits=bits,
                           group_size=group_size, symmetric=symmetric, grid=grid)
    return {**dense, **scaled}, {}, {"awq": {"grid": grid}}


def quantize_loaded(loaded: LoadedModel, *, method: str, bits: int, group_size: int | None,
                    symmetric: bool = False, calib_text: str | None = None,
                    calib_name: str | None = None, seq_len: int = 512, max_seqs: int = 16,
                    **options: Any) -> QuantResult:
    """Quantize an already loaded model (see the module docstring); ``options``: gptq's
    ``damp`` (0.01) and ``act_order`` (True), awq's ``grid`` (20). ValueError for an unknown
    method, bits or group size, or a calibrated method without ``calib_text``."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    matrix_fmt, embed_fmt = target_formats(bits, group_size, symmetric)
    symmetric = symmetric or bits == 8
    meta: dict[str, Any] = {"method": method, "bits": bits, "group_size": group_size,
                            "symmetric": symmetric, "embedding_format": embed_fmt,
                            "source": loaded.path.name}
    source: Mapping[str, HeldTensor] = loaded.weights
    packed: dict[str, PackedWeight] = {}
    if method in CALIBRATED:
        if not calib_text:
            raise ValueError(f"--method {method} needs calibration text (--calib FILE)")
        from fitserve.tools.quantize.calibration import calibration_token_ids

        chunks = calibration_token_ids(calib_text, loaded.tokenizer, max_tokens=seq_len,
                                       max_pieces=max_seqs)
        meta["calibration"] = {"file": calib_name, "sha256": hashlib.sha256(
            calib_text.encode("utf-8")).hexdigest(), "tokens": sum(map(len, chunks)),
            "sequences": len(chunks), "seq_len": seq_len}
        source, packed, details = _calibrated(loaded, method, bits, group_size, symmetric,
                                              chunks, options)
        meta.update(details)
    held, formats = _assemble(source, packed, matrix_fmt, embed_fmt)
    meta["formats"] = formats
    return QuantResult(loaded.spec, held, meta)


def _assemble(source: Mapping[str, HeldTensor], packed: Mapping[str, PackedWeight],
              matrix_fmt: str, embed_fmt: str) -> tuple[dict[str, HeldTensor], dict[str, str]]:
    """Every tensor in its final form, and the packed ones' formats."""
    held: dict[str, HeldTensor] = {}
    formats: dict[str, str] = {}
    for name, t in source.items():
        role = tensor_role(name, len(t.shape))
        if role == "vector":
            held[name] = as_float32(t)
            continue
        fmt = matrix_fmt if role == "matrix" else embed_fmt
        pw = packed[name] if name in packed else _rtn(t, fmt)
        if not _matches(pw, fmt):
            raise RuntimeError(f"{name}: the method returned {pw.format}, expected {fmt}")
        held[name], formats[name] = pw, pw.format
    return held, formats


def quantize_model(path: str | Path, *, method: str, bits: int, group_size: int | None,
                   symmetric: bool = False, calib_text: str | None = None, **kwargs: Any
                   ) -> tuple[ModelSpec, dict[str, HeldTensor], dict[str, Any]]:
    """Load ``path`` (a .gguf, an HF folder or a known name) and quantize it:
    (spec, held tensors by HF name, quantization_config metadata); see ``quantize_loaded``."""
    loaded = load_model(path, dtype=torch.float32, weights="as-stored")
    result = quantize_loaded(loaded, method=method, bits=bits, group_size=group_size,
                             symmetric=symmetric, calib_text=calib_text, **kwargs)
    return result.spec, result.weights, result.metadata
