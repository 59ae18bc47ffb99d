"""fitserve::moe_route (moe_route.h: a MoE layer's softmax / top-k / renormalisation in one
call) against float64: the softmax of the logits in float64, the experts ranked by those
probabilities rounded to fp32 (a stable descending sort: equal probabilities to the lower
expert), their probabilities or, renormalised, the float64 softmax of the chosen logits."""

from __future__ import annotations

import pytest
import torch

from fitserve.kernels.cpu.moe_experts import moe_route, moe_route_available
from fitserve.model.moe import route

if not moe_route_available():
    pytest.skip("the moe_experts C++ extension could not be built here", allow_module_level=True)


def reference(logits: torch.Tensor, k: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    p64 = torch.softmax(logits.double(), -1)
    ids = torch.sort(p64.float(), stable=True, dim=-1, descending=True).indices[:, :k]
    if renormalize:
        return torch.softmax(torch.gather(logits.double(), 1, ids), -1), ids
    return torch.gather(p64, 1, ids), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,e,k", [(1, 64, 8), (7, 8, 2), (33, 60, 4), (3, 5, 5), (2, 16, 1)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_matches_float64(dtype: torch.dtype, n: int, e: int, k: int, renormalize: bool) -> None:
    torch.manual_seed(n * e + k)
    logits = (torch.randn(n, e) * 4).to(dtype)
    logits[0, -1] = logits[0, 0]  # a tie (in bf16 often more)
    w, ids = moe_route(logits, k, renormalize)
    w64, ids64 = reference(logits, k, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ids64)
    torch.testing.assert_close(w.double(), w64, rtol=2e-7, atol=1e-9)
    assert torch.equal(route(logits, k, renormalize)[1], ids)  # moe.route calls it on the CPU


def test_ties_go_to_the_lower_expert() -> None:
    w, ids = moe_route(torch.zeros(2, 6), 3, False)
    assert ids.tolist() == [[0, 1, 2]] * 2
    assert torch.equal(w, torch.full((2, 3), 1 / 6))
    w, ids = moe_route(torch.tensor([[1.0, 3.0, 1.0, 3.0]]), 3, True)
    assert ids.tolist() == [[1, 3, 0]]


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="1 <= k <= E"):
        moe_route(torch.zeros(2, 4), 5, True)
    with pytest.raises(ValueError, match="1 <= k <= E"):
        moe_route(torch.zeros(4), 1, True)
    with pytest.raises(RuntimeError, match="float32 / bfloat16 / float16"):
        moe_route(torch.zeros(2, 4, dtype=torch.int32), 2, True)
    w, ids = moe_route(torch.zeros(0, 4), 2, False)
    assert w.shape == ids.shape == (0, 2)
