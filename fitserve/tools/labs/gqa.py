"""GQA packing: the G query heads sharing one KV head become one matrix of T*G rows.

Query head h uses KV head h // G (G = num_heads // num_kv_heads). Packing for T tokens:

    q [T, Hq, D]  --view-->  [T, Hkv, G, D]  --permute-->  [Hkv, T, G, D]  -->  [Hkv, T*G, D]

    row r of KV head kv  <->  token t = r // G, query head h = kv*G + r % G

so each K/V tile is loaded once per group instead of once per query head, and the score matmul
is (T*G x D) @ (D x n). Row r keeps the position of token r // G (positions repeat G times).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_size(num_heads: int, num_kv_heads: int) -> int:
    """G = num_heads // num_kv_heads, checking divisibility."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} not a multiple of num_kv_heads={num_kv_heads}")
    return num_heads // num_kv_heads


def pack_gqa(q: Tensor, num_kv_heads: int) -> Tensor:
    """[T, Hq, D] -> [Hkv, T*G, D] (see the module sketch)."""
    t, hq, d = q.shape
    g = group_size(hq, num_kv_heads)
    return q.view(t, num_kv_heads, g, d).permute(1, 0, 2, 3).reshape(num_kv_heads, t * g, d)


def unpack_gqa(x: Tensor, num_heads: int) -> Tensor:
    """Inverse of :func:`pack_gqa`: [Hkv, T*G, ...] -> [T, Hq, ...] (trailing dims kept)."""
    hkv, rows = x.shape[0], x.shape[1]
    g = group_size(num_heads, hkv)
    t = rows // g
    rest = x.shape[2:]
    y = x.reshape(hkv, t, g, *rest).permute(1, 0, 2, *range(3, 3 + len(rest)))
    return y.reshape(t, num_heads, *rest)


def repeat_rows(row_values: Tensor, g: int) -> Tensor:
    """Per-token values (positions, segment ids) repeated for the G packed rows of each token."""
    return torch.repeat_interleave(row_values, g)


@dataclass(frozen=True, slots=True)
class GqaIntensity:
    """FLOPs and K/V/Q/O bytes of one KV head's attention, folded vs one query head at a time."""

    flops: int
    bytes_folded: int
    bytes_per_head: int

    @property
    def intensity_folded(self) -> float:
        """FLOPs per byte when the group shares each K/V load."""
        return self.flops / self.bytes_folded

    @property
    def intensity_per_head(self) -> float:
        """FLOPs per byte when every query head reloads K/V."""
        return self.flops / self.bytes_per_head


def gqa_intensity(num_queries: int, group: int, num_keys: int, head_dim: int,
                  dtype_bytes: int = 2) -> GqaIntensity:
    """Arithmetic intensity of attention for one KV head and its G query heads.

    FLOPs = 4 * T * G * N * D (QK^T and PV, every pair; no mask discount). Bytes: Q and O are
    T*G*D each; K and V are N*D each, read once when folded and G times when not.
    """
    flops = 4 * num_queries * group * num_keys * head_dim
    qo = 2 * num_queries * group * head_dim * dtype_bytes
    kv = 2 * num_keys * head_dim * dtype_bytes
    return GqaIntensity(flops=flops, bytes_folded=qo + kv, bytes_per_head=qo + group * kv)
