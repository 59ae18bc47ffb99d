"""Pick an attention implementation per shape class (the rule read off bench_kernels.py).

Implementation names returned by :func:`choose_attention_impl`:

    "naive"          eager fp32 per sequence: one matmul, softmax, matmul (K/V gathered)
    "sdpa"           torch scaled_dot_product_attention per sequence (enable_gqa)
    "gqa_folded"     fitserve.kernels.varlen / paged (GQA-folded online softmax, pure torch)
    "split_kv"       fitserve.kernels.split_kv.split_kv_decode
    "triton_forward" fitserve.kernels.triton.forward (CUDA, prefill / chunks)
    "triton_decode"  fitserve.kernels.triton.decode (CUDA, paged split-KV decode)

CPU rule, read off ``benchmarks/bench_kernels.py --threads 1`` on this (shared, loaded) machine:
the Python-loop tiled kernels lose to torch's fused ops at every shape (they are the readable,
exact references); eager "naive" wins while the score matrix is small (short prefill, decode up
to 4096 keys: 25 ms vs 68 ms sdpa for 32 ragged decodes), and sdpa wins once it is large
(prefill over 512 keys, decode over 4096 keys), where naive's M x N fp32 traffic dominates.
On CUDA with Triton importable, the Triton kernels take decode and prefill. Choosing costs well
under a microsecond (a few comparisons), against milliseconds won per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["prefill", "decode"]
BatchBucket = Literal["1", "small", "large"]
LengthBucket = Literal["short", "long", "very_long"]

IMPLS = ("naive", "sdpa", "gqa_folded", "split_kv", "triton_forward", "triton_decode")


@dataclass(frozen=True, slots=True)
class ShapeClass:
    """Coarse description of one attention call, enough to pick an implementation."""

    device: str                 # "cpu" or "cuda"
    phase: Phase                # decode: every sequence has exactly one new query
    batch_bucket: BatchBucket   # 1, 2..8, > 8 sequences
    length_bucket: LengthBucket  # longest cache: <= 512, <= 4096, more
    triton: bool = False        # Triton importable (only matters on CUDA)


def _batch_bucket(batch: int) -> BatchBucket:
    return "1" if batch <= 1 else ("small" if batch <= 8 else "large")


def _length_bucket(max_len: int) -> LengthBucket:
    return "short" if max_len <= 512 else ("long" if max_len <= 4096 else "very_long")


def classify(device: str, q_lens: list[int], k_lens: list[int], *, triton: bool = False
             ) -> ShapeClass:
    """Shape class of a ragged batch (per-sequence query and key counts)."""
    phase: Phase = "decode" if q_lens and all(t == 1 for t in q_lens) else "prefill"
    return ShapeClass(device, phase, _batch_bucket(len(q_lens)),
                      _length_bucket(max(k_lens, default=0)), triton)


def choose_attention_impl(shape_class: ShapeClass) -> str:
    """The implementation name for a shape class (one of :data:`IMPLS`)."""
    if shape_class.device == "cuda" and shape_class.triton:
        return "triton_decode" if shape_class.phase == "decode" else "triton_forward"
    # NOTE: CPU thresholds from the benchmark table (see module docstring).
    if shape_class.phase == "decode":
        return "sdpa" if shape_class.length_bucket == "very_long" else "naive"
    return "naive" if shape_class.length_bucket == "short" else "sdpa"


def choose_library_kernel(shape_class: ShapeClass) -> str:
    """Best of the pure-torch library kernels (when sdpa is not an option, e.g. paged KV)."""
    if shape_class.phase == "decode" and shape_class.batch_bucket != "large":
        return "split_kv"
    return "gqa_folded"
