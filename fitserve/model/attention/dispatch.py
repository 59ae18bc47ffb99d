"""Pick an attention implementation per shape class (the rule read off bench_kernels.py).

Implementation names returned by :func:`choose_attention_impl` (all run by
fitserve.model.attention.paged.paged_attention):

    "cpu_paged"      fused C++ paged decode kernel (fitserve/kernels/cpu/paged_attention.cpp):
                     K/V read in place through the block table, fp32 online softmax
    "naive"          eager, GQA folded: K/V blocks gathered, matmul, fp32 softmax, matmul
    "sdpa"           K/V blocks gathered, torch scaled_dot_product_attention (enable_gqa)
    "triton_forward" fitserve.kernels.triton.forward (CUDA, prefill / chunks)
    "triton_decode"  fitserve.kernels.triton.decode (CUDA, paged split-KV decode)

CPU rule, read off ``.venv/bin/python benchmarks/bench_kernels.py`` (the engine's own
attention backend and batch builders, bf16 head-major cache, SmolLM2 geometry 9/3 heads x 64,
block 16, shuffled block tables, 2 threads, median of 9) on 2026-12-01, Intel Xeon (Sapphire
Rapids class: AVX-512 + VNNI + BF16 + AMX, kernel tier avx512_vnni, bf16 q.k via VDPBF16PS),
torch 2.13.0, the shared machine quiet at the time (ms per layer):

    decode (the fused kernel wins every class, 2.7-6x):
      b=1  L=300           cpu_paged 0.036   sdpa 0.097   naive 0.227
      b=1  L=2000          cpu_paged 0.104   sdpa 0.336   naive 0.502
      b=1  L=8192          cpu_paged 0.606   sdpa 2.15    naive 2.45 (min; median disturbed)
      b=8  L<=512          cpu_paged 0.114   sdpa 0.676   naive 0.776
      b=4  L<=4096         cpu_paged 0.823   sdpa 2.79    naive 3.65
      b=32 L=129..256 (W2) cpu_paged 0.448   naive 1.42   sdpa 1.61
      b=32 L<=4096         cpu_paged 29.5    sdpa 105     naive 134
      b=16 L>4096          cpu_paged 15.5    naive 84.4   sdpa 92.7
    prefill, one sequence per call (sdpa wins every class, 3-11x):
      T=128                sdpa 0.250   naive 0.770
      T=512                sdpa 1.90    naive 5.86
      T=1024               sdpa 5.78    naive 63.9
      T=256 after 1792     sdpa 3.98    naive 13.4
      T=512 after 7680     sdpa 38.3    naive 280

``--threads 1`` gives the same winners in all 13 cases (W2 decode: cpu_paged 0.606, sdpa 1.34,
naive 1.44; prefill T=128: sdpa 0.336, naive 0.862). An earlier run with
``--dtype float32`` picked the same winners (W2 decode: cpu_paged 0.500,
naive 2.05, sdpa 2.42; prefill T=128: sdpa 0.424, naive 0.551). Without the C++ kernel
(no compiler, failed build, FITSERVE_DISABLE_CPP=1) decode keeps the older gather rule:
"naive" up to 4096 keys, "sdpa" beyond: the two are within ~40% of each other at every decode
class (sdpa ahead at batch <= 8 in bf16, naive ahead at batch 32 and mostly in fp32), so the
rule left in place is not worth churning; both are tested.
NOTE: on a loaded machine 2-thread medians become multiples of the scheduler's time slice
(8/16/32 ms); rerun idle, or compare with ``--stat min`` / ``--threads 1``.
On CUDA with Triton importable, the Triton kernels take decode and prefill. Choosing costs well
under a microsecond (a few comparisons), against milliseconds won per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["prefill", "decode"]
BatchBucket = Literal["1", "small", "large"]
LengthBucket = Literal["short", "long", "very_long"]

IMPLS = ("naive", "sdpa", "cpu_paged", "triton_forward", "triton_decode")


@dataclass(frozen=True, slots=True)
class ShapeClass:
    """Coarse description of one attention call, enough to pick an implementation."""

    device: str                 # "cpu" or "cuda"
    phase: Phase                # decode: every sequence has exactly one new query
    batch_bucket: BatchBucket   # 1, 2..8, > 8 sequences
    length_bucket: LengthBucket  # longest cache: <= 512, <= 4096, more
    triton: bool = False        # Triton importable (only matters on CUDA)
    cpp: bool = False           # the fused C++ paged decode kernel loaded (only matters on CPU)


def _batch_bucket(batch: int) -> BatchBucket:
    return "1" if batch <= 1 else ("small" if batch <= 8 else "large")


def _length_bucket(max_len: int) -> LengthBucket:
    return "short" if max_len <= 512 else ("long" if max_len <= 4096 else "very_long")


def classify(device: str, q_lens: list[int], k_lens: list[int], *, triton: bool = False,
             cpp: bool = False) -> ShapeClass:
    """Shape class of a ragged batch (per-sequence query and key counts)."""
    phase: Phase = "decode" if q_lens and all(t == 1 for t in q_lens) else "prefill"
    return ShapeClass(device, phase, _batch_bucket(len(q_lens)),
                      _length_bucket(max(k_lens, default=0)), triton, cpp)


def choose_attention_impl(shape_class: ShapeClass) -> str:
    """The implementation name for a shape class (one of :data:`IMPLS`)."""
    if shape_class.device == "cuda" and shape_class.triton:
        return "triton_decode" if shape_class.phase == "decode" else "triton_forward"
    # NOTE: CPU thresholds from the benchmark table (see module docstring).
    if shape_class.phase == "decode":
        if shape_class.device == "cpu" and shape_class.cpp:
            return "cpu_paged"
        return "sdpa" if shape_class.length_bucket == "very_long" else "naive"
    return "sdpa"
