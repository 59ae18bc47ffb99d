"""The fused paged decode kernel over a quantized KV cache vs float64 attention.

Reference: the cache's codes decoded by torch (``codes.view(float8).double()`` / int8 as
float64) times their scales in float64, gathered by hand through the block tables, plain
softmax over the visible keys; so it shares nothing with the kernel's in-register widening or
its folding of the scales into q, the scores and the softmax weights. Both sides read the same
codes and scales, so the only difference is the kernel's fp32 arithmetic: atol = rtol = 1e-5
for a float32 q; a bfloat16 output is within half an ulp of the reference (+1e-5).

Every case writes ragged sequences through ``QuantizedKVCache.write`` (per-token scales, or
per-channel key scales with their running block absmax) into shuffled blocks with unused
blocks between them, then sets every scale no visible key owns to NaN: a read outside the
visible keys (padding, other blocks, keys left of a sliding window) turns the output NaN.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from fitserve.kernels.cpu.build import cpp_disabled
from fitserve.kernels.cpu.paged_attention import DEFAULT_PARTITION
from fitserve.kernels.cpu.paged_attention_kvq import (
    kernel_kvq_isa,
    paged_attention_kvq_available,
    paged_decode_attention_kvq,
)
from fitserve.quant.kv_cache import CODECS, KEY_LAYOUTS, QuantizedKVCache
from tests.conftest import asked_tier, run_tests_at_tier

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None or cpp_disabled(),
    reason="no C++ compiler or FITSERVE_DISABLE_CPP=1")


def test_builds_where_a_compiler_is_present() -> None:
    assert paged_attention_kvq_available()
    assert kernel_kvq_isa() in ("avx512", "avx2", "scalar")


class QuantPaged:
    """Ragged sequences in a QuantizedKVCache's shuffled blocks (gaps between them), with
    NaN scales wherever no visible key is."""

    def __init__(self, lens: list[int], *, codec: str, layout: str, hkv: int, d: int, bs: int,
                 window: int | None, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        n_blocks = [-(-n // bs) for n in lens]
        total = 2 * sum(n_blocks) + 3
        order = torch.randperm(total, generator=gen).tolist()
        self.tables = []
        used = 0
        for n in n_blocks:  # every other block of the permutation: unused blocks between
            self.tables.append(order[used : used + 2 * n : 2])
            used += 2 * n
        self.kv = QuantizedKVCache(codec, layout, num_kv_heads=hkv, num_blocks=total,
                                   block_size=bs, head_dim=d)
        self.lens, self.bs, self.window = lens, bs, window
        visible = torch.zeros(total * bs, dtype=torch.bool)
        for table, n in zip(self.tables, lens, strict=True):
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], dtype=torch.long)
            # keys with a few outlier channels (what per-channel key scales are for)
            k = torch.randn(n, hkv, d, generator=gen) * (1 + 4 * (torch.arange(d) % 13 == 0))
            v = torch.randn(n, hkv, d, generator=gen)
            half = n // 2  # two writes: per-channel block scales grow and requantize
            self.kv.write(k[:half], v[:half], slots[:half])
            self.kv.write(k[half:], v[half:], slots[half:])
            lo = max(0, n - window) if window else 0
            visible[slots[lo:]] = True
        nan = float("nan")
        self.kv.v_scales.view(hkv, -1)[:, ~visible] = nan
        if layout == "token":
            self.kv.k_scales.view(hkv, -1)[:, ~visible] = nan
        else:
            self.kv.k_scales[:, ~visible.view(total, bs).any(1)] = nan

    def table_tensor(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)

    def dequantized64(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [Hkv, num_blocks, bs, D] in float64: torch's decode of the codes x scales."""
        kv = self.kv
        fp8 = kv.codec.fp8

        def decode(codes: torch.Tensor) -> torch.Tensor:
            return (codes if fp8 is None else codes.view(fp8)).double()

        ks = kv.k_scales.double()
        k = decode(kv.k_codes) * (ks.unsqueeze(2) if kv.key_layout == "channel-key"
                                  else ks.unsqueeze(-1))
        return k, decode(kv.v_codes) * kv.v_scales.double().unsqueeze(-1)

    def reference(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        kd, vd = self.dequantized64()
        b_, hq, d = q.shape
        hkv = kd.shape[0]
        out = torch.zeros(b_, hq, d, dtype=torch.float64)
        for b, (table, n) in enumerate(zip(self.tables, self.lens, strict=True)):
            lo = max(0, n - self.window) if self.window else 0
            if n == 0:
                continue
            k = kd[:, table].reshape(hkv, -1, d)[:, lo:n]
            v = vd[:, table].reshape(hkv, -1, d)[:, lo:n]
            qg = q[b].double().view(hkv, hq // hkv, d)
            p = (torch.einsum("hgd,hld->hgl", qg, k) * scale).softmax(-1)
            out[b] = torch.einsum("hgl,hld->hgd", p, v).reshape(hq, d)
        return out

    def run(self, q: torch.Tensor, scale: float, **kw: object) -> torch.Tensor:
        kv = self.kv
        return paged_decode_attention_kvq(
            q, kv.k_codes, kv.v_codes, kv.k_scales, kv.v_scales, self.table_tensor(),
            torch.tensor(self.lens, dtype=torch.int32), scale, self.window,
            codec=kv.codec.name, channel_keys=kv.key_layout == "channel-key", **kw)  # type: ignore[arg-type]


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all(), "read a scale outside the visible keys (NaN leaked)"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        return
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2.0**-8 + 1e-5
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.2e}"


# (batch, max_len, block_size, head_dim, num_kv, group, window)
SHAPES = [
    (1, 1, 16, 64, 3, 3, None),
    (1, 700, 16, 64, 3, 3, None),
    (5, 300, 32, 128, 2, 4, None),
    (7, 650, 16, 80, 2, 8, None),
    (4, 700, 16, 64, 1, 1, 100),
    (6, 400, 8, 128, 2, 4, 37),
    (3, 90, 32, 20, 2, 2, 1),
    (3, 150, 16, 64, 1, 7, 600),
]


@pytest.mark.parametrize("layout", KEY_LAYOUTS)
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}L{}bs{}d{}h{}g{}w{}".format(*s))
def test_matches_float64_reference(shape: tuple[int, ...], codec: str, layout: str) -> None:
    b, max_len, bs, d, hkv, g, window = shape
    gen = torch.Generator().manual_seed(b * 1000 + max_len)
    lens = [max_len] + torch.randint(1, max_len + 1, (b - 1,), generator=gen).tolist()
    cache = QuantPaged(lens, codec=codec, layout=layout, hkv=hkv, d=d, bs=bs, window=window,
                       seed=b + d)
    scale = d**-0.5
    q = torch.randn(b, hkv * g, d, generator=gen) * 2
    ref = cache.reference(q, scale)
    for vectorized in (True, False):
        for partition in (DEFAULT_PARTITION, 48):
            _check(cache.run(q, scale, partition_size=partition, vectorized=vectorized), ref)
    qb = q.bfloat16()
    _check(cache.run(qb, scale), cache.reference(qb, scale))


def test_strided_q_and_empty_sequences() -> None:
    cache = QuantPaged([0, 17, 40], codec="int8", layout="channel-key", hkv=2, d=64, bs=16,
                       window=None, seed=5)
    qk = torch.randn(3, 8 + 2, 64)
    q = qk[:, :8]  # the model's q: a strided slice of the fused projection
    out = cache.run(q, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _check(out, cache.reference(q, 0.125))


def test_rejects_bad_inputs_with_a_clear_error() -> None:
    cache = QuantPaged([20], codec="int8", layout="token", hkv=2, d=64, bs=16, window=None,
                       seed=1)
    kv, q = cache.kv, torch.zeros(1, 4, 64)
    tables, lens = cache.table_tensor(), torch.tensor([20])
    args = (kv.k_codes, kv.v_codes, kv.k_scales, kv.v_scales)
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        paged_decode_attention_kvq(q, *args, torch.tensor([[0, 999]], dtype=torch.int32), lens,
                                   0.1, codec="int8", channel_keys=False)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        paged_decode_attention_kvq(q, *args, tables, torch.tensor([33]), 0.1, codec="int8",
                                   channel_keys=False)
    with pytest.raises(RuntimeError, match="uint8"):
        paged_decode_attention_kvq(q, *args, tables, lens, 0.1, codec="fp8_e4m3",
                                   channel_keys=False)
    with pytest.raises(RuntimeError, match="per-channel k_scales"):
        paged_decode_attention_kvq(q, *args, tables, lens, 0.1, codec="int8", channel_keys=True)
    with pytest.raises(ValueError, match="unknown KV codec"):
        paged_decode_attention_kvq(q, *args, tables, lens, 0.1, codec="int4", channel_keys=False)


@pytest.mark.parametrize("tier", ["avx2", "scalar"])
def test_tier_is_the_one_asked_for(tier: str) -> None:
    assert asked_tier(tier) == kernel_kvq_isa()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "scalar"])
def test_lower_tier_build_passes_the_reference(tier: str) -> None:
    """The kernel built for a lower tier (FITSERVE_CPU_TIER) on this CPU passes the same checks."""
    run_tests_at_tier(__file__, tier, f"matches_float64 or tier_is_the_one_asked_for and {tier}")
