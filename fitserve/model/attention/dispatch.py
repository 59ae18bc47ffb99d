"""Pick the attention backend of each group of a step by its shape class.

The rule: on CUDA with Triton importable, ``TritonPagedDecode`` for decode and
``TritonPrefill`` for chunks. On the CPU, decode runs the fused C++ kernel (``CpuPagedDecode``)
whenever it loaded (over a quantized KV cache, when the step is decode only, its twin reading the
int8 / fp8 codes in place, ``CpuPagedDecodeKVQ``); without it (no compiler, failed build, FITSERVE_DISABLE_CPP=1)
``EagerGather`` up to 4096 keys and ``TorchSDPA`` beyond. Prefill chunks run the same C++ kernel's
flash-style prefill op (query tiles against K/V tiles), every row bitwise the decode kernel's
(batch invariance: a token's attention is computed the same way in a whole prompt, a chunk,
after a prefix hit or as a speculative draft), ``TorchSDPA`` without it.
A model with attention logit soft-capping (Gemma 2) or attention sinks (gpt-oss) runs
``EagerGather`` everywhere.
Measured: docs/benchmarks.md, section 'Attention backend rule' (``benchmarks/bench_kernels.py``
puts the rule's pick next to the measured fastest). Choosing costs a few comparisons per group
and step, against milliseconds won per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fitserve.model.attention.backend import AttentionBackend
from fitserve.model.attention.cpu_paged import CPU_PAGED_DECODE, CPU_PAGED_DECODE_KVQ
from fitserve.model.attention.gather import EAGER_GATHER, TORCH_SDPA
from fitserve.model.attention.triton_attn import TRITON_DECODE, TRITON_PREFILL

Phase = Literal["prefill", "decode"]
BatchBucket = Literal["1", "2-8", "9+"]  # sequences in the group
LengthBucket = Literal["<=512", "<=4096", ">4096"]  # keys of its longest sequence

BACKENDS: tuple[AttentionBackend, ...] = (EAGER_GATHER, TORCH_SDPA, CPU_PAGED_DECODE,
                                          CPU_PAGED_DECODE_KVQ, TRITON_PREFILL, TRITON_DECODE)


@dataclass(frozen=True, slots=True)
class ShapeClass:
    """Coarse description of one attention call, enough to pick a backend."""

    device: str                 # "cpu" or "cuda"
    phase: Phase                # decode: every sequence has exactly one new query
    batch_bucket: BatchBucket
    length_bucket: LengthBucket
    triton: bool = False        # Triton importable (only matters on CUDA)
    cpp: bool = False           # the fused C++ paged decode kernel loaded (only matters on CPU)
    # a quantized KV cache read in place by the quantized C++ decode kernel (loaded); the runner
    # sets it for decode-only steps (a step with a prefill chunk reads a dequantized copy)
    kv_quant: bool = False
    softcap: bool = False       # attention logits soft-capped (Gemma 2)
    sinks: bool = False         # a learned logit per head in the softmax (gpt-oss)


def _batch_bucket(batch: int) -> BatchBucket:
    return "1" if batch <= 1 else ("2-8" if batch <= 8 else "9+")


def _length_bucket(max_len: int) -> LengthBucket:
    return "<=512" if max_len <= 512 else ("<=4096" if max_len <= 4096 else ">4096")


def classify(device: str, q_lens: list[int], k_lens: list[int], *, triton: bool = False,
             cpp: bool = False, kv_quant: bool = False, softcap: bool = False,
             sinks: bool = False) -> ShapeClass:
    """Shape class of a ragged batch (per-sequence query and key counts)."""
    phase: Phase = "decode" if q_lens and all(t == 1 for t in q_lens) else "prefill"
    return ShapeClass(device, phase, _batch_bucket(len(q_lens)),
                      _length_bucket(max(k_lens, default=0)), triton, cpp, kv_quant, softcap,
                      sinks)


def choose_attention_backend(shape_class: ShapeClass) -> AttentionBackend:
    """The backend for a shape class (one of :data:`BACKENDS`)."""
    if shape_class.softcap or shape_class.sinks:
        # NOTE: correctness first: only EagerGather soft-caps its scores and adds attention
        # sinks (the C++, SDPA and Triton kernels do not), so such a model (Gemma 2, gpt-oss)
        # runs it in both phases, on any device
        return EAGER_GATHER
    if shape_class.device == "cuda" and shape_class.triton:
        return TRITON_DECODE if shape_class.phase == "decode" else TRITON_PREFILL
    if shape_class.phase == "decode":
        if shape_class.device == "cpu" and shape_class.kv_quant:
            return CPU_PAGED_DECODE_KVQ
        if shape_class.device == "cpu" and shape_class.cpp:
            return CPU_PAGED_DECODE
        # NOTE: the gather paths are within ~40% of each other at every decode class; this
        # older threshold stays (fitserve.ledger.scratch.GATHER_EAGER_MAX_KEYS mirrors it)
        return TORCH_SDPA if shape_class.length_bucket == ">4096" else EAGER_GATHER
    if shape_class.device == "cpu" and shape_class.cpp and not shape_class.kv_quant:
        # NOTE: batch invariance: a prefill chunk's rows get the decode kernel's bits, so
        # a token's attention does not depend on how its prompt was chunked, cached or batched
        return CPU_PAGED_DECODE
    return TORCH_SDPA
