"""Split-KV decode: the wave-efficiency rule, exact LSE merge, equality with the unsplit result."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fitserve.tools.labs.online_softmax import merge_lse
from fitserve.tools.labs.reference import naive_attention
from fitserve.tools.labs.split_kv import choose_num_splits, split_kv_decode, wave_efficiency

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


def test_wave_efficiency_examples() -> None:
    assert wave_efficiency(3, 8) == 3 / 8
    assert wave_efficiency(9, 8) == 9 / 16
    assert wave_efficiency(16, 8) == 1.0


def test_rule_from_docstring_example() -> None:
    # W = 8 workers, 3 work items: P = 5 gives 15/16; P = 8 gives 1.0 but 5 is within 85%.
    assert choose_num_splits(8, batch=1, num_kv_heads=3, num_kv_blocks=100) == 5


def test_rule_no_split_when_batch_fills_workers() -> None:
    assert choose_num_splits(132, batch=32, num_kv_heads=8, num_kv_blocks=1000) == 1
    assert choose_num_splits(16, batch=13, num_kv_heads=1, num_kv_blocks=1000) == 1   # >= 80%
    assert choose_num_splits(132, batch=1, num_kv_heads=8, num_kv_blocks=1) == 1


def test_rule_single_sequence_on_h100_like() -> None:
    # 132 SMs, 8 KV heads, 512 key blocks: the best eligible efficiency is 128/132 = 0.97
    # (P = 16); the smallest P within 85% of it is 14 (112/132 = 0.848 >= 0.85 * 0.97).
    assert choose_num_splits(132, batch=1, num_kv_heads=8, num_kv_blocks=512) == 14
    assert choose_num_splits(132, batch=1, num_kv_heads=8, num_kv_blocks=512, slack=0.95) == 16


def test_rule_never_exceeds_key_blocks_and_skips_ineligible() -> None:
    # 3 key blocks: P in {1, 2, 3}; P=3 gives 1 block per split.
    assert choose_num_splits(64, batch=1, num_kv_heads=1, num_kv_blocks=3) == 3
    # 4 blocks: P=3 has ceil(4/3)=2 blocks per split, same as P=2 -> ineligible; P=4 chosen.
    assert choose_num_splits(64, batch=1, num_kv_heads=1, num_kv_blocks=4) == 4


@SETTINGS
@given(workers=st.integers(1, 200), batch=st.integers(1, 64), hkv=st.integers(1, 16),
       blocks=st.integers(1, 2000))
def test_rule_properties(workers: int, batch: int, hkv: int, blocks: int) -> None:
    p = choose_num_splits(workers, batch, hkv, blocks)
    assert 1 <= p <= max(1, min(workers, blocks, 128))
    best = max(wave_efficiency(batch * hkv * x, workers) for x in range(1, p + 1))
    assert wave_efficiency(batch * hkv * p, workers) >= 0.85 * best - 1e-12


@SETTINGS
@given(parts=st.integers(1, 6), rows=st.integers(1, 5), seed=st.integers(0, 2**16),
       empty=st.lists(st.booleans(), min_size=6, max_size=6))
def test_merge_is_exact(parts: int, rows: int, seed: int, empty: list[bool]) -> None:
    """Merging partials over disjoint key sets equals attention over their union."""
    g = torch.Generator().manual_seed(seed)
    sizes = [0 if empty[i] else int(torch.randint(1, 6, (1,), generator=g)) for i in range(parts)]
    q = torch.randn(rows, 4, generator=g)
    ks = [torch.randn(s, 4, generator=g) for s in sizes]
    vs = [torch.randn(s, 3, generator=g) for s in sizes]
    partial = [naive_attention(q, k_, v_) for k_, v_ in zip(ks, vs, strict=True)]
    out, lse = merge_lse(torch.stack([p[0] for p in partial]), torch.stack([p[1] for p in partial]))
    ref, ref_lse = naive_attention(q, torch.cat(ks), torch.cat(vs))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if sum(sizes) == 0:
        assert torch.isneginf(lse).all() and torch.equal(out, torch.zeros_like(out))
    else:
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@SETTINGS
@given(batch=st.integers(1, 4), hkv=st.integers(1, 2), group=st.integers(1, 3),
       s_max=st.integers(1, 70), splits=st.integers(1, 9), bn=st.integers(1, 16),
       window=st.one_of(st.none(), st.integers(1, 80)), seed=st.integers(0, 2**16))
def test_split_equals_unsplit_and_reference(batch: int, hkv: int, group: int, s_max: int,
                                            splits: int, bn: int, window: int | None,
                                            seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    hq, d = hkv * group, 8
    q = torch.randn(batch, hq, d, generator=g)
    k = torch.randn(batch, s_max, hkv, d, generator=g)
    v = torch.randn(batch, s_max, hkv, d, generator=g)
    lens = torch.randint(1, s_max + 1, (batch,), generator=g)
    lens[0] = s_max
    out, lse = split_kv_decode(q, k, v, lens, num_splits=splits, block_n=bn,
                               sliding_window=window)
    one, one_lse = split_kv_decode(q, k, v, lens, num_splits=1, block_n=bn, sliding_window=window)
    torch.testing.assert_close(out, one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, one_lse, atol=1e-5, rtol=1e-5)
    for b in range(batch):
        n = int(lens[b])
        kk = k[b, :n].transpose(0, 1).repeat_interleave(group, 0)     # [Hq, n, d]
        vv = v[b, :n].transpose(0, 1).repeat_interleave(group, 0)
        ref, ref_lse = naive_attention(q[b].unsqueeze(1), kk, vv, causal=True, window=window)
        torch.testing.assert_close(out[b].double(), ref[:, 0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[b].double(), ref_lse[:, 0], atol=2e-5, rtol=2e-5)


def test_zero_length_sequence_is_empty_row() -> None:
    q, k, v = torch.randn(2, 2, 4), torch.randn(2, 8, 1, 4), torch.randn(2, 8, 1, 4)
    out, lse = split_kv_decode(q, k, v, torch.tensor([8, 0]), num_splits=3, block_n=2)
    assert torch.equal(out[1], torch.zeros(2, 4)) and torch.isneginf(lse[1]).all()
    assert not torch.isnan(out).any()
