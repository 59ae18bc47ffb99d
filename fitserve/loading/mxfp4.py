"""gpt-oss's MXFP4 experts in a Hugging Face checkpoint (``quant_method: mxfp4``), held as
ggml MXFP4 blocks (fitserve.quant.ggml_blocks: 17 bytes per 32 weights = 4.25 bits).

The checkpoint (OpenAI's layout, read by transformers' integrations/mxfp4.py) stores each
3-D expert projection ``mlp.experts.{gate_up,down}_proj`` of N output rows and K inputs as::

    *_blocks uint8 [E, N, K/32, 16]   byte j of a group: element 2j (low nibble), 2j+1 (high)
    *_scales uint8 [E, N, K/32]       w = FP4_VALUES[code] * 2^(scale - 127)

ggml's block_mxfp4 is ``e u8 | qs 16 B``, byte j holding element j (low) and j + 16 (high),
w = kvalues_mxfp4[code] * 2^(e - 128) with kvalues = 2 x the e2m1 values: the same codes and
the same exponent byte, so the conversion moves nibbles and nothing else (exact). gate_up's
rows interleave gate and up (row 2i: gate i, row 2i + 1: up i), as its bf16 form's columns.
"""

from __future__ import annotations

import re
from collections import Counter

import torch

from fitserve.config import ModelSpec
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.prequant import rehold
from fitserve.quant.ggml_blocks import GgmlBlockWeight
from fitserve.quant.held import HeldTensor

_PART = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales)$")


def hf_mxfp4_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [..., G, 16]``, ``scales [..., G]`` (uint8) -> ggml MXFP4 rows
    ``[..., G * 17]``: each group's scale byte, then its codes in ggml's nibble order."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales "
                         f"{list(scales.shape)} (blocks [..., G, 16], scales [..., G])")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), qs), dim=-1).reshape(*blocks.shape[:-2], -1)


class Mxfp4Experts:
    """Gathers a gpt-oss checkpoint's ``*_blocks`` / ``*_scales`` as the files are read, then
    holds each expert's gate, up and down as the ``--weights`` choice says (as stored:
    GgmlBlockWeight "MXFP4"; else dequantized exactly, then cast or RTN-packed)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def takes(self, name: str) -> bool:
        return _PART.fullmatch(name) is not None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        m = _PART.fullmatch(name)
        assert m is not None, name
        self.parts.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = tensor

    def hold_all(self, out: dict[str, HeldTensor], stored_as: dict[str, str],
                 stored: Counter[str], dtype: torch.dtype, weights: str | None,
                 source: object) -> None:
        """Put every expert weight into ``out`` (and its stored format "MXFP4" into
        ``stored_as``; its elements into ``stored``)."""
        e, h, inter = self.spec.num_experts, self.spec.hidden_size, self.spec.expert_intermediate_size
        for (stem, proj), pair in self.parts.items():
            if set(pair) != {"blocks", "scales"}:
                raise ModelLoadError(f"{source}: {stem}.{proj} has MXFP4 "
                                     f"{', '.join(sorted(pair))} but not both blocks and scales")
            n, k = (2 * inter, h) if proj == "gate_up_proj" else (h, inter)
            want = (e, n, k // 32, 16)
            if tuple(pair["blocks"].shape) != want or k % 32:
                raise ModelLoadError(f"{source}: {stem}.{proj}_blocks has shape "
                                     f"{list(pair['blocks'].shape)}, expected {list(want)}")
            try:
                rows = hf_mxfp4_to_ggml(pair["blocks"], pair["scales"])  # [E, N, K/32 * 17]
            except ValueError as exc:
                raise ModelLoadError(f"{source}: {stem}.{proj}: {exc}") from exc
            for x in range(e):
                split = ([("gate_proj", rows[x, 0::2]), ("up_proj", rows[x, 1::2])]
                         if proj == "gate_up_proj" else [("down_proj", rows[x])])
                for part, r in split:
                    name = f"{stem}.{x}.{part}.weight"
                    w = GgmlBlockWeight("MXFP4", r.shape[0], k, r.contiguous())
                    out[name] = rehold(name, w, dtype, weights)
                    stored_as[name] = "MXFP4"
                    stored["MXFP4"] += r.shape[0] * k
