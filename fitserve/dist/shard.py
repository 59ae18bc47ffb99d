"""Slice the loaded weights (Hugging Face names, held as loaded) into one rank's shard.

Dense tensors are sliced and copied; packed int4/int8 weights are sliced in their packed
layout, which is exact: output rows move as they are, and input columns split at group
bounds (``layout.check_tp_layout`` guarantees it), so a shard dequantizes to the same slice
of the dequantized whole. Per-channel int8 keeps each row's scale on every column slice.
"""

from __future__ import annotations

import re

import torch

from fitserve.config import ModelSpec
from fitserve.dist.layout import RankSlice, TPLayoutError
from fitserve.quant.fp8 import Fp8Weight
from fitserve.quant.hold import HeldTensor
from fitserve.quant.packed import CHANNEL_PAD, PackedWeight, channel_group

_LAYER = re.compile(r"(?:model\.)?layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
# which dimension of which projection is split, and by what range of RankSlice
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "inter", "up_proj": "inter"}
_ROW = {"o_proj": "q", "down_proj": "inter"}


def row_parallel_groups(weights: dict[str, HeldTensor]) -> tuple[int, ...]:
    """The column groups row-parallel packed weights must split at (per-channel int8: 32, the
    activation quantization block), for ``check_tp_layout``."""
    out: set[int] = set()
    for name, w in weights.items():
        m = _LAYER.search(name)
        if m and m.group(2) in _ROW and isinstance(w, PackedWeight):
            out.add(CHANNEL_PAD if w.per_channel else w.group_size)
    return tuple(sorted(out))


def shard_weights(spec: ModelSpec, weights: dict[str, HeldTensor], s: RankSlice
                  ) -> dict[str, HeldTensor]:
    """Rank ``s.rank``'s tensors under the same names (see fitserve.dist.layout)."""
    hd = spec.head_dim
    ranges = {"q": (s.q_heads[0] * hd, s.q_heads[1] * hd),
              "kv": (s.kv_heads[0] * hd, s.kv_heads[1] * hd), "inter": s.intermediate}
    out: dict[str, HeldTensor] = {}
    for name, w in weights.items():
        m = _LAYER.search(name)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = _rows(w, s.vocab, name)
        elif m and m.group(2) in _COLUMN:
            out[name] = _rows(w, ranges[_COLUMN[m.group(2)]], name)
        elif m and m.group(2) in _ROW:
            if m.group(3) == "bias":
                raise TPLayoutError(f"{name}: a bias on a row-parallel projection is not "
                                    "supported under tensor parallelism")
            out[name] = _columns(w, ranges[_ROW[m.group(2)]], name)
        else:
            out[name] = w  # norms: every rank holds them whole
    return out


def _rows(w: HeldTensor, r: tuple[int, int], name: str) -> HeldTensor:
    if isinstance(w, PackedWeight):
        return w.select_rows(torch.arange(r[0], r[1]))
    if isinstance(w, Fp8Weight):
        raise TPLayoutError(f"{name}: fp8 weights are not supported under tensor parallelism")
    return w[r[0]:r[1]].clone()


def _columns(w: HeldTensor, r: tuple[int, int], name: str) -> HeldTensor:
    c0, c1 = r
    if isinstance(w, Fp8Weight):
        raise TPLayoutError(f"{name}: fp8 weights are not supported under tensor parallelism")
    if not isinstance(w, PackedWeight):
        return w[:, c0:c1].clone()
    k = c1 - c0
    if w.per_channel:  # one scale per row: every column slice keeps it
        g = channel_group(k)
        q = torch.zeros((w.N, g), dtype=torch.int8)
        q[:, :k] = w.qweight[:, c0:c1]
        return PackedWeight("int8", w.N, k, g, g, q, w.scales.clone())
    g = w.group_size
    if c0 % g or c1 % g or c1 > w.K:
        raise TPLayoutError(f"{name}: columns {c0}..{c1} do not split at its groups of {g}")
    per_byte = 2 if w.kind == "int4" else 1
    mins = None if w.mins is None else w.mins[:, c0 // g:c1 // g].clone()
    return PackedWeight(w.kind, w.N, k, k, g, w.qweight[:, c0 // per_byte:c1 // per_byte].clone(),
                        w.scales[:, c0 // g:c1 // g].clone(), mins)
