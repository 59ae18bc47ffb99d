"""Which rank holds what under Megatron tensor parallelism (torch-free, pure arithmetic).

Per layer, for ``tp`` ranks::

    q/k/v, gate/up   column-parallel: rank r holds output rows of its heads / its slice of I
    o, down          row-parallel:    rank r holds the matching input columns; the partial
                                      sums meet in one all-reduce each (2 per layer)
    embedding        vocab-parallel:  rank r holds token rows [v0, v1); lookups outside are
                                      zeros, one all-reduce per step completes the rows
    lm_head          vocab-parallel:  rank r computes logits [v0, v1); rank 0 gathers them

KV heads: with ``tp <= num_kv_heads`` rank r holds ``num_kv_heads / tp`` of them; with more
ranks than KV heads each KV head is replicated on ``tp / num_kv_heads`` ranks, and rank r
holds the one KV head its query heads use::

    num_heads 8, num_kv_heads 2, tp 4:   rank   0    1    2    3
                                         q      0,1  2,3  4,5  6,7
                                         kv     0    0    1    1     (query head h -> kv h // 4)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.tp_split import tp_split_problem


class TPLayoutError(ValueError):
    """The model cannot be split over this many ranks (raised before any process starts)."""


@dataclass(frozen=True, slots=True)
class RankSlice:
    """What rank ``rank`` of ``tp`` holds, as index ranges of the whole model's tensors."""

    rank: int
    tp: int
    q_heads: tuple[int, int]  # [first, last) query heads
    kv_heads: tuple[int, int]  # [first, last) KV heads
    intermediate: tuple[int, int]  # [first, last) MLP rows (gate/up) = columns (down)
    vocab: tuple[int, int]  # [first, last) token ids of the embedding and lm_head
    vocab_shard: int  # the largest rank's vocabulary rows: the logits gather's width
    # mixture of experts: [first, last) rows of every routed expert's gate/up (= columns of its
    # down), and of the shared expert's; (0, 0) for a dense model
    expert_intermediate: tuple[int, int] = (0, 0)
    shared_intermediate: tuple[int, int] = (0, 0)


def check_tp_layout(spec: ModelSpec, tp: int, *, group_sizes: tuple[int, ...] = (),
                    expert_group_sizes: tuple[int, ...] = ()) -> None:
    """TPLayoutError naming the size that does not divide; ``group_sizes`` are the quantization
    groups of row-parallel weights held packed (their input columns split at group bounds),
    ``expert_group_sizes`` those of the routed experts' down_proj (gpt-oss's MXFP4: 32).
    NOTE: the rule is the ledger's (``tp_split_problem``), so the planner's layouts are the
    ones the engine accepts."""
    problem = tp_split_problem(spec, tp, group_sizes=group_sizes,
                               expert_group_sizes=expert_group_sizes)
    if problem is not None:
        raise TPLayoutError(problem)


def _split(n: int, tp: int, rank: int) -> tuple[int, int]:
    """Even split of range(n) with the remainder on the first ranks (ceil-sized shards)."""
    base, extra = divmod(n, tp)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_slice(spec: ModelSpec, tp: int, rank: int) -> RankSlice:
    check_tp_layout(spec, tp)
    if not 0 <= rank < tp:
        raise TPLayoutError(f"rank {rank} is outside 0..{tp - 1}")
    hq, kv = spec.num_heads, spec.num_kv_heads
    q0 = rank * hq // tp
    q = (q0, q0 + hq // tp)
    if tp <= kv:
        kvr = (rank * kv // tp, (rank + 1) * kv // tp)
    else:
        head = q0 // (hq // kv)  # the KV head of this rank's query heads
        kvr = (head, head + 1)
    inter = spec.intermediate_size // tp
    expert = spec.expert_intermediate_size // tp if spec.num_experts else 0
    shared = spec.shared_expert_intermediate_size // tp
    return RankSlice(rank, tp, q, kvr, (rank * inter, (rank + 1) * inter),
                     _split(spec.vocab_size, tp, rank), -(-spec.vocab_size // tp),
                     (rank * expert, (rank + 1) * expert), (rank * shared, (rank + 1) * shared))


def rank_spec(spec: ModelSpec, tp: int, rank: int) -> ModelSpec:
    """The spec of rank ``rank``'s shard: the model it builds (its heads, its slice of the MLP
    and vocabulary); the planner's ledger sizes its weights and KV from this spec too."""
    s = rank_slice(spec, tp, rank)
    return dataclasses.replace(
        spec, num_heads=s.q_heads[1] - s.q_heads[0], num_kv_heads=s.kv_heads[1] - s.kv_heads[0],
        intermediate_size=s.intermediate[1] - s.intermediate[0],
        moe_intermediate_size=(s.expert_intermediate[1] - s.expert_intermediate[0]
                               if spec.moe_intermediate_size else 0),
        shared_expert_intermediate_size=s.shared_intermediate[1] - s.shared_intermediate[0],
        vocab_size=s.vocab[1] - s.vocab[0])
