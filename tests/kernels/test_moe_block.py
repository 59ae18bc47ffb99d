"""fitserve::moe_block_ggml (moe_block.h: one token's router, routing and experts in one parallel
region) against the three separately tested ops it fuses, called in turn: bf16_gemv (router
logits), moe_route and moe_experts_ggml (rounded to bf16). It must give the same bits at 1, 2 and
3 threads for k = 1 .. E, with and without renormalisation: whole experts per thread where they
split evenly (k = 2, 4, 6 at 2 threads; 3, 6 at 3) and chunk spans with barriers otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fitserve.kernels.cpu.dense_gemv import bf16_gemv_available
from fitserve.kernels.cpu.moe_experts import (
    moe_block_ggml,
    moe_experts_ggml,
    moe_kernel_available,
    moe_route,
)
from tests.conftest import torch_threads
from tests.kernels.test_ggml_blocks import random_blocks

if not (moe_kernel_available("Q4_K", "Q6_K") and bf16_gemv_available()):
    pytest.skip("the moe_experts / dense_gemv C++ extensions could not be built here",
                allow_module_level=True)

E, H, INTER = 6, 256, 256


def stack(t: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([random_blocks(t, rows, cols, seed + e) for e in range(E)]))


def three_ops(x: torch.Tensor, router: torch.Tensor, k: int, renormalize: bool,
              gu: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
    logits = torch.ops.fitserve_dense.bf16_gemv(x, router, None)
    w, ids = moe_route(logits, k, renormalize)
    return moe_experts_ggml(x, ids, w, gu, "Q4_K", dn, "Q6_K", out_x_dtype=True)


@pytest.mark.parametrize("renormalize", [False, True])
def test_same_bits_as_the_three_ops(renormalize: bool) -> None:
    gu, dn = stack("Q4_K", 2 * INTER, H, 21), stack("Q6_K", H, INTER, 31)
    gen = torch.Generator().manual_seed(5)
    router = (0.05 * torch.randn(E, H, generator=gen)).bfloat16()
    for k in range(1, E + 1):
        x = torch.randn(1, H, generator=gen).bfloat16()
        for threads in (1, 2, 3):
            with torch_threads(threads):
                want = three_ops(x, router, k, renormalize, gu, dn)
                got = moe_block_ggml(x, router, k, renormalize, gu, "Q4_K", dn, "Q6_K")
            assert got.dtype == torch.bfloat16 and got.shape == (1, H)
            assert torch.equal(got, want), f"k={k} threads={threads}"
    # the router matters: another router's block differs
    other = moe_block_ggml(x, router.flip(0), 2, renormalize, gu, "Q4_K", dn, "Q6_K")
    assert not torch.equal(other, three_ops(x, router, 2, renormalize, gu, dn))


def test_bad_arguments_raise() -> None:
    gu, dn = stack("Q4_K", 2 * INTER, H, 1), stack("Q6_K", H, INTER, 2)
    x, router = torch.randn(1, H).bfloat16(), torch.randn(E, H).bfloat16()
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[1, H\]"):
        moe_block_ggml(x.float(), router, 2, True, gu, "Q4_K", dn, "Q6_K")
    with pytest.raises(RuntimeError, match="router must be a contiguous bfloat16"):
        moe_block_ggml(x, router[:4], 2, True, gu, "Q4_K", dn, "Q6_K")
    with pytest.raises(RuntimeError, match="k = 7 experts of 6"):
        moe_block_ggml(x, router, 7, True, gu, "Q4_K", dn, "Q6_K")
