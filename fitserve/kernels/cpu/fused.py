"""The decoder layer's fused elementwise ops (fused_ops.cpp), with pure-torch equivalents.

Each function runs the C++ op when the extension built (CPU tensors) and the eager torch code
otherwise; both follow the Hugging Face reference's rounding (see fused_ops.cpp). The fake
kernels let torch.compile trace through the ops as opaque calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fitserve.kernels.cpu.build import load_extension

__all__ = ["add_rms_norm_", "argmax", "fused_ops_available", "rms_norm", "rope_write_kv_", "silu_and_mul"]


# NOTE: a plain module-level cache (not functools.cache, whose lock torch.compile cannot trace):
# set once, on first use, to whether the extension loaded; never changed afterwards.
_AVAILABLE: list[bool] = []


def fused_ops_available() -> bool:
    """True when fused_ops.cpp is built and loaded (torch.ops.fitserve_fused.*)."""
    if not _AVAILABLE:
        ok = load_extension("fused_ops", "fused_ops.cpp") is not None
        if ok:
            _register_fakes()
        _AVAILABLE.append(ok)
    return _AVAILABLE[0]


def _register_fakes() -> None:
    lib = "fitserve_fused::"

    @torch.library.register_fake(lib + "rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x.new_empty(x.shape)

    @torch.library.register_fake(lib + "add_rms_norm_")
    def _(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return residual.new_empty(residual.shape)

    @torch.library.register_fake(lib + "silu_and_mul")
    def _(gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake(lib + "rope_write_kv_")
    def _(qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
          num_q_heads: int, interleaved: bool) -> None:
        return None

    @torch.library.register_fake(lib + "rms_norm_heads")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x.new_empty(x.shape)

    @torch.library.register_fake(lib + "argmax")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], dtype=torch.long)


def _use_cpp(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and fused_ops_available()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: mean of squares in fp32, rounded to x's dtype before the weight. On
    [N, H, D] (per-head q/k norms) one C++ op with the same bits (fused_ops.cpp)."""
    if _use_cpp(x) and x.dim() == 3 and weight.dim() == 1:
        return torch.ops.fitserve_fused.rms_norm_heads(x, weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x [N, D]."""
    if _use_cpp(x) and x.dim() == 2 and x.stride(1) == 1 and weight.dtype == x.dtype:
        out: torch.Tensor = torch.ops.fitserve_fused.rms_norm(x, weight, eps)
        return out
    return rms_norm_reference(x, weight, eps)


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> torch.Tensor:
    """residual += x (in place, rounded to its dtype); returns rms_norm(residual)."""
    if _use_cpp(x) and residual.dim() == 2 and residual.is_contiguous() and weight.dtype == x.dtype:
        out: torch.Tensor = torch.ops.fitserve_fused.add_rms_norm_(residual, x, weight, eps)
        return out
    residual.add_(x)
    return rms_norm_reference(residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    if _use_cpp(gate_up) and gate_up.dim() == 2:
        out: torch.Tensor = torch.ops.fitserve_fused.silu_and_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_write_kv_(qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, num_q_heads: int,
                   interleaved: bool) -> bool:
    """Rotate q/k heads of qk [N, Hq+Hkv, D] in place and write k, v into the caches.

    cos/sin are fp32 [max_positions, D/2]. Returns False (doing nothing) when the C++ op is
    not available for these tensors: the caller then runs its eager rotation and cache write.
    """
    if not (_use_cpp(qk) and qk.stride(-1) == 1 and v.stride(-1) == 1
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    torch.ops.fitserve_fused.rope_write_kv_(qk, v, positions, cos, sin, k_cache, v_cache, slots,
                                            num_q_heads, interleaved)
    return True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of logits x [B, V]: the first index of each row's largest value, a
    NaN counting as the largest (torch's rule); the C++ op is two vector passes where torch's
    CPU argmax is a scalar loop."""
    if _use_cpp(x) and x.dim() == 2 and x.shape[1] > 0:
        out: torch.Tensor = torch.ops.fitserve_fused.argmax(x)
        return out
    return x.argmax(dim=-1)
