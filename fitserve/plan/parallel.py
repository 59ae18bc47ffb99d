"""Tensor-parallel collectives: all-reduces per token, their bytes and time on a link.

Megatron placement: in each layer the attention output projection (row-parallel) and the MLP
down projection (row-parallel) end in partial sums, so every layer does 2 all-reduces of the
hidden state: 2 x num_layers per forward step, each of tokens x hidden x act_bytes.

Ring all-reduce on p ranks: each rank sends and receives 2 (p - 1) / p x bytes; time =
latency + 2 (p - 1) / p x bytes / link bandwidth (per direction).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.plan.hardware import Hardware


@dataclass(frozen=True)
class AllReduce:
    tp: int
    calls_per_step: int
    bytes_per_call: int  # the tensor reduced: tokens x hidden x act_bytes
    wire_bytes_per_call: float  # sent per rank: 2 (tp - 1) / tp x bytes_per_call
    seconds_per_call: float

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
    wire = 2 * (tp - 1) / tp * nbytes if tp > 1 else 0.0
    return AllReduce(tp, calls, nbytes, wire, ring_allreduce_seconds(nbytes, tp, hw))
