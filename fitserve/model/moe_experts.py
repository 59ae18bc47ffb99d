"""The grouped expert path of SparseMoeBlock (fitserve.model.moe): every active expert of a
layer in one C++ call (fitserve.kernels.cpu.moe_experts, llama.cpp's mul_mat_id) instead of two
kernel calls and the Python around them per active expert.

It applies where every expert is a plain GatedMLP whose ``gate_up_proj`` and ``down_proj`` are
GgmlLinear weights without bias, one ggml type per projection across the layer's experts, the
type has a kernel, and x is bfloat16 (GgmlLinear's own rule: a float32 model is the exact mode
and dequantizes). Elsewhere (dense / packed / fp8 experts, gpt-oss's experts, no C++ build,
float32) the block's per-expert loop runs.

Memory: the layer's experts are stacked once, at start-up (SparseMoeBlock.prepare_grouped),
into one ``[E, rows, bytes]`` tensor per projection, and each expert's ``blocks`` buffer becomes
a view of its slice, so the weights are held once, as before (the stack replaces the per-expert
tensors).
"""

from __future__ import annotations

import torch
from torch import nn

from fitserve.kernels.cpu.moe_experts import moe_kernel_available
from fitserve.model.ggml_linear import GgmlLinear
from fitserve.model.layers import GatedMLP


class GroupedExperts:
    """The stacked ggml expert weights of one layer, or an inactive marker (``active`` False)
    when the layer's experts do not qualify; ``current(experts)`` says whether it still
    describes ``experts`` (their first module and its buffer are the ones it was built from)."""

    def __init__(self, experts: nn.ModuleList) -> None:
        first = experts[0]
        self._anchor = (first, getattr(first, "gate_up_proj", None))
        self.active = False
        self.gate_up = self.down = torch.empty(0)
        self.gate_up_type = self.down_type = ""
        pairs = [(getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None))
                 for m in experts]
        if not all(type(m) is GatedMLP for m in experts) or not all(
                isinstance(g, GgmlLinear) and isinstance(d, GgmlLinear) and g.bias is None
                and d.bias is None for g, d in pairs):
            return
        gu_types = {g.ggml_type for g, _ in pairs}  # type: ignore[union-attr]
        down_types = {d.ggml_type for _, d in pairs}  # type: ignore[union-attr]
        if len(gu_types) != 1 or len(down_types) != 1:
            return
        self.gate_up_type, self.down_type = gu_types.pop(), down_types.pop()
        if not moe_kernel_available(self.gate_up_type, self.down_type):
            return
        self.gate_up = _stack_into_views([g for g, _ in pairs])  # type: ignore[misc]
        self.down = _stack_into_views([d for _, d in pairs])  # type: ignore[misc]
        self._blocks = pairs[0][0].blocks  # type: ignore[union-attr]
        self.active = True

    def current(self, experts: nn.ModuleList) -> bool:
        """Whether the experts are still the modules (and buffers) this was built over."""
        first = experts[0]
        gate_up = getattr(first, "gate_up_proj", None)
        if first is not self._anchor[0] or gate_up is not self._anchor[1]:
            return False
        return not self.active or gate_up.blocks is self._blocks  # type: ignore[union-attr]

    def applies(self, x: torch.Tensor, first: nn.Module) -> bool:
        """Whether this step runs grouped: bf16 x on the CPU, the kernel not switched off."""
        return (self.active and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and not first.gate_up_proj.force_torch)  # type: ignore[union-attr]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                 ) -> torch.Tensor:
        """fp32 [N, H]: sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""
        # NOTE: the op directly: the shapes were checked when stacking, and the C++ checks them
        # again (the Python wrapper's checks cost ~10 us a call, x 24 layers a step)
        out: torch.Tensor = torch.ops.fitserve.moe_experts_ggml(
            x.contiguous(), ids, weights, self.gate_up, self.gate_up_type, self.down,
            self.down_type)
        return out


def _stack_into_views(linears: list[GgmlLinear]) -> torch.Tensor:
    """uint8 [E, N, row bytes] of the linears' blocks; each linear's buffer then views it."""
    shapes = {tuple(lin.blocks.shape) for lin in linears}
    if len(shapes) != 1:
        raise ValueError(f"experts of one layer hold blocks of different shapes: {shapes}")
    # NOTE: built outside inference mode, so the views are ordinary buffers for later callers
    with torch.inference_mode(False), torch.no_grad():
        stacked = torch.stack([lin.blocks for lin in linears])
        for e, lin in enumerate(linears):
            lin.blocks = stacked[e]
    return stacked


def grouped_experts(experts: nn.ModuleList, cached: GroupedExperts | None) -> GroupedExperts:
    """``cached`` while it still describes ``experts``, else a new one (stacking them)."""
    if cached is not None and cached.current(experts):
        return cached
    return GroupedExperts(experts)
