"""SparseMoeBlock's grouped expert path (fitserve.model.moe_experts): a layer whose experts are
held as ggml blocks runs all of them in one C++ call, against a float64 loop over the tokens'
experts (weights dequantized by gguf-py); the experts' bytes are held once (each expert's
buffer a view of the stack); float32 steps and unsupported experts keep the per-expert loop.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from fitserve.kernels.cpu.moe_experts import moe_kernel_available
from fitserve.model.ggml_linear import GgmlLinear
from fitserve.model.moe import SparseMoeBlock, route
from fitserve.quant.ggml_blocks import GgmlBlockWeight

if not moe_kernel_available("Q5_0", "Q5_0"):
    pytest.skip("no moe_experts C++ build here", allow_module_level=True)

H, INTER, E, K = 128, 64, 6, 2
Q5_0 = gguf.GGMLQuantizationType.Q5_0


def ggml_linear(rows: int, cols: int, gen: np.random.Generator) -> tuple[GgmlLinear, torch.Tensor]:
    """A Q5_0 GgmlLinear of random weights (gguf-py's quantizer) and its float64 weight."""
    raw = quantize((gen.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32), Q5_0)
    w64 = torch.from_numpy(dequantize(raw, Q5_0).astype(np.float64).reshape(rows, cols))
    return GgmlLinear(GgmlBlockWeight("Q5_0", rows, cols, torch.from_numpy(raw))), w64


def ggml_block(seed: int = 0) -> tuple[SparseMoeBlock, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(seed)
    block = SparseMoeBlock(H, E, K, INTER, renormalize=True)
    gen = np.random.default_rng(seed)
    weights = []
    for mlp in block.experts:
        mlp.gate_up_proj, gu64 = ggml_linear(2 * INTER, H, gen)
        mlp.down_proj, dn64 = ggml_linear(H, INTER, gen)
        weights.append((gu64, dn64))
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.3)
    return block.to(torch.bfloat16).eval(), weights


def reference(block: SparseMoeBlock, weights: list, x: torch.Tensor) -> torch.Tensor:
    """float64, token by token, over the experts the block's own router picks."""
    w, ids = route(block.gate(x), K, True)
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for wj, e in zip(w[t].tolist(), ids[t].tolist(), strict=True):
            gu64, dn64 = weights[e]
            g, u = (x[t].double() @ gu64.T).chunk(2)
            out[t] += wj * ((F.silu(g) * u) @ dn64.T)
    return out


def expert_calls(block: SparseMoeBlock) -> list[int]:
    calls = [0]
    for m in block.experts:
        m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("n", [1, 3, 20])
def test_grouped_block_vs_float64(n: int) -> None:
    block, weights = ggml_block(seed=n)
    calls = expert_calls(block)
    x = torch.randn(n, H).to(torch.bfloat16)
    y = block(x)
    assert block._grouped is not None and block._grouped.active and calls[0] == 0
    ref = reference(block, weights, x)
    # int8 activations per 32 columns (gate/up and down) and the bf16 output
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_experts_held_once_and_restacked_when_replaced() -> None:
    block, _ = ggml_block()
    x = torch.randn(2, H).to(torch.bfloat16)
    block(x)
    grouped = block._grouped
    assert grouped is not None
    base = grouped.gate_up.untyped_storage().data_ptr()
    for e, mlp in enumerate(block.experts):
        assert mlp.gate_up_proj.blocks.untyped_storage().data_ptr() == base
        assert torch.equal(mlp.gate_up_proj.blocks, grouped.gate_up[e])
        assert mlp.down_proj.blocks.data_ptr() == grouped.down[e].data_ptr()
    y = block(x)
    block.experts[0].gate_up_proj.blocks = block.experts[0].gate_up_proj.blocks.clone()
    torch.testing.assert_close(block(x), y, rtol=0, atol=0)
    assert block._grouped is not grouped  # rebuilt over the replaced buffer


def test_float32_and_forced_torch_run_the_per_expert_loop() -> None:
    block, weights = ggml_block()
    calls = expert_calls(block)
    block.float()
    x = torch.randn(4, H)
    torch.testing.assert_close(block(x).double(), reference(block, weights, x), rtol=1e-4,
                               atol=1e-4)
    assert calls[0] > 0
    block.to(torch.bfloat16)
    for mlp in block.experts:
        mlp.gate_up_proj.force_torch = mlp.down_proj.force_torch = True
    calls[0] = 0
    block(x.to(torch.bfloat16))
    assert calls[0] > 0


def test_dense_experts_are_not_grouped() -> None:
    block = SparseMoeBlock(H, E, K, INTER, renormalize=False).to(torch.bfloat16)
    block(torch.randn(2, H).to(torch.bfloat16))
    assert block._grouped is not None and not block._grouped.active
