"""The fused rotation + quantized cache write (kvq_write.cpp, ``QuantizedKVCache.rope_write_``)
against the torch path it replaces: RotaryEmbedding's rotation written out here (the cos/sin
rows in the activation dtype, rotate_half / interleaved pairs) followed by the torch quantizer
``QuantizedKVCache.write``. Rotated q/k, codes and scales must be bit-equal, for every codec,
key scale layout, activation dtype and pairing, over a prefill chunk spanning blocks, then
single-token steps that start blocks, fill them and (per-channel keys) grow their scales so the
block's earlier codes are re-encoded. Stale codes and scales of "freed" blocks are left in both
caches, so a block start that failed to reset them would show.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from fitserve.kernels.cpu.build import cpp_disabled
from fitserve.kernels.cpu.paged_attention_kvq import kernel_kvq_isa, kvq_write_available
from fitserve.quant.kv_cache import CODECS, KEY_LAYOUTS, QuantizedKVCache
from tests.conftest import asked_tier, run_tests_at_tier

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None or cpp_disabled(),
    reason="no C++ compiler or FITSERVE_DISABLE_CPP=1")

HQ, HKV, D, BS, NB = 4, 2, 16, 4, 12


def rotate_like_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                      interleaved: bool) -> torch.Tensor:
    """fitserve.model.layers.RotaryEmbedding's forward on its tables(positions, x.dtype)."""
    c, s = cos[pos].to(x.dtype).unsqueeze(1), sin[pos].to(x.dtype).unsqueeze(1)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    c, s = torch.cat((c, c), -1), torch.cat((-s, s), -1)
    return x * c + x.roll(x.shape[-1] // 2, dims=-1) * s


def _caches(codec: str, layout: str, gen: torch.Generator) -> tuple[QuantizedKVCache, ...]:
    pair = tuple(QuantizedKVCache(codec, layout, num_kv_heads=HKV, num_blocks=NB, block_size=BS,
                                  head_dim=D) for _ in range(2))
    stale = QuantizedKVCache(codec, layout, num_kv_heads=HKV, num_blocks=NB, block_size=BS,
                             head_dim=D)
    stale.write(torch.randn(NB * BS, HKV, D, generator=gen) * 50,
                torch.randn(NB * BS, HKV, D, generator=gen), torch.arange(NB * BS))
    for kv in pair:  # what freed blocks hold: another sequence's codes and scales
        for name in ("k_codes", "v_codes", "k_scales", "v_scales"):
            getattr(kv, name).copy_(getattr(stale, name))
    return pair


# (positions, slots): a 7-token prefill over blocks 0 and 2, a token finishing block 2, then
# single tokens starting block 5 and filling it (keys grow 1x..11x), and one starting block 6
STEPS = [(list(range(7)), [0, 1, 2, 3, 8, 9, 10]), ([7], [11]), ([8], [20]), ([9], [21]),
         ([10], [22]), ([11], [23]), ([12], [24])]


@pytest.mark.parametrize("layout", KEY_LAYOUTS)
@pytest.mark.parametrize("codec", list(CODECS))
def test_bit_equal_to_torch_rotation_and_quantizer(codec: str, layout: str) -> None:
    for dtype, interleaved in [(torch.bfloat16, False), (torch.bfloat16, True),
                               (torch.float32, False), (torch.float16, True)]:
        _check_steps(codec, layout, dtype, interleaved)


def _check_steps(codec: str, layout: str, dtype: torch.dtype, interleaved: bool) -> None:
    assert kvq_write_available()
    gen = torch.Generator().manual_seed(len(codec) * 7 + len(layout))
    fused, ref = _caches(codec, layout, gen)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(64).float()[:, None] * inv
    cos, sin = ang.cos(), ang.sin()
    grew = False
    for pos, slots in STEPS:
        n = len(pos)
        gain = 1 + 10 * torch.rand(n, 1, generator=gen)
        qkv = (torch.randn(n, (HQ + 2 * HKV) * D, generator=gen) * gain).to(dtype)
        qk = qkv[:, : (HQ + HKV) * D].view(n, HQ + HKV, D)  # strided, as the model passes it
        v = qkv[:, (HQ + HKV) * D :].view(n, HKV, D)
        p, s = torch.tensor(pos), torch.tensor(slots)
        want = rotate_like_torch(qk.clone(), cos, sin, p, interleaved)
        scales_before = ref.k_scales.clone()
        ref.write(want[:, HQ:], v, s)
        assert fused.rope_write_(qk, v, p, cos, sin, s, HQ, interleaved)
        assert torch.equal(qk, want), "rotation"
        for name in ("k_codes", "v_codes", "k_scales", "v_scales"):
            assert torch.equal(getattr(fused, name), getattr(ref, name)), (name, pos, dtype)
        grew |= layout == "channel-key" and pos[0] in (9, 10, 11) and bool(
            (ref.k_scales[:, 5] > scales_before[:, 5]).any())
    assert grew or layout == "token", "vacuous: no block's key scales grew"


def _edge_values() -> torch.Tensor:
    """Values an encoder gets wrong first: every fp8 code's value, the midpoints between
    neighbours (round half to even) and one ulp either side, int8 halves, fp8 subnormals and
    values past each format's range (clamped), both signs."""
    parts = [torch.arange(-300, 300).float() + 0.5, torch.tensor([1e-30, 1e-10, 7e4, 1e6])]
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        c = torch.arange(256, dtype=torch.uint8).view(dt).float()
        c = c[torch.isfinite(c)].unique()
        mid = (c[1:] + c[:-1]) / 2
        parts += [c, mid, mid.nextafter(torch.tensor(1e9)), mid.nextafter(torch.tensor(-1e9))]
    x = torch.cat(parts)
    return torch.cat([x, -x])


@pytest.mark.parametrize("codec", list(CODECS))
def test_encoder_edge_values_bit_equal(codec: str) -> None:
    """Token rows of float32 values (V: not rotated) whose absmax is the format's max, so the
    scale is 1 and each code is the encoding of the value itself (rows past that range scale
    down): codes and scales equal the torch quantizer's, value by value."""
    assert kvq_write_available()
    fmt = CODECS[codec]
    x = _edge_values()
    d = 64
    n = -(-x.numel() // (d - 1))
    body = torch.zeros(n * (d - 1))
    body[: x.numel()] = x
    v = torch.cat([torch.full((n, 1), fmt.qmax), body.view(n, d - 1)], 1)
    fused = QuantizedKVCache(codec, "token", num_kv_heads=1, num_blocks=n, block_size=1,
                             head_dim=d)
    ref = QuantizedKVCache(codec, "token", num_kv_heads=1, num_blocks=n, block_size=1,
                           head_dim=d)
    slots = torch.arange(n)
    ref.write(torch.zeros(n, 1, d), v.view(n, 1, d), slots)
    cos, sin = torch.ones(n, d // 2), torch.zeros(n, d // 2)
    assert fused.rope_write_(torch.zeros(n, 2, d), v.view(n, 1, d), slots, cos, sin, slots, 1,
                             False)
    assert (ref.v_scales == 1).sum() > n // 3, "vacuous: few rows at scale 1"
    assert torch.equal(fused.v_scales, ref.v_scales)
    assert torch.equal(fused.v_codes, ref.v_codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotation_edge_values_bit_equal(dtype: torch.dtype) -> None:
    """The rotation on random bit patterns of the activation dtype (every finite exponent:
    subnormals, the largest values, products and sums that round half to even or overflow)
    by tables holding 0, 1, -1 and random angles: rotated q/k bit-equal to torch's, both
    pairings, at a head_dim with a partial 16-lane tail (the vector path's masks)."""
    assert kvq_write_available()
    gen = torch.Generator().manual_seed(37)
    d, n, heads = 40, 24, 3
    bits = torch.randint(0, 1 << 16, (n, heads + 1, d), generator=gen, dtype=torch.int32)
    x = bits.to(torch.int16).view(dtype)
    x[~torch.isfinite(x)] = 1.5  # no NaN / inf in: every result is then a number or inf
    ang = torch.rand(n, d // 2, generator=gen) * 6.3
    cos, sin = ang.cos(), ang.sin()
    cos[:3], sin[:3] = torch.tensor([[1.0], [0.0], [-1.0]]), torch.tensor([[0.0], [1.0], [0.0]])
    kv = QuantizedKVCache("int8", "token", num_kv_heads=1, num_blocks=n, block_size=1, head_dim=d)
    pos = torch.arange(n)
    for interleaved in (False, True):
        qk = x[:, :heads].clone()
        want = rotate_like_torch(qk.clone(), cos, sin, pos, interleaved)
        assert kv.rope_write_(qk, x[:, heads:].clone(), pos, cos, sin, pos, heads - 1, interleaved)
        assert torch.equal(qk.view(torch.int16), want.view(torch.int16)), interleaved


@pytest.mark.parametrize("codec", list(CODECS))
def test_small_scale_growth_bit_equal(codec: str) -> None:
    """Per-channel keys: a block's keys then one whose channels grow the block's scales by
    factors on both sides of where a code first moves (int8 127 -> 126 at 1.004, fp8 a code
    one step down at 1.03-1.07) and of the writer's skip bounds: codes and scales bit-equal to
    torch's quantizer, and some earlier codes did move."""
    assert kvq_write_available()
    gen = torch.Generator().manual_seed(5)
    d, bs, rows = 64, 16, 9
    fused, ref = (QuantizedKVCache(codec, "channel-key", num_kv_heads=1, num_blocks=2,
                                   block_size=bs, head_dim=d) for _ in range(2))
    k = torch.randn(rows, d, generator=gen)
    k[0] = k[1:].abs().amax(0) * torch.where(torch.rand(d, generator=gen) < 0.5, -1.0, 1.0)
    grow = torch.tensor([1.0005, 1.002, 1.0034, 1.0036, 1.004, 1.01, 1.02, 1.027, 1.029, 1.031,
                         1.034, 1.05, 1.055, 1.058, 1.07, 1.2])
    k = torch.cat([k, (k[0] * grow.repeat(d // 16)).unsqueeze(0)])
    cos, sin = torch.ones(rows + 1, d // 2), torch.zeros(rows + 1, d // 2)
    before = None
    for t in range(rows + 1):
        qk = k[t].view(1, 1, d).repeat(1, 2, 1).bfloat16()
        v, pos = torch.randn(1, 1, d, generator=gen).bfloat16(), torch.tensor([t])
        if t == rows:
            before = ref.k_codes.clone()
        ref.write(qk[:, 1:].clone(), v, pos)
        assert fused.rope_write_(qk, v, pos, cos, sin, pos, 1, False)
    for name in ("k_codes", "v_codes", "k_scales", "v_scales"):
        assert torch.equal(getattr(fused, name), getattr(ref, name)), name
    assert before is not None and not torch.equal(before[:, 0, :rows], ref.k_codes[:, 0, :rows])


def test_rejects_bad_inputs_with_a_clear_error() -> None:
    kv = QuantizedKVCache("int8", "token", num_kv_heads=HKV, num_blocks=NB, block_size=BS,
                          head_dim=D)
    cos = sin = torch.zeros(8, D // 2)
    qk, v = torch.zeros(1, HQ + HKV, D), torch.zeros(1, HKV, D)
    op = torch.ops.fitserve.rope_write_kvq_
    args = (kv.k_codes, kv.v_codes, kv.k_scales, kv.v_scales)
    with pytest.raises(RuntimeError, match="slot 999 out of range"):
        op(qk, v, torch.tensor([0]), cos, sin, *args, torch.tensor([999]), HQ, False, 0, False)
    with pytest.raises(RuntimeError, match="position 8 out of range"):
        op(qk, v, torch.tensor([8]), cos, sin, *args, torch.tensor([0]), HQ, False, 0, False)
    with pytest.raises(RuntimeError, match="uint8"):
        op(qk, v, torch.tensor([0]), cos, sin, *args, torch.tensor([0]), HQ, False, 1, False)
    with pytest.raises(RuntimeError, match="head counts"):
        op(qk, v, torch.tensor([0]), cos, sin, *args, torch.tensor([0]), HQ + 1, False, 0, False)
    with pytest.raises(RuntimeError, match="k_scales must be"):
        op(qk, v, torch.tensor([0]), cos, sin, *args, torch.tensor([0]), HQ, False, 0, True)


@pytest.mark.parametrize("tier", ["avx2", "scalar"])
def test_tier_is_the_one_asked_for(tier: str) -> None:
    assert asked_tier(tier) == kernel_kvq_isa()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "scalar"])
def test_lower_tier_build_is_bit_equal(tier: str) -> None:
    """Built for a lower tier (other -m flags: no FMA to contract into), still bit-equal."""
    run_tests_at_tier(__file__, tier, f"bit_equal_to_torch or edge_values or small_scale_growth or tier_is_the_one_asked_for and {tier}")
