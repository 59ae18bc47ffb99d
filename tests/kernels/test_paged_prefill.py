"""Prefill chunks through the C++ paged decode kernel, one decode row per query
(CpuPagedDecode.prefill): against float64 causal attention over the same cache, with a cached
prefix, a sliding window and GQA; and each query's row equals the decode call for that token."""

from __future__ import annotations

import pytest
import torch

from fitserve.kernels.cpu.paged_attention import paged_attention_available
from fitserve.ledger import scratch
from fitserve.model.attention.backend import PrefillSeq
from fitserve.model.attention.cpu_paged import CPU_PAGED_DECODE

if not paged_attention_available():
    pytest.skip("the paged attention C++ extension is unavailable", allow_module_level=True)

HQ, HKV, D, BS = 6, 2, 64, 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int, scale: float,
              window: int | None) -> torch.Tensor:
    """float64 attention: query i (position cached + i) sees keys j <= cached + i (and
    j > cached + i - window); k, v [Hkv, L, D]."""
    t, g = q.shape[0], HQ // HKV
    out = torch.empty(t, HQ, D, dtype=torch.float64)
    for i in range(t):
        pos = cached + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(HQ):
            kh, vh = k[h // g, lo:pos + 1].double(), v[h // g, lo:pos + 1].double()
            p = torch.softmax((kh @ q[i, h].double()) * scale, dim=0)
            out[i, h] = p @ vh
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cached,t,window", [(0, 37, None), (40, 9, None), (21, 30, 16)])
def test_prefill_rows_match_float64_and_decode(dtype: torch.dtype, cached: int, t: int,
                                               window: int | None) -> None:
    gen = torch.Generator().manual_seed(cached + t)
    total = cached + t
    nblocks = -(-total // BS)
    order = torch.randperm(nblocks + 3, generator=gen)[:nblocks]  # scattered physical blocks
    k_cache = torch.randn(HKV, nblocks + 3, BS, D, generator=gen).to(dtype)
    v_cache = torch.randn(HKV, nblocks + 3, BS, D, generator=gen).to(dtype)
    q = torch.randn(t, HQ, D, generator=gen).to(dtype)
    scale = D ** -0.5
    seq = PrefillSeq(start=0, end=t, cached=cached, block_ids=order.long(),
                     backend=CPU_PAGED_DECODE, window=window)
    got = CPU_PAGED_DECODE.prefill(q, k_cache, v_cache, seq, scale)
    k = k_cache[:, order].reshape(HKV, -1, D)[:, :total]
    v = v_cache[:, order].reshape(HKV, -1, D)[:, :total]
    want = reference(q, k, v, cached, scale, window)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol)
    # the last query is exactly the decode step of that token
    d = CPU_PAGED_DECODE.build_decode([order.tolist()], [total], block_size=BS, window=window,
                                      device=q.device)
    assert torch.equal(CPU_PAGED_DECODE.decode(q[-1:], k_cache, v_cache, d, scale), got[-1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_in_row_slices_is_identical(dtype: torch.dtype,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk whose rows run in several kernel calls (the partials cap, scratch.
    PAGED_PREFILL_PARTIALS_BYTES) gives the same bits as one call, ragged last slice too."""
    gen = torch.Generator().manual_seed(7)
    cached, t = 300, 40
    nblocks = -(-(cached + t) // BS)
    order = torch.randperm(nblocks + 3, generator=gen)[:nblocks]
    k_cache = torch.randn(HKV, nblocks + 3, BS, D, generator=gen).to(dtype)
    v_cache = torch.randn(HKV, nblocks + 3, BS, D, generator=gen).to(dtype)
    q = torch.randn(t, HQ, D, generator=gen).to(dtype)
    seq = PrefillSeq(start=0, end=t, cached=cached, block_ids=order.long(),
                     backend=CPU_PAGED_DECODE, window=None)
    assert scratch.paged_prefill_rows(HQ, HKV, D, cached + t) >= t  # one call by default
    whole = CPU_PAGED_DECODE.prefill(q, k_cache, v_cache, seq, D ** -0.5)
    # 340 keys: 2 partitions x 2 KV heads x G 3 x (64 + 2) x 4 B = 3,168 B a row
    monkeypatch.setattr(scratch, "PAGED_PREFILL_PARTIALS_BYTES", 7 * 3_168)
    assert scratch.paged_prefill_rows(HQ, HKV, D, cached + t) == 7  # 6 calls, the last of 5
    sliced = CPU_PAGED_DECODE.prefill(q, k_cache, v_cache, seq, D ** -0.5)
    assert torch.equal(sliced, whole)
