"""Rotary position embedding: both pairing conventions, ragged positions, left padding.

Pair i of a head vector rotates by angle theta_i = p * f_i, f_i = base^(-2i/D):

    (a, b) -> (a cos theta - b sin theta,  a sin theta + b cos theta)

    interleaved (GPT-J, original RoFormer/Meta):  pairs (x0,x1) (x2,x3) ... (x_{D-2},x_{D-1})
    half        (GPT-NeoX, HF Llama rotate_half):  pairs (x0,x_{D/2}) (x1,x_{D/2+1}) ...

The same weights work with either only after permuting the Q/K projection rows, so the
convention must match the checkpoint.

Angle precision at long positions. A float with t significant bits rounds p to a multiple of
ulp(p) = 2^(floor(log2 p) - t + 1). At p = 100,000 (2^16 <= p < 2^17):
  * bf16 (t = 8): ulp = 2^9 = 512, so p itself becomes 195 * 512 = 99,840: an error of 160
    positions, i.e. 160 * f_i radians (160 rad for the fastest pair): the rotation is garbage.
    Computing the product in bf16 as well adds up to 2^-8 relative per rounding.
  * fp32 (t = 24): p is exact; only f_i and the product round, |d theta| <= 2 * 2^-24 * theta,
    about 0.012 rad at theta = 1e5 and far less for slow pairs.
So angles are always formed in fp32 (or better) from integer positions, never in bf16.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Pairing = Literal["interleaved", "half"]


def rope_inv_freq_reference(head_dim: int, base: float = 10000.0) -> Tensor:
    """f_i = base^(-2i/D) for i < D/2, computed in float64 and returned in fp32."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    exps = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return (1.0 / (base ** exps)).to(torch.float32)


def rope_angles(positions: Tensor, head_dim: int, base: float = 10000.0,
                dtype: torch.dtype = torch.float32) -> Tensor:
    """theta[..., i] = p * f_i with positions and frequencies both cast to ``dtype`` first.

    ``dtype=torch.bfloat16`` reproduces the precision loss analysed in the module docstring.
    """
    inv = rope_inv_freq_reference(head_dim, base).to(device=positions.device, dtype=dtype)
    return positions.to(dtype).unsqueeze(-1) * inv


def positions_from_attention_mask(attention_mask: Tensor) -> Tensor:
    """Position ids of a left-padded batch: cumsum(mask) - 1, padding slots clamped to 0.

    mask [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]] -> [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _split_pairs(x: Tensor, pairing: Pairing) -> tuple[Tensor, Tensor]:
    if pairing == "interleaved":
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _join_pairs(a: Tensor, b: Tensor, pairing: Pairing) -> Tensor:
    if pairing == "interleaved":
        return torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat((a, b), dim=-1)


def apply_rope(x: Tensor, positions: Tensor, *, base: float = 10000.0,
               pairing: Pairing = "half", angle_dtype: torch.dtype = torch.float32) -> Tensor:
    """Rotate ``x`` [..., H, D] by per-token ``positions`` [...] (one position per row/token).

    Works for packed ragged tokens (x [N, H, D], positions [N]) and padded batches
    (x [B, T, H, D], positions [B, T], e.g. from :func:`positions_from_attention_mask`).
    Fused: angles from integer positions in ``angle_dtype`` (fp32), rotation in fp32, one cast
    back to x.dtype at the end.
    """
    theta = rope_angles(positions, x.shape[-1], base, angle_dtype).float().unsqueeze(-2)
    cos, sin = torch.cos(theta), torch.sin(theta)                 # [..., 1, D/2]
    a, b = _split_pairs(x.float(), pairing)
    return _join_pairs(a * cos - b * sin, a * sin + b * cos, pairing).to(x.dtype)


def apply_rope_reference(x: Tensor, positions: Tensor, *, base: float = 10000.0,
                         pairing: Pairing = "half") -> Tensor:
    """Float64 reference via complex multiplication: z_i * exp(1j * p * f_i)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    theta = positions.to(torch.float64).unsqueeze(-1).unsqueeze(-2) * inv
    a, b = _split_pairs(x.to(torch.float64), pairing)
    z = torch.complex(a, b) * torch.polar(torch.ones_like(theta), theta)
    return _join_pairs(z.real, z.imag, pairing)


def half_to_interleaved(x: Tensor) -> Tensor:
    """Permute the last dim so split-half pairs become adjacent: [x0..x_{h-1}, y0..] -> [x0,y0,..]."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)
