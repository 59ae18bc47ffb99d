"""Triton forward and paged split-KV decode vs the float64 reference (interpreter on CPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: must precede the first @triton.jit decoration (it picks interpreter vs compiler).
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from fitserve.kernels.triton import interpreter_enabled  # noqa: E402
from fitserve.kernels.triton.decode import triton_paged_decode  # noqa: E402
from fitserve.kernels.triton.forward import triton_attention_forward  # noqa: E402
from fitserve.tools.labs.reference import naive_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreter_enabled():
    pytest.skip("no CUDA and TRITON_INTERPRET is off", allow_module_level=True)


@pytest.mark.parametrize(("m", "n", "causal", "window"), [
    (1, 1, True, None),        # T = 1, single key
    (5, 37, True, None),       # chunk at the end of a cache, odd sizes
    (20, 20, True, 7),         # sliding window
    (19, 11, True, None),      # M > N: first 8 rows fully masked
    (3, 21, False, 100),       # window larger than the sequence, non-causal
])
def test_triton_forward_matches_reference(m: int, n: int, causal: bool,
                                          window: int | None) -> None:
    g = torch.Generator().manual_seed(m * 100 + n)
    q = torch.randn(1, 4, m, 12, generator=g)
    k, v = (torch.randn(1, 2, n, 12, generator=g) for _ in range(2))
    out, lse = triton_attention_forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), causal=causal,
                                        window=window, block_m=16, block_n=16)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)       # GQA: h -> h // 2
    ref, ref_lse = naive_attention(q, kk, vv, causal=causal, window=window)
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = ~torch.isneginf(ref_lse)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("splits", "window"), [(1, None), (3, None), (4, 6)])
def test_triton_paged_decode_matches_reference(splits: int, window: int | None) -> None:
    g = torch.Generator().manual_seed(splits)
    lens, bs, hkv, group, d = [23, 1, 9, 0], 4, 2, 3, 8
    blocks = [-(-n // bs) for n in lens]
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    perm = (torch.randperm(sum(blocks), generator=g) + 1).tolist()
    for b, nb in enumerate(blocks):
        for j in range(nb):
            table[b, j] = perm.pop()
    kc, vc = (torch.randn(sum(blocks) + 1, bs, hkv, d, generator=g) for _ in range(2))
    q = torch.randn(len(lens), hkv * group, d, generator=g)
    out, lse = triton_paged_decode(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), table.to(DEVICE),
                                   torch.tensor(lens).to(DEVICE), num_splits=splits,
                                   sliding_window=window, block_n=16)
    out, lse = out.cpu(), lse.cpu()
    for b, n in enumerate(lens):
        idx = torch.arange(n)
        pages = table[b, idx // bs].long()
        kk = kc[pages, idx % bs].transpose(0, 1).repeat_interleave(group, 0)
        vv = vc[pages, idx % bs].transpose(0, 1).repeat_interleave(group, 0)
        ref, ref_lse = naive_attention(q[b].unsqueeze(1), kk, vv, causal=True, window=window)
        torch.testing.assert_close(out[b].double(), ref[:, 0], atol=1e-4, rtol=1e-4)
        if n == 0:
            assert torch.isneginf(lse[b]).all()
        else:
            torch.testing.assert_close(lse[b].double(), ref_lse[:, 0], atol=1e-4, rtol=1e-4)
