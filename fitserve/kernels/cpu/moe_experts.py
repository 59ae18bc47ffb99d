"""Every active expert of a sparse MoE layer in one C++ call (moe_experts.cpp; llama.cpp's
mul_mat_id for the gated MLP), the experts' weights as stored: ggml blocks stacked per
projection, ``gate_up`` uint8 ``[E, 2I, row bytes]`` (gate rows, then up rows) and ``down``
uint8 ``[E, H, row bytes]``.

    out [N, H] fp32 = sum_j weights[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = ids[t, j]

x is quantized per row the way ggml_matmul does for the same type (ggml_blocks.py), h and the
SiLU product stay fp32 until the down projection quantizes them; only the active experts'
weights are read (k experts at batch 1). Without the C++ build :func:`moe_kernel_available` is
False and the caller runs its per-expert path.
"""

from __future__ import annotations

import functools

import torch

from fitserve.kernels.cpu.build import load_extension
from fitserve.kernels.cpu.ggml_blocks import _BLOCK

__all__ = ["MOE_KERNEL_TYPES", "moe_block_ggml", "moe_experts_ggml", "moe_experts_tier", "moe_kernel_available",
           "moe_route", "moe_route_available"]

# NOTE: the ggml types moe_experts.cpp implements (those of ggml_blocks.cpp, whose per-type row
# code it includes); a test checks this tuple against the compiled list
MOE_KERNEL_TYPES: tuple[str, ...] = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")


@functools.cache
def _ops_loaded() -> bool:
    if load_extension("moe_experts", "moe_experts.cpp") is None:
        return False
    torch.library.register_fake("fitserve::moe_experts_ggml", _moe_experts_fake)
    torch.library.register_fake("fitserve::moe_route", _moe_route_fake)
    torch.library.register_fake("fitserve::moe_block_ggml", _moe_block_fake)
    return True


def _moe_route_fake(logits: torch.Tensor, k: int, renormalize: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    n = logits.shape[0]
    return (logits.new_empty(n, k, dtype=torch.float32), logits.new_empty(n, k, dtype=torch.int64))


def _moe_experts_fake(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      gate_up: torch.Tensor, gate_up_type: str, down: torch.Tensor,
                      down_type: str, out_x_dtype: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1], dtype=x.dtype if out_x_dtype else torch.float32)


def _moe_block_fake(x: torch.Tensor, router: torch.Tensor, k: int, renormalize: bool,
                    gate_up: torch.Tensor, gate_up_type: str, down: torch.Tensor,
                    down_type: str) -> torch.Tensor:
    return x.new_empty(x.shape)


def moe_kernel_available(gate_up_type: str, down_type: str) -> bool:
    """True when this build runs experts whose gate/up and down weights are these ggml types."""
    if gate_up_type not in MOE_KERNEL_TYPES or down_type not in MOE_KERNEL_TYPES:
        return False
    try:
        return _ops_loaded()
    except Exception:  # a broken build counts as absent: the per-expert path runs
        return False


def moe_route_available() -> bool:
    """True when this build has the routing op (moe_route.h)."""
    try:
        return _ops_loaded()
    except Exception:  # a broken build counts as absent: torch routes
        return False


def moe_route(logits: torch.Tensor, k: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [N, k], ids int64 [N, k]) of router ``logits`` [N, E] on the CPU: the
    softmax in float64 rounded once, the k largest (largest first, ties to the lower expert),
    their probabilities or (``renormalize``) the softmax of their logits (moe_route.h)."""
    if not _ops_loaded():
        raise RuntimeError("the moe_experts C++ kernel is unavailable (see the log for why)")
    if logits.dim() != 2 or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"moe_route: logits must be [N, E] with 1 <= k <= E, got "
                         f"{list(logits.shape)} and k = {k}")
    w, ids = torch.ops.fitserve.moe_route(logits, k, renormalize)
    return w, ids


def moe_experts_tier() -> str:
    """The ISA tier the loaded kernel was built for ("avx512_vnni", ..., "scalar")."""
    if not _ops_loaded():
        raise RuntimeError("the moe_experts C++ kernel is unavailable (see the log for why)")
    return str(torch.ops.fitserve.moe_experts_tier())


def _check_stack(w: torch.Tensor, ggml_type: str, e: int, rows: int, cols: int,
                 what: str) -> None:
    block, size = _BLOCK[ggml_type]
    if cols <= 0 or cols % block:
        raise ValueError(f"moe_experts_ggml: {what} rows of {cols} columns are not whole "
                         f"{ggml_type} blocks of {block}")
    want = (e, rows, cols // block * size)
    if w.dtype != torch.uint8 or tuple(w.shape) != want:
        raise ValueError(f"moe_experts_ggml: {what} must be uint8 {list(want)} of {ggml_type}, "
                         f"got {w.dtype} {list(w.shape)}")


def moe_experts_ggml(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     gate_up: torch.Tensor, gate_up_type: str, down: torch.Tensor,
                     down_type: str, out_x_dtype: bool = False) -> torch.Tensor:
    """fp32 ``[N, H]``: the routed experts' weighted sum for every token (see the module doc);
    ``out_x_dtype``: in x's dtype instead (the fp32 sum rounded once, as ``.to(x.dtype)``).

    ``x`` float32 / bfloat16 ``[N, H]``; ``ids`` int64 ``[N, k]`` expert ids in [0, E);
    ``weights`` float32 ``[N, k]``. Raises ValueError on types without a kernel or shapes that
    do not fit (an id out of range raises RuntimeError from the kernel).
    """
    for t in (gate_up_type, down_type):
        if t not in MOE_KERNEL_TYPES:
            raise ValueError(f"moe_experts_ggml: no kernel for GGML type {t!r} "
                             f"(kernels: {', '.join(MOE_KERNEL_TYPES)})")
    if not _ops_loaded():
        raise RuntimeError("the moe_experts C++ kernel is unavailable (see the log for why); "
                           "use the per-expert path")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"moe_experts_ggml: x must be float32 / bfloat16 [N, H], got "
                         f"{x.dtype} {list(x.shape)}")
    n, hidden = x.shape
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != n:
        raise ValueError(f"moe_experts_ggml: ids must be int64 [{n}, k], got {ids.dtype} "
                         f"{list(ids.shape)}")
    if weights.dtype != torch.float32 or weights.shape != ids.shape:
        raise ValueError(f"moe_experts_ggml: weights must be float32 {list(ids.shape)}, got "
                         f"{weights.dtype} {list(weights.shape)}")
    if gate_up.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"moe_experts_ggml: gate_up must be [E, 2I, row bytes], got "
                         f"{list(gate_up.shape)}")
    e, inter = gate_up.shape[0], gate_up.shape[1] // 2
    _check_stack(gate_up, gate_up_type, e, 2 * inter, hidden, "gate_up")
    _check_stack(down, down_type, e, hidden, inter, "down")
    out: torch.Tensor = torch.ops.fitserve.moe_experts_ggml(
        x.contiguous(), ids.contiguous(), weights.contiguous(), gate_up.contiguous(),
        gate_up_type, down.contiguous(), down_type, out_x_dtype)
    return out


def moe_block_ggml(x: torch.Tensor, router: torch.Tensor, k: int, renormalize: bool,
                   gate_up: torch.Tensor, gate_up_type: str, down: torch.Tensor,
                   down_type: str) -> torch.Tensor:
    """bf16 ``[1, H]``: one token's MoE block without a shared expert in one C++ call (moe_block.h)
    with the same bits as ``moe_experts_ggml(x, *moe_route(bf16_gemv(x, router), k,
    renormalize), gate_up, ..., out_x_dtype=True)``; ``x`` bfloat16 ``[1, H]``, ``router``
    bfloat16 ``[E, H]`` without a bias (decode_layers' batch-1 step calls it directly)."""
    if not _ops_loaded():
        raise RuntimeError("the moe_experts C++ kernel is unavailable (see the log for why)")
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.bfloat16:
        raise ValueError(f"moe_block_ggml: x must be bfloat16 [1, H], got {x.dtype} "
                         f"{list(x.shape)}")
    out: torch.Tensor = torch.ops.fitserve.moe_block_ggml(
        x.contiguous(), router.contiguous(), k, renormalize, gate_up.contiguous(), gate_up_type,
        down.contiguous(), down_type)
    return out
