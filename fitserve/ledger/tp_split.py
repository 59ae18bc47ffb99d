"""Whether a model splits over ``tp`` ranks the Megatron way: one rule for the engine and the
planner (torch-free).

The engine (``fitserve.dist.layout.check_tp_layout``) asks it with the column blocks of the
weights it holds (``HeldWeight.column_block``); the planner asks it with the column blocks of
a format or a per-tensor mix (``format_column_block`` of each row-parallel tensor's format), so
a layout the engine refuses is never offered::

    heads           num_heads % tp == 0; KV heads split (kv % tp) or replicated (tp % kv)
    MLP widths      intermediate, expert intermediate, shared expert: each % tp == 0
    row-parallel    o_proj, down_proj (dense / shared): (width / tp) % block == 0, width the
    column blocks   q heads x head_dim or the MLP's; the routed experts' down_proj: the
                    expert intermediate / tp, e.g. gpt-oss MXFP4 (32 per block):
                    2880 / 2 = 1440 = 45 blocks (splits), 2880 / 4 = 720 = 22.5 (does not)
"""

from __future__ import annotations

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import weight_format
from fitserve.ledger.kv import check_tp
from fitserve.ledger.params import is_mla
from fitserve.ledger.weights import resolve_mix

# the engine's per-output-channel int8 splits its columns at its 32-column activation block
# (fitserve.quant.packed.CHANNEL_PAD)
CHANNEL_BLOCK = 32
# the planner's names of row-parallel tensors (fitserve.ledger.params): dense ones, the experts'
DENSE_ROW_TENSORS = ("attn_o", "ffn_down", "shared_down")
EXPERT_ROW_TENSORS = ("expert_down",)


def tp_split_problem(spec: ModelSpec, tp: int, *, group_sizes: tuple[int, ...] = (),
                     expert_group_sizes: tuple[int, ...] = ()) -> str | None:
    """Why ``spec`` does not split over ``tp`` ranks (None: it does). ``group_sizes``: the
    column blocks of the row-parallel weights (o_proj, the dense and the shared expert's
    down_proj; 0 = cannot be split by columns at all), ``expert_group_sizes`` those of the
    routed experts' down_proj."""
    if tp < 1:
        return f"tensor_parallel_size must be >= 1, got {tp}"
    if tp == 1:
        return None
    name = spec.name or spec.architecture
    if spec.num_heads % tp:
        return (f"{name}: num_heads={spec.num_heads} is not divisible by "
                f"tensor_parallel_size={tp}")
    kv = spec.num_kv_heads
    if not is_mla(spec) and ((kv % tp) if tp <= kv else (tp % kv)):
        return (f"{name}: num_kv_heads={kv} and tensor_parallel_size={tp}: one must divide the "
                "other (KV heads are split, or replicated when tp exceeds them)")
    widths = [("intermediate_size", spec.intermediate_size)]
    if spec.num_experts:  # each expert split the Megatron way, as a dense MLP
        widths.append(("expert intermediate size", spec.expert_intermediate_size))
    if spec.shared_expert_intermediate_size:
        widths.append(("shared_expert_intermediate_size", spec.shared_expert_intermediate_size))
    for what, k in widths:
        if k % tp:
            return f"{name}: {what}={k} is not divisible by tensor_parallel_size={tp}"
    dense = [(what, k) for what, k in widths if what != "expert intermediate size"]
    expert = [(what, k) for what, k in widths if what == "expert intermediate size"]
    checks = [(g, (("num_heads x head_dim", spec.q_size), *dense)) for g in group_sizes]
    checks += [(g, tuple(expert)) for g in expert_group_sizes]
    for g, sizes in checks:
        for what, k in sizes:
            if g == 0:
                return (f"{name}: its row-parallel weights are held act-order (input columns "
                        f"permuted) and are not split by columns; use --tp 1")
            if (k // tp) % g:
                return (f"{name}: {what}={k} / tensor_parallel_size={tp} = {k // tp} columns "
                        f"per rank is not a whole number of the packed weights' groups of {g}; "
                        "use --weights bf16 or another --tp")
    if spec.vocab_size < tp:
        return f"{name}: vocab_size={spec.vocab_size} < tensor_parallel_size={tp}"
    return None


def format_column_block(fmt: str) -> int:
    """Input columns a split of a weight held in ``fmt`` must fall on multiples of, as the
    engine's held weight says (``HeldWeight.column_block``): a packed layout's group (per
    channel: 32), a block format's block (ggml types, MXFP4: 32; K-quants: 256), a tiled
    format's tile (fp8-block: 128); 0 for an act-order (column-permuted) weight, which is never
    split by columns; 1 for a plain dtype or per-tensor / per-channel scales."""
    f = weight_format(fmt)
    if f.col_index_bytes:
        return 0
    if f.packed is not None:
        return f.packed.group_size or CHANNEL_BLOCK
    return f.tile or f.block_elements


def mix_row_blocks(fmt: str, base_dtype: str = "bf16") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dense, expert) column blocks of the row-parallel tensors of a format or a mix, each
    block > 1 once (ascending): what ``tp_split_problem`` takes as ``group_sizes`` and
    ``expert_group_sizes``. A mix's rule that covers only some layers adds its format beside
    the mix's default."""
    mix = resolve_mix(fmt, base_dtype)

    def blocks(names: tuple[str, ...]) -> tuple[int, ...]:
        fmts: set[str] = set()
        for name in names:
            rules = [r for r in mix.rules if name in r.names]
            fmts |= {r.fmt for r in rules}
            if not any(r.layers == "all" for r in rules):
                fmts.add(mix.default)
        return tuple(sorted({b for b in map(format_column_block, fmts) if b != 1}))

    return blocks(DENSE_ROW_TENSORS), blocks(EXPERT_ROW_TENSORS)


def check_tp_split(spec: ModelSpec, tp: int, weights_fmt: str, base_dtype: str = "bf16") -> None:
    """PlanError unless ``spec`` in ``weights_fmt`` (a format or a mix) splits over ``tp``
    ranks by the engine's rule (``tp_split_problem``); the heads first, as ``kv.check_tp``
    words them."""
    check_tp(spec, tp)
    dense, expert = mix_row_blocks(weights_fmt, base_dtype)
    problem = tp_split_problem(spec, tp, group_sizes=dense, expert_group_sizes=expert)
    if problem is not None:
        raise PlanError(f"--tp {tp}: {problem}")
