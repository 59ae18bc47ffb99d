"""Slice the loaded weights (Hugging Face names, held as loaded) into one rank's shard.

Dense tensors are sliced and copied; packed int4/int8 weights are sliced in their packed
layout, which is exact: output rows move as they are, and input columns split at group
bounds (``layout.check_tp_layout`` guarantees it), so a shard dequantizes to the same slice
of the dequantized whole. Per-channel int8 keeps each row's scale on every column slice.
"""

from __future__ import annotations

import re

from fitserve.config import ModelSpec
from fitserve.dist.layout import RankSlice, TPLayoutError
from fitserve.quant.held import HeldTensor, as_held, as_stored

_LAYER = re.compile(r"(?:model\.)?layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
# which dimension of which projection is split, and by what range of RankSlice
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "inter", "up_proj": "inter"}
_ROW = {"o_proj": "q", "down_proj": "inter"}
# a routed expert's or the shared expert's projections: split as a dense MLP's, over their width
_EXPERT = re.compile(r"layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\.(gate_proj|up_proj|"
                     r"down_proj)\.weight$")


def row_parallel_groups(weights: dict[str, HeldTensor]) -> tuple[int, ...]:
    """The column blocks row-parallel weights must split at (``HeldWeight.column_block``: a
    packed weight's groups, per-channel int8's 32-column activation block), for
    ``check_tp_layout``."""
    out: set[int] = set()
    for name, w in weights.items():
        m = _LAYER.search(name)
        x = _EXPERT.search(name)
        block = as_held(w).column_block
        if ((m and m.group(2) in _ROW) or (x and x.group(2) == "down_proj")) and block > 1:
            out.add(block)
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
        x = _EXPERT.search(name)
        if x is not None:
            r = s.shared_intermediate if x.group(1) == "shared_expert" else s.expert_intermediate
            out[name] = _shard(w, 1 if x.group(2) == "down_proj" else 0, r, name)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = _shard(w, 0, s.vocab, name)
        elif m and m.group(2) in _COLUMN:
            out[name] = _shard(w, 0, ranges[_COLUMN[m.group(2)]], name)
        elif m and m.group(2) in _ROW:
            if m.group(3) == "bias":
                raise TPLayoutError(f"{name}: a bias on a row-parallel projection is not "
                                    "supported under tensor parallelism")
            out[name] = _shard(w, 1, ranges[_ROW[m.group(2)]], name)
        else:
            out[name] = w  # norms: every rank holds them whole
    return out


def _shard(w: HeldTensor, dim: int, r: tuple[int, int], name: str) -> HeldTensor:
    try:
        return as_stored(as_held(w).shard(dim, r[0], r[1]))
    except ValueError as e:  # the format cannot split there (fp8; columns inside a group)
        raise TPLayoutError(f"{name}: {e}") from e
