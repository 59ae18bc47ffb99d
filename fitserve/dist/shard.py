"""Slice the loaded weights (Hugging Face names, held as loaded) into one rank's shard.

Dense tensors are sliced and copied; packed int4/int8 weights are sliced in their packed
layout, which is exact: output rows move as they are, and input columns split at group
bounds (``layout.check_tp_layout`` guarantees it), so a shard dequantizes to the same slice
of the dequantized whole. Per-channel int8 keeps each row's scale on every column slice;
ggml blocks (gpt-oss's MXFP4 experts) split their columns at whole 32-weight blocks.

Biases: a column-parallel projection's (q/k/v, an expert's gate/up) split with its rows; a
row-parallel projection's (o_proj, an expert's down_proj) is held by rank 0 only (zeros on
the others), so the all-reduce adds it once. gpt-oss's sinks split with the query heads; the
router and its bias are whole on every rank.
"""

from __future__ import annotations

import re

import torch

from fitserve.config import ModelSpec
from fitserve.dist.layout import RankSlice, TPLayoutError
from fitserve.quant.held import HeldTensor, as_held, as_stored

_LAYER = re.compile(r"(?:model\.)?layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
# gpt-oss's attention sinks: one logit per query head, split with the heads
_SINKS = re.compile(r"(?:model\.)?layers\.\d+\.self_attn\.sinks$")
# which dimension of which projection is split, and by what range of RankSlice
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "inter", "up_proj": "inter"}
_ROW = {"o_proj": "q", "down_proj": "inter"}
# a routed expert's or the shared expert's projections: split as a dense MLP's, over their width
# (gpt-oss's experts have biases: gate/up's split with their rows, down's added once)
_EXPERT = re.compile(r"layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\.(gate_proj|up_proj|"
                     r"down_proj)\.(weight|bias)$")


def row_parallel_groups(weights: dict[str, HeldTensor], *, routed_experts: bool = False
                        ) -> tuple[int, ...]:
    """The column blocks row-parallel weights must split at (``HeldWeight.column_block``: a
    packed weight's groups, per-channel int8's 32-column activation block, a ggml type's
    block: MXFP4's 32), for ``check_tp_layout``: of o_proj, the dense and the shared expert's
    down_proj; with ``routed_experts``, of the routed experts' down_proj only."""
    out: set[int] = set()
    for name, w in weights.items():
        m = _LAYER.search(name)
        x = _EXPERT.search(name)
        if x is not None:
            routed = x.group(1) != "shared_expert"
            row = x.group(2) == "down_proj" and x.group(3) == "weight" and routed == routed_experts
        else:
            row = not routed_experts and m is not None and m.group(2) in _ROW
        block = as_held(w).column_block
        if row and block > 1:
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
            if x.group(2) != "down_proj":
                out[name] = _shard(w, 0, r, name)
            elif x.group(3) == "bias":
                out[name] = _once(w, s, name)
            else:
                out[name] = _shard(w, 1, r, name)
        elif _SINKS.search(name):
            out[name] = _shard(w, 0, (s.q_heads[0], s.q_heads[1]), name)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = _shard(w, 0, s.vocab, name)
        elif m and m.group(2) in _COLUMN:
            out[name] = _shard(w, 0, ranges[_COLUMN[m.group(2)]], name)
        elif m and m.group(2) in _ROW:
            out[name] = (_once(w, s, name) if m.group(3) == "bias"
                         else _shard(w, 1, ranges[_ROW[m.group(2)]], name))
        else:
            out[name] = w  # norms, the router (and its bias): every rank holds them whole
    return out


def _once(bias: HeldTensor, s: RankSlice, name: str) -> HeldTensor:
    """A row-parallel projection's bias (o_proj's, an expert's down_proj's): added once to the
    sum of the ranks' partial products, so rank 0 holds it and the others hold zeros.
    NOTE: zeros rather than no bias, so every rank builds the same modules and holds the
    bytes the ledger counts for its shard; the all-reduce then adds the bias exactly once."""
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
        raise TPLayoutError(f"{name}: a row-parallel bias must be a dense vector")
    return bias if s.rank == 0 else torch.zeros_like(bias)


def _shard(w: HeldTensor, dim: int, r: tuple[int, int], name: str) -> HeldTensor:
    try:
        return as_stored(as_held(w).shard(dim, r[0], r[1]))
    except ValueError as e:  # the format cannot split there (fp8; columns inside a group)
        raise TPLayoutError(f"{name}: {e}") from e
