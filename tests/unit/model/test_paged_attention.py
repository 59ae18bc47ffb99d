"""The engine's attention over the paged cache vs a float64 dense reference."""

from __future__ import annotations

import importlib.util
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton paths run on CPU in the interpreter

import pytest
import torch

from fitserve.model.attention.backend import AttentionBackend, DecodeBatch, PrefillSeq, visible_mask
from fitserve.model.attention.gather import EAGER_GATHER, TORCH_SDPA
from fitserve.model.attention.paged import AttentionBatch, paged_attention, write_kv
from fitserve.model.attention.triton_attn import TRITON_DECODE, TRITON_PREFILL

BS = 4  # block size
HAS_TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
DECODE_BACKENDS = [EAGER_GATHER, TORCH_SDPA] + ([TRITON_DECODE] if HAS_TRITON else [])
# prefill backend, and the decode backend a single token may also run on
CHUNK_BACKENDS = {"eager_gather": (EAGER_GATHER, EAGER_GATHER),
                  "torch_sdpa": (TORCH_SDPA, TORCH_SDPA), "triton": (TRITON_PREFILL, TRITON_DECODE)}



def reference(q, k, v, start: int, window: int | None, top_left: bool = False) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Dense float64 attention for one sequence: q [T,Hq,D] at positions start.., k/v [S+T,Hkv,D]."""
    t, hq, d = q.shape
    hk = k.shape[1]
    kk = k.double().repeat_interleave(hq // hk, dim=1)
    vv = v.double().repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) / math.sqrt(d)
    if top_left:  # what scaled_dot_product_attention(is_causal=True) does for a non-square chunk
        mask = torch.ones(t, k.shape[0], dtype=torch.bool).tril()
    else:
        mask = visible_mask(t, start, window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)


def scatter_into_pages(k, v, table: list[int], num_blocks: int):  # type: ignore[no-untyped-def]
    """Write dense K/V for positions 0.. into a paged cache following ``table``."""
    hk, d = k.shape[1:]
    kc = torch.randn(hk, num_blocks, BS, d)  # garbage everywhere else: must never be read
    vc = torch.randn(hk, num_blocks, BS, d)
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(k.shape[0])])
    write_kv(k, v, kc, vc, slots)
    return kc, vc


@pytest.mark.parametrize("impl", list(CHUNK_BACKENDS))
@pytest.mark.parametrize("cached,new,window", [(0, 5, None), (6, 3, None), (9, 1, None), (5, 6, 4), (13, 2, 3)])
def test_chunk_at_end_of_cache_matches_bottom_right_reference(
    cached: int, new: int, window: int | None, impl: str
) -> None:
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    torch.manual_seed(cached * 31 + new)
    hq, hk, d = 6, 2, 8
    total = cached + new
    table = [7, 2, 9, 0, 5][: -(-total // BS)]
    k, v = torch.randn(total, hk, d), torch.randn(total, hk, d)
    q = torch.randn(new, hq, d)
    kc, vc = scatter_into_pages(k, v, table, 10)
    plain = cached == 0 and (window is None or window >= new)
    prefill, decode = CHUNK_BACKENDS[impl]
    seq = PrefillSeq(0, new, cached, torch.tensor(table), prefill,
                     mask=None if plain else visible_mask(new, cached, window), window=window)
    batch = AttentionBatch(slot_mapping=torch.empty(0, dtype=torch.long), decode=None, prefills=[seq])
    if new == 1:  # a single token can go through the batched decode path too
        vis = (torch.arange(len(table) * BS) < total)
        if window is not None:
            vis &= (total - 1 - torch.arange(len(table) * BS)) < window
        batch = AttentionBatch(torch.empty(0, dtype=torch.long),
                               DecodeBatch(1, torch.tensor([table]), decode, visible=vis[None, None, None, :],
                                           seq_lens=torch.tensor([total]), window=window))
    out = paged_attention(q, kc, vc, batch, 1 / math.sqrt(d))
    ref = reference(q, k, v, cached, window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if cached > 0 and window is None:
        # The library-default top-left mask gives a different answer: this test would catch it.
        wrong = reference(q, k, v, cached, None, top_left=True)
        assert (wrong - ref).abs().max() > 1e-2


@pytest.mark.parametrize("backend", DECODE_BACKENDS, ids=repr)
def test_ragged_decode_batch_with_gqa_and_padding(backend: AttentionBackend) -> None:
    torch.manual_seed(0)
    hq, hk, d = 9, 3, 16
    lens = [1, 7, 12, 4]
    tables = [[3], [0, 6], [1, 4, 8], [2]]
    kc = torch.randn(hk, 10, BS, d)
    vc = torch.randn(hk, 10, BS, d)
    width = 3
    padded = [t + [0] * (width - len(t)) for t in tables]
    vis = torch.arange(width * BS)[None, :] < torch.tensor(lens)[:, None]
    q = torch.randn(len(lens), hq, d)
    batch = AttentionBatch(torch.empty(0, dtype=torch.long), DecodeBatch(len(lens), torch.tensor(padded), backend, visible=vis[None, :, None, :],
                                                                     seq_lens=torch.tensor(lens)))
    out = paged_attention(q, kc, vc, batch, 1 / math.sqrt(d))
    for b, (n, table) in enumerate(zip(lens, tables, strict=True)):
        k = kc[:, table].flatten(1, 2)[:, :n].transpose(0, 1)
        v = vc[:, table].flatten(1, 2)[:, :n].transpose(0, 1)
        ref = reference(q[b : b + 1], k, v, n - 1, None)
        torch.testing.assert_close(out[b : b + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_visible_mask_is_bottom_right_aligned() -> None:
    m = visible_mask(2, 3, None)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    w = visible_mask(3, 2, 2)  # window 2: a query sees itself and the key before it
    assert w.tolist() == [
        [False, True, True, False, False],
        [False, False, True, True, False],
        [False, False, False, True, True],
    ]
