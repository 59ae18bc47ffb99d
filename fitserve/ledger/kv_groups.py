"""The KV pool split into layer groups, one pool per attention kind, as the engine allocates it.
Torch-free.

A model with one attention kind has one group and one pool (a windowed one keeps a null block,
fitserve.kv.group). A hybrid model (``layer_types`` mixing "sliding" and "full": Gemma 2/3) has
a full group and a windowed group, each with its own pool whose block holds ``block_size``
tokens of *its* layers only.

How the budget is split (llama.cpp's SWA cache sizes its windowed cache the same way): the
windowed pool gets what its sequences can hold at once, at most ::

    max_num_seqs x (window_span_blocks(window, block) + 1)  +  ceil(max_num_batched_tokens / block)

(each running sequence its window and the partial blocks at both ends, plus one step's token
budget of new blocks), and never more blocks than the full pool, since a windowed table holds a
subset of the full table's positions; the full pool gets the rest. Short contexts then run
exactly as without windows, and long ones are bounded by the full pool alone.

NOTE: vLLM instead shares one pool by giving every group the same page size (groups of equal
layer counts, one tensor per layer slot shared across groups). One pool per group keeps one
tensor per layer with its own group's block ids, so one-kind models keep today's layout and
path unchanged, and the ledger can state each pool exactly; the price is that the split is
fixed at start-up by the rule above rather than by the live mix of requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.kv import (
    kv_block_scale_bytes,
    kv_layer_bytes_per_token,
    layer_kinds,
    window_blocks_held,
    window_span_blocks,
)


@dataclass(frozen=True)
class KVGroupPlan:
    """One layer group's pool: ``num_blocks`` blocks of ``block_bytes`` (its layers only);
    a windowed group's null block is one of them (``usable_blocks`` leaves it out)."""

    kind: str  # "full" or "sliding"
    window: int | None
    layers: tuple[int, ...]
    num_blocks: int
    block_bytes: int

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - (self.window is not None)

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def kv_group_layers(spec: ModelSpec) -> list[tuple[str, int | None, tuple[int, ...]]]:
    """(kind, window, layer indices) of each group, full first; one group for a one-kind model."""
    kinds = layer_kinds(spec)
    unknown = sorted(set(kinds) - {"full", "sliding"})
    if unknown:
        raise PlanError(f"layer_types must be 'full' or 'sliding', got {unknown}")
    out: list[tuple[str, int | None, tuple[int, ...]]] = []
    for kind in ("full", "sliding"):
        layers = tuple(i for i, k in enumerate(kinds) if k == kind)
        if layers:
            if kind == "sliding" and not spec.sliding_window:
                raise PlanError("sliding layers need a sliding_window")
            out.append((kind, spec.sliding_window if kind == "sliding" else None, layers))
    return out


def group_block_bytes(spec: ModelSpec, layers: tuple[int, ...], block_size: int, kv_dtype: str,
                      tp: int = 1) -> int:
    """Bytes of one block of a group: ``block_size`` tokens of its layers, plus its layers' share
    of the per-block key scales of a per-channel-key format (int8's default: one f32 per KV
    head and channel per layer and block, whatever the block's fill)."""
    scales = kv_block_scale_bytes(spec, kv_dtype, tp=tp) // spec.num_layers * len(layers)
    return len(layers) * block_size * kv_layer_bytes_per_token(spec, kv_dtype, tp=tp) + scales


def plan_kv_groups(spec: ModelSpec, budget_bytes: int, block_size: int, kv_dtype: str, *,
                   max_num_seqs: int, max_num_batched_tokens: int, tp: int = 1
                   ) -> tuple[KVGroupPlan, ...]:
    """The pools of every layer group within ``budget_bytes`` (module docstring's split)."""
    groups = kv_group_layers(spec)
    sizes = [group_block_bytes(spec, g[2], block_size, kv_dtype, tp) for g in groups]
    if len(groups) == 1:
        (kind, window, layers), (b,) = groups[0], sizes
        return (KVGroupPlan(kind, window, layers, max(0, budget_bytes) // b, b),)
    (_, _, full_layers), (_, window, sw_layers) = groups
    assert window is not None
    bf, bsw = sizes
    cap = (max_num_seqs * (window_span_blocks(window, block_size) + 1)
           + -(-max_num_batched_tokens // block_size))
    full = (budget_bytes - (cap + 1) * bsw) // bf
    if full < cap:  # the window never binds: both pools the same length (+ the null block)
        full = max(0, budget_bytes - bsw) // (bf + bsw)
        windowed = full + 1
    else:
        windowed = cap + 1
    return (KVGroupPlan("full", None, full_layers, full, bf),
            KVGroupPlan("sliding", window, sw_layers, windowed, bsw))


def request_group_blocks(groups: tuple[KVGroupPlan, ...], block_size: int, context: int,
                         computed: int | None = None) -> tuple[int, ...]:
    """Blocks one sequence holds in each group with slots for ``context`` tokens, ``computed``
    of them computed (default ``context - 1``: a decode step)."""
    done = context - 1 if computed is None else computed
    return tuple(window_blocks_held(block_size, max(0, done), context, g.window) for g in groups)


def grouped_max_concurrency(groups: tuple[KVGroupPlan, ...], block_size: int, context: int) -> int:
    """Sequences of ``context`` tokens (decoding) that fit at once: the tightest group."""
    per_seq = request_group_blocks(groups, block_size, context)
    return min(g.usable_blocks // n for g, n in zip(groups, per_seq, strict=True) if n)


def windowed_pools(spec: ModelSpec, pool_bytes: int, block_size: int, kv_dtype: str, *,
                   max_num_seqs: int, max_num_batched_tokens: int, tp: int = 1
                   ) -> tuple[KVGroupPlan, ...]:
    """The group pools of a model with sliding-window layers; () for one without (its one full
    pool is the plain ``num_kv_blocks x kv_block_bytes``)."""
    if "sliding" not in layer_kinds(spec):
        return ()
    return plan_kv_groups(spec, pool_bytes, block_size, kv_dtype, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, tp=tp)


def request_kv_held(spec: ModelSpec, context: int, block_size: int, kv_dtype: str, *, tp: int = 1
                    ) -> tuple[tuple[int, ...], int]:
    """What the engine holds for one sequence decoding at ``context`` tokens: (blocks per layer
    group, bytes); windowed groups only their window's blocks (whole blocks, so a little more
    than ``request_kv().bytes_reclaimed``'s tokens)."""
    out, total = [], 0
    for _, window, layers in kv_group_layers(spec):
        n = window_blocks_held(block_size, context - 1, context, window)
        out.append(n)
        total += n * group_block_bytes(spec, layers, block_size, kv_dtype, tp)
    return tuple(out), total
