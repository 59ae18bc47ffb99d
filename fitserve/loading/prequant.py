"""Reading a pre-quantized checkpoint's weights (compressed-tensors, GPTQ, AWQ) out of its
safetensors files: gather each quantized Linear's tensors, hold them as stored
(``fitserve.quant.hf_checkpoint_formats``), or as the ``--weights`` choice says."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fitserve.config import ModelSpec
from fitserve.ledger.weight_names import expected_weight_shapes
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.hf_config import read_json
from fitserve.loading.hf_quant_config import PrequantConfig, read_prequant
from fitserve.quant.convert import held_format, hold
from fitserve.quant.held import HeldTensor, HeldWeight, dtype_table_name
from fitserve.quant.hf_checkpoint_formats import PARTS, Rounding, convert

log = logging.getLogger(__name__)


def rehold(name: str, w: HeldWeight, dtype: torch.dtype, weights: str | None) -> HeldTensor:
    """A weight held in an engine format, as ``weights`` holds it (None: dense ``dtype``): as
    it is where that is its format, else dequantized exactly in float32, then RTN-packed or
    cast."""
    want = dtype_table_name(dtype) if weights is None else held_format(weights, name, 2, w.format,
                                                                       dtype)
    if want == w.format:
        return w
    # NOTE: another layout, or dense: dequantized in float32 exactly, then RTN-packed or cast,
    # one tensor at a time like every other loader path.
    return hold(w.dequantize(torch.float32), want)


@dataclass
class PrequantPieces:
    """The quantized weights' tensors of one checkpoint, gathered as the files are read."""

    config: PrequantConfig
    shapes: dict[str, tuple[int, ...]]
    source: Path
    pieces: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def of_folder(cls, config_path: Path, spec: ModelSpec) -> PrequantPieces | None:
        """The gatherer of a folder whose config.json is pre-quantized, else None."""
        try:
            pre = read_prequant(read_json(config_path))
        except ValueError as exc:
            raise ModelLoadError(f"{config_path}: {exc}") from exc
        return None if pre is None else cls(pre, expected_weight_shapes(spec), config_path.parent)

    def takes(self, prefix: str, part: str) -> bool:
        """Whether tensor ``<prefix>.<part>`` is a quantized weight's (not a dense tensor)."""
        return part in PARTS[self.config.method]

    def hold_all(self, out: dict[str, HeldTensor], stored_as: dict[str, str],
                 stored: Counter[str], dtype: torch.dtype, weights: str | None,
                 source: Path) -> None:
        """Convert every gathered weight into ``out`` (HF name ``<prefix>.weight``), recording
        the format it is stored as (an engine layout, or ``dtype`` where it is dequantized)."""
        held_as: Counter[str] = Counter()
        rounding = Rounding()
        for prefix, parts in self.pieces.items():
            name = prefix + ".weight"
            scheme = self.config.scheme_for(prefix)
            shape = self.shapes.get(name)
            if scheme is None or shape is None or len(shape) != 2:
                raise ModelLoadError(f"{source}: {prefix}.{next(iter(parts))} is stored quantized, "
                                     "but quantization_config leaves it unquantized or the model "
                                     "has no such weight matrix")
            if name in out:
                raise ModelLoadError(f"{source}: tensor {name!r} is stored both dense and "
                                     f"quantized ({scheme.tag})")
            try:
                held = convert(name, parts, scheme, (shape[0], shape[1]), dtype, rounding)
            except KeyError as exc:
                raise ModelLoadError(f"{source}: {prefix}.{exc.args[0]} missing ({scheme.tag})"
                                     ) from exc
            except ValueError as exc:
                raise ModelLoadError(f"{source}: tensor {name!r} ({scheme.tag}): {exc}") from exc
            if isinstance(held, HeldWeight):
                fmt = held.format
                out[name] = rehold(name, held, dtype, weights)
            else:
                fmt = dtype_table_name(dtype)
                out[name] = held if weights is None else hold(held, held_format(
                    weights, name, 2, fmt, dtype))
            stored_as[name] = fmt
            stored[fmt] += shape[0] * shape[1]
            held_as[fmt] += 1
        log.info("%s: %s checkpoint (%s), %s", source, self.config.method, self.config.tag,
                 ", ".join(f"{n} weights as {f}" for f, n in held_as.items()))
        if rounding.rounded:  # NOTE: see fitserve.quant.hf_checkpoint_formats (f16 scales/mins)
            log.info("%s: %d of %d group scales/mins rounded to float16 (max relative error "
                     "%.2g)", source, rounding.rounded, rounding.total, rounding.worst)
