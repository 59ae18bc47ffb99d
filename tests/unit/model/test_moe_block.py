"""The sparse expert block (fitserve.model.moe) against a float64 loop over experts.

The reference routes each token alone in float64 (softmax, top-k, renormalised or not) and
sums ``w * down(silu(gate x) * up x)`` over its k experts; the block groups the step's tokens
by expert and runs each active expert once. Groupings are ragged on purpose: one expert with
many tokens, one with a single token, one with none; two tokens that pick disjoint experts;
every token picking the same two.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitserve.model.moe import SparseMoeBlock, group_by_expert, route

H, INTER, E, K = 32, 24, 6, 2


def make_block(*, renormalize: bool, shared: int = 0, seed: int = 0) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(H, E, K, INTER, renormalize=renormalize, shared_intermediate=shared)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.eval()


def _mlp64(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_up_proj.weight.double().chunk(2, dim=0)
    return (F.silu(x @ gate.T) * (x @ up.T)) @ mlp.down_proj.weight.double().T


def reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """float64, token by token, expert by expert."""
    x64 = x.double()
    out = torch.zeros_like(x64)
    for t in range(x.shape[0]):
        probs = torch.softmax(x64[t] @ block.gate.weight.double().T, dim=-1)
        w, ids = torch.topk(probs, K)
        if block.renormalize:
            w = w / w.sum()
        for wj, e in zip(w.tolist(), ids.tolist(), strict=True):
            out[t] += wj * _mlp64(block.experts[e], x64[t : t + 1])[0]
        if block.shared_expert is not None:
            g = torch.sigmoid(x64[t] @ block.shared_expert_gate.weight.double().T)
            out[t] += g * _mlp64(block.shared_expert, x64[t : t + 1])[0]
    return out


def steer(block: SparseMoeBlock, x: torch.Tensor, picks: list[tuple[int, int]]) -> None:
    """Set the router so token t's top-2 are ``picks[t]`` (big logits on a per-token basis:
    the router row of expert e is the sum of the tokens' directions that pick it)."""
    dual = torch.linalg.pinv(x.double())  # [H, N]: x @ dual = I (N <= H tokens)
    w = torch.zeros(E, H, dtype=torch.float64)
    for t, (a, b) in enumerate(picks):
        w[a] += 8.0 * dual[:, t]
        w[b] += 6.0 * dual[:, t]
    with torch.no_grad():
        block.gate.weight.copy_(w.float())


def calls_per_expert(block: SparseMoeBlock) -> tuple[list[int], list[torch.utils.hooks.RemovableHandle]]:
    calls = [0] * E
    hooks = [m.register_forward_hook(lambda mod, i, o, e=e: calls.__setitem__(e, calls[e] + 1))
             for e, m in enumerate(block.experts)]
    return calls, hooks


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shared", [0, 16])
def test_random_routing_vs_float64(renormalize: bool, shared: int) -> None:
    block = make_block(renormalize=renormalize, shared=shared)
    x = torch.randn(37, H)
    torch.testing.assert_close(block(x).double(), reference(block, x), rtol=1e-5, atol=1e-5)


def test_ragged_groups() -> None:
    """Expert 0: all 7 tokens; expert 1: one token; expert 2..5 share the rest; one expert idle."""
    block = make_block(renormalize=True)
    x = torch.randn(7, H)
    picks = [(0, 1)] + [(0, 2 + t % 3) for t in range(6)]  # expert 5 never picked
    steer(block, x, picks)
    _, ids = route(block.gate(x), K, True)
    assert [sorted(r) for r in ids.tolist()] == [sorted(p) for p in picks]
    order, counts = group_by_expert(ids, E)
    assert counts == [7, 1, 2, 2, 2, 0]
    assert ids.reshape(-1)[order].tolist() == sorted(ids.reshape(-1).tolist())
    calls, hooks = calls_per_expert(block)
    out = block(x)
    assert calls == [1, 1, 1, 1, 1, 0]  # each active expert once, the idle one never
    torch.testing.assert_close(out.double(), reference(block, x), rtol=1e-5, atol=1e-5)
    for h in hooks:
        h.remove()


def test_disjoint_and_shared_picks() -> None:
    """Two tokens on disjoint experts: each runs its own two experts on one row; all tokens
    on the same two experts: those two run once over every token."""
    block = make_block(renormalize=False)
    x = torch.randn(2, H)
    steer(block, x, [(0, 1), (2, 3)])
    calls, hooks = calls_per_expert(block)
    torch.testing.assert_close(block(x).double(), reference(block, x), rtol=1e-5, atol=1e-5)
    assert calls == [1, 1, 1, 1, 0, 0]
    for h in hooks:
        h.remove()
    x = torch.randn(5, H)
    steer(block, x, [(4, 1)] * 5)
    _, ids = route(block.gate(x), K, False)
    assert ids.tolist() == [[4, 1]] * 5
    calls, hooks = calls_per_expert(block)
    torch.testing.assert_close(block(x).double(), reference(block, x), rtol=1e-5, atol=1e-5)
    assert calls == [0, 1, 0, 0, 1, 0]
    for h in hooks:
        h.remove()


def test_batch1_reads_only_k_experts() -> None:
    """One token: exactly k expert modules run (the other experts' weights are not read)."""
    block = make_block(renormalize=True)
    calls, hooks = calls_per_expert(block)
    block(torch.randn(1, H))
    assert sum(calls) == K and max(calls) == 1
    for h in hooks:
        h.remove()


def test_route_matches_softmax_topk() -> None:
    logits = torch.randn(9, E)
    for renorm in (True, False):
        w, ids = route(logits, K, renorm)
        p = torch.softmax(logits.double(), -1)
        w64, ids64 = torch.topk(p, K)
        if renorm:  # Mixtral: softmax over the top-k logits, the same numbers
            w64 = torch.softmax(torch.gather(logits.double(), 1, ids64), -1)
        assert torch.equal(ids, ids64)
        torch.testing.assert_close(w.double(), w64, rtol=1e-6, atol=1e-7)
