"""The engine's memory budget, line by line, in the order the engine reserves it.

    total memory (one rank)
    - weights                          (loaded first)
    - activation peak                  (one forward over the step token budget)
    - logits                           (f32 logits for every running sequence)
    - workspace / CUDA-graph reserve
    - headroom = total - floor(total x memory_utilization)   (left unused on purpose)
    = KV pool  -> num_kv_blocks = floor(KV pool / kv_block_bytes)

This is vLLM's reading of ``gpu_memory_utilization``: the engine may use ``total x utilization``
in all, and the KV pool gets what the other lines leave of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.plan.errors import PlanError
from fitserve.plan.kv import kv_block_bytes, kv_bytes_per_token, layer_kinds
from fitserve.plan.params import is_mla
from fitserve.plan.units import fmt_bytes

LOGIT_BYTES = 4  # logits are kept in f32 for sampling


@dataclass(frozen=True)
class MemoryLine:
    """One reservation: ``formula`` names how ``bytes`` was computed, ``note`` says why."""

    name: str
    formula: str
    bytes: int
    note: str = ""


def num_kv_blocks(kv_budget_bytes: int, spec: ModelSpec, block_size: int, kv_dtype: str,
                  tp: int = 1) -> int:
    """Whole KV blocks that fit in ``kv_budget_bytes`` on one rank (floor, never negative)."""
    return max(0, kv_budget_bytes) // kv_block_bytes(spec, block_size, kv_dtype, tp=tp)


def activation_peak_bytes(spec: ModelSpec, num_tokens: int, act_dtype_bytes: int,
                          tp: int = 1) -> int:
    """Peak live activations of one forward pass over ``num_tokens`` tokens, one rank.

    Formula ``act_peak``: num_tokens x act_bytes x max(attention, mlp) where, per token,
      attention = 2H (residual + normed input) + (q + 2 kv + q) / tp (q/k/v outputs, attn out)
      mlp       = 2H + 3 I / tp (gate, up, and their product); MoE: k experts' 3 x I_e / tp
    MLA uses heads x (qk_nope + qk_rope) for q and heads x (qk_nope + v) for the expanded KV.
    Attention scores are not counted: a fused/tiled attention kernel never stores them.
    """
    h = spec.hidden_size
    if is_mla(spec):
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        attn = 2 * h + (spec.num_heads * (qk + spec.qk_nope_head_dim + 2 * spec.v_head_dim)) // tp
    else:
        attn = 2 * h + (2 * spec.q_size + 2 * spec.kv_size) // tp
    mlp = 2 * h + 3 * spec.intermediate_size // tp
    if spec.num_experts:
        ei = spec.moe_intermediate_size or spec.intermediate_size
        routed = 3 * ei * (spec.num_experts_per_token + spec.num_shared_experts) // tp
        moe = 2 * h + routed
        mlp = moe if spec.first_k_dense == 0 else max(mlp, moe)
    return num_tokens * act_dtype_bytes * max(attn, mlp)


@dataclass(frozen=True)
class Ceiling:
    """An upper bound, never a promise: ``value`` and why real runs land below it."""

    value: int
    limited_by: str
    reasons: tuple[str, ...]

    def __int__(self) -> int:
        return self.value


@dataclass(frozen=True)
class EngineMemoryPlan:
    """The reservation lines (in order), the KV pool and its block count, for one rank."""

    spec: ModelSpec
    lines: tuple[MemoryLine, ...]
    kv_pool_bytes: int
    num_kv_blocks: int
    block_size: int
    block_bytes: int
    kv_bytes_per_token: int
    max_num_seqs: int
    kv_dtype: str
    tp: int

    @property
    def kv_tokens(self) -> int:
        """Token slots in the pool: num_kv_blocks x block_size."""
        return self.num_kv_blocks * self.block_size

    def max_concurrent_sequences(self, context_len: int) -> Ceiling:
        """Sequences that can each hold ``context_len`` tokens at once: a CEILING.

        ``min(num_kv_blocks // ceil(context_len / block_size), max_num_seqs)``.
        """
        if context_len < 1:
            raise PlanError(f"context length must be >= 1, got {context_len}")
        per_seq = -(-context_len // self.block_size)
        by_kv = self.num_kv_blocks // per_seq
        value, limit = (by_kv, "kv_pool") if by_kv <= self.max_num_seqs else (
            self.max_num_seqs, "max_num_seqs")
        reasons = [
            f"every sequence is assumed to hold all {context_len} tokens at once "
            f"({per_seq} blocks of {self.block_size}); shorter ones leave room for more",
            "no prefix sharing is counted; shared prompt blocks would raise it",
            "the pool is assumed free of fragmentation and of blocks held by preempted requests",
            "admission is also bounded by the step token budget and by latency targets",
        ]
        if limit == "max_num_seqs":
            reasons.insert(0, f"capped by max_num_seqs = {self.max_num_seqs} "
                              f"(the KV pool alone would allow {by_kv})")
        if "sliding" in layer_kinds(self.spec):
            reasons.append("sliding-window layers are allocated for every token here; an "
                           "allocator that reclaims them would allow more")
        return Ceiling(value, limit, tuple(reasons))


def engine_memory_plan(spec: ModelSpec, *, weight_bytes: int, total_memory_bytes: int,
                       memory_utilization: float, max_num_batched_tokens: int,
                       max_num_seqs: int, block_size: int, kv_dtype: str, act_dtype_bytes: int,
                       workspace_bytes: int = 0, tp: int = 1) -> EngineMemoryPlan:
    """Reserve one rank's memory in engine order and size the KV pool (see module docstring).

    Raises PlanError when not even one KV block fits, naming the line that used the memory up.
    """
    if not 0.0 < memory_utilization <= 1.0:
        raise PlanError(f"memory utilization must be in (0, 1], got {memory_utilization}")
    usable = int(total_memory_bytes * memory_utilization)
    block = kv_block_bytes(spec, block_size, kv_dtype, tp=tp)
    lines = (
        MemoryLine("weights", "weight_bytes", weight_bytes, f"per rank, tp={tp}"),
        MemoryLine("activation peak", "act_peak",
                   activation_peak_bytes(spec, max_num_batched_tokens, act_dtype_bytes, tp),
                   f"one forward over max_num_batched_tokens={max_num_batched_tokens}"),
        MemoryLine("logits", "max_num_seqs x vocab x 4",
                   max_num_seqs * spec.vocab_size * LOGIT_BYTES,
                   f"f32 logits for max_num_seqs={max_num_seqs} sequences"),
        MemoryLine("workspace / graphs", "workspace_bytes", workspace_bytes,
                   "kernel workspace and CUDA-graph reserve"),
        MemoryLine("headroom", "total - floor(total x utilization)",
                   total_memory_bytes - usable, f"memory_utilization={memory_utilization}"),
    )
    pool = total_memory_bytes - sum(line.bytes for line in lines)
    blocks = num_kv_blocks(pool, spec, block_size, kv_dtype, tp)
    if blocks < 1:
        raise PlanError(_no_block_message(lines, total_memory_bytes, pool, block))
    kv_line = MemoryLine("KV pool", "total - lines above", pool,
                         f"{blocks} blocks x {fmt_bytes(block)} (block_size={block_size})")
    return EngineMemoryPlan(spec, (*lines, kv_line), pool, blocks, block_size, block,
                            kv_bytes_per_token(spec, kv_dtype, tp=tp), max_num_seqs,
                            kv_dtype, tp)


def _no_block_message(lines: tuple[MemoryLine, ...], total: int, pool: int, block: int) -> str:
    """Name the first line after which less than one block is left of total x utilization."""
    usable = total - lines[-1].bytes  # the last line is the utilization headroom
    running, culprit = 0, max(lines[:-1], key=lambda line: line.bytes)
    for line in lines[:-1]:
        running += line.bytes
        if running + block > usable:
            culprit = line
            break
    table = "; ".join(f"{line.name} {fmt_bytes(line.bytes)}" for line in lines)
    return (f"no room for even one KV block ({fmt_bytes(block)}): {culprit.name} "
            f"({fmt_bytes(culprit.bytes)}) uses up the {fmt_bytes(usable)} usable "
            f"(total {fmt_bytes(total)} x utilization; left for KV: {fmt_bytes(pool)}). "
            f"Lines: {table}")
