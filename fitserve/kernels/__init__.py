"""Attention kernels: float64 references, tiled/online-softmax forward and backward, split-KV
decode, paged and varlen variants, sliding-window tile counting, GQA packing, RoPE, RMSNorm,
byte/FLOP counters, a dispatch rule, and Triton versions (``fitserve.kernels.triton``, imported
on demand only)."""

from fitserve.kernels.backward import flash_attention, tiled_attention_backward
from fitserve.kernels.dispatch import ShapeClass, choose_attention_impl, classify
from fitserve.kernels.online_softmax import merge_lse
from fitserve.kernels.paged import paged_attention
from fitserve.kernels.reference import naive_attention
from fitserve.kernels.rmsnorm import rms_norm
from fitserve.kernels.rope import apply_rope, positions_from_attention_mask
from fitserve.kernels.split_kv import choose_num_splits, split_kv_decode
from fitserve.kernels.tiled import tiled_attention
from fitserve.kernels.varlen import varlen_attention

__all__ = [
    "ShapeClass", "apply_rope", "choose_attention_impl", "choose_num_splits", "classify",
    "flash_attention", "merge_lse", "naive_attention", "paged_attention",
    "positions_from_attention_mask", "rms_norm", "split_kv_decode", "tiled_attention",
    "tiled_attention_backward", "varlen_attention",
]
