"""Building blocks shared by the decoder architectures: RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

from fitserve.config import ModelSpec, RopeScaling
from fitserve.kernels.cpu import fused
from fitserve.model.linear import DenseLinear


class RMSNorm(nn.Module):
    """RMSNorm with the mean of squares taken in fp32 (a long sum in bf16 loses bits)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in fp32, cast back before the weight multiply as the
        # Hugging Face reference does (one C++ op on CPU, fitserve.kernels.cpu.fused).
        if x.dim() == 2:
            return fused.rms_norm(x, self.weight, self.eps)
        return fused.rms_norm_reference(x, self.weight, self.eps)

    def add_forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x in place (rounded to its dtype), then the norm of the new residual."""
        return fused.add_rms_norm_(residual, x, self.weight, self.eps)


def longrope_inv_freq(head_dim: int, theta: float, factors: tuple[float, ...]) -> torch.Tensor:
    """LongRoPE's inverse frequencies: each divided by its factor (transformers'
    _compute_longrope_parameters, op for op)."""
    if len(factors) != head_dim // 2:
        raise ValueError(f"longrope has {len(factors)} factors for head_dim {head_dim} "
                         f"(needs {head_dim // 2})")
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**shape)


def yarn_inv_freq(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN's inverse frequencies (transformers' _compute_yarn_parameters, op for op): the
    interpolated 1 / (factor * theta^(2i/d)) below ``beta_slow`` rotations over the original
    context, the extrapolated 1 / theta^(2i/d) above ``beta_fast``, a linear ramp between.
    cos/sin are multiplied by ``s.attention_factor`` (``RotaryEmbedding``)."""
    orig = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a singular ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies (fp32) for split-half RoPE, with optional llama3 / linear / yarn
    scaling (longrope has two sets: ``RotaryEmbedding`` builds both)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    if scaling.kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {scaling.kind!r} "
                         "(supported: llama3, linear, longrope, yarn)")
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by absolute position.

    Angles are position * inv_freq computed in fp32 (a bf16 angle at position 100k is off by
    hundreds of radians' worth of ulps), then cast to the activation dtype like the reference.

    LongRoPE (Phi-3) has two tables, stacked: rows [0, P) the short factors', rows [P, 2P) the
    long factors' (``long_row_offset`` = P), both times ``attention_factor`` as transformers
    scales cos/sin. The runner picks a token's row (fitserve.runner.model_runner.rope_rows).
    """

    def __init__(self, spec: ModelSpec, max_positions: int) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.interleaved = spec.rope_interleaved
        self.long_row_offset: int | None = None
        if torch.empty(()).is_meta:
            # NOTE: the loader builds the model on the meta device and then installs real tables
            # (install_rotary); computing them here on meta would decompose arange through
            # torch._refs, which imports torch._dynamo: ~1 s of every start-up for nothing.
            self.register_buffer("cos", torch.empty(0), persistent=False)
            self.register_buffer("sin", torch.empty(0), persistent=False)
            return
        pos = torch.arange(max_positions, dtype=torch.float32)
        rs = spec.rope_scaling
        if rs is not None and rs.kind == "longrope":
            self.long_row_offset = max_positions
            freqs = torch.cat([torch.outer(pos, longrope_inv_freq(spec.head_dim, spec.rope_theta, f))
                               for f in (rs.short_factor, rs.long_factor)])  # [2P, D/2]
            cos, sin = freqs.cos() * rs.attention_factor, freqs.sin() * rs.attention_factor
        else:
            freqs = torch.outer(pos, rope_inv_freq(spec.head_dim, spec.rope_theta, rs))  # [P, D/2]
            cos, sin = freqs.cos(), freqs.sin()
            if rs is not None and rs.kind == "yarn":  # transformers scales cos/sin in fp32
                cos, sin = cos * rs.attention_factor, sin * rs.attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the tokens' positions [N], shaped to broadcast over heads; once per step.

        For split halves the sine table carries the rotation's sign, [-sin, sin], so rotating is
        x * cos + roll(x, D/2) * sin: the same products as rotate_half, in fewer ops.
        """
        cos = self.cos[positions].to(dtype).unsqueeze(1)  # [N, 1, D/2]
        sin = self.sin[positions].to(dtype).unsqueeze(1)
        if not self.interleaved:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos, sin

    def forward(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate x [N, H, D] (queries and keys together) with the step's ``tables(positions)``."""
        cos, sin = tables
        if self.interleaved:
            # pairs (x0, x1), (x2, x3), ...
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            return out.flatten(-2)
        # split halves: pairs (x_i, x_{i+D/2}), the Hugging Face rotate_half convention
        return x * cos + x.roll(self.head_dim // 2, dims=-1) * sin


class StepRope:
    """A step's positions, with the cos/sin tables made at most once, only if a layer asks
    (the fused C++ rotation reads the fp32 tables by position itself)."""

    __slots__ = ("_tables", "dtype", "positions", "rotary")

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary, self.positions, self.dtype = rotary, positions, dtype
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            self._tables = self.rotary.tables(self.positions, self.dtype)
        return self._tables


class GatedMLP(nn.Module):
    """SwiGLU MLP with the gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = DenseLinear(hidden, 2 * intermediate, bias=False)
        self.down_proj = DenseLinear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))
