"""Tensor-parallel collectives: all-reduces per token, their bytes and time on a link.

Megatron placement: in each layer the attention output projection (row-parallel) and the MLP
down projection (row-parallel) end in partial sums, so every layer does 2 all-reduces of the
hidden state: 2 x num_layers per forward step, each of tokens x hidden x act_bytes.

Each all-reduce is priced with the fastest algorithm for its size (fitserve.ledger.collectives:
one-shot for small messages, ring for large ones); ``ring_allreduce_seconds`` is the plain ring
with one latency per call.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.collectives import best_allreduce
from fitserve.ledger.hardware import Hardware


@dataclass(frozen=True)
class AllReduce:
    tp: int
    calls_per_step: int
    bytes_per_call: int  # the tensor reduced: tokens x hidden x act_bytes
    wire_bytes_per_call: float  # sent per rank: 2 (tp - 1) / tp x bytes_per_call
    seconds_per_call: float
    algorithm: str = "ring"  # the fastest for this message (fitserve.ledger.collectives)

    @property
    def seconds_per_step(self) -> float:
        return self.calls_per_step * self.seconds_per_call


def ring_allreduce_seconds(nbytes: float, tp: int, hw: Hardware) -> float:
    if tp <= 1:
        return 0.0
    if hw.link_bytes_per_s <= 0:
        return float("inf")
    return hw.link_latency_s + 2 * (tp - 1) / tp * nbytes / hw.link_bytes_per_s


def tp_allreduce(spec: ModelSpec, hw: Hardware, *, tp: int, tokens: int,
                 act_dtype_bytes: int) -> AllReduce:
    """The all-reduces of one forward step over ``tokens`` tokens at tensor parallel ``tp``."""
    calls = 2 * spec.num_layers if tp > 1 else 0
    nbytes = tokens * spec.hidden_size * act_dtype_bytes
    if tp <= 1:
        return AllReduce(tp, calls, nbytes, 0.0, 0.0)
    if hw.link_bytes_per_s <= 0:
        return AllReduce(tp, calls, nbytes, 2 * (tp - 1) / tp * nbytes, float("inf"))
    # NOTE: priced with the fastest algorithm for the message (one-shot for the small
    # messages of decode, ring for large prefill steps), as NCCL / vLLM pick per size
    best = best_allreduce(nbytes, tp, bandwidth=hw.link_bytes_per_s,
                          call_latency_s=hw.link_latency_s)
    return AllReduce(tp, calls, nbytes, best.wire_bytes, best.seconds, best.algorithm)


@dataclass(frozen=True)
class CollectiveLine:
    """One kind of collective in a tensor-parallel forward step: calls and bytes per call (the
    tensor each rank contributes), as the engine's counters (fitserve.dist.comm) name them."""

    kind: str  # "layer all_reduce", "embedding all_reduce", "logits gather"
    calls: int
    bytes_per_call: int


def tp_step_collectives(spec: ModelSpec, *, tp: int, tokens: int, logits_rows: int,
                        act_dtype_bytes: int, logits_dtype_bytes: int = 4
                        ) -> tuple[CollectiveLine, ...]:
    """The collectives of one forward step of ``tokens`` tokens under fitserve's TP engine.

    Megatron's 2 all-reduces per layer (after o_proj and down_proj), plus one for the
    vocab-parallel embedding (each rank looks up its vocabulary rows, zeros elsewhere), plus
    the logits gather to rank 0 for the ``logits_rows`` sampled rows: each rank sends its
    shard, padded to the widest one (ceil(V / tp) columns of fp32).
    """
    if tp <= 1:
        return ()
    hidden = tokens * spec.hidden_size * act_dtype_bytes
    lines = [CollectiveLine("layer all_reduce", 2 * spec.num_layers, hidden),
             CollectiveLine("embedding all_reduce", 1, hidden)]
    if logits_rows:
        width = -(-spec.vocab_size // tp)
        lines.append(CollectiveLine("logits gather", 1, logits_rows * width * logits_dtype_bytes))
    return tuple(lines)
