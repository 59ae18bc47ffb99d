"""`plan explain gqa-packing | tma-wgmma | paged-indirection`, derived by hand.

H100: 132 SMs, 4,096 tensor FLOPs/clk/SM, 3.35e12 B/s, bf16 989.4e12; A100-80GB: 108 SMs,
2,048 FLOPs/clk/SM, 2.039e12 B/s, 312e12; H200 4.8e12 B/s. DRAM latency 600 ns.
"""

from __future__ import annotations

import pytest

from fitserve.tools.sheets.sheet import Sheet, build_sheet


def sheet(*argv: str) -> Sheet:
    return build_sheet("explain", list(argv))


def val(s: Sheet, name: str) -> float:
    v = s.line(name).value
    assert isinstance(v, (int, float)), (name, v)
    return float(v)


def test_gqa_packing_h100_and_a100() -> None:
    # Llama-3.1-8B group 32 / 8 = 4; wgmma M 64: 4 x 1 / 64 = 6.25% (1 / 64 unpacked)
    h = sheet("gqa-packing")
    assert val(h, "q_len 1: packed utilisation") == pytest.approx(4 / 64)
    assert val(h, "q_len 1: one head per MMA") == pytest.approx(1 / 64)
    # 2 x 2 x 4 x 128 FLOPs per 2 x 128 x 2 B = 8 FLOP/B, far below 989.4e12 / 3.35e12 = 295
    assert val(h, "q_len 1: FLOPs per KV byte") == 8
    # Llama-3.3-70B group 8 on A100 (mma.sync M 16): 8 / 16 = 50%; q_len 5 (4 drafts + 1):
    # 40 rows >= 16: 100%; one head alone 5 / 16 = 31.25%
    a = sheet("gqa-packing", "--gpu", "a100-80gb", "--model", "Llama-3.3-70B", "--q-len", "5")
    assert val(a, "q_len 1: packed utilisation") == pytest.approx(0.5)
    assert val(a, "q_len 5: packed utilisation") == 1.0
    assert val(a, "q_len 5: one head per MMA") == pytest.approx(5 / 16)
    # on H100 the same 40 rows fill 40 / 64 = 62.5% of a wgmma
    h5 = sheet("gqa-packing", "--model", "Llama-3.3-70B", "--q-len", "5")
    assert h5.data["utilisation"] == pytest.approx(40 / 64)


def test_tma_wgmma_counts() -> None:
    h = sheet("tma-wgmma")
    # K 4096 / BK 64 = 64 k-steps; A + B = (128 + 128) x 64 x 2 B = 32 KiB -> 2,048 cp.async
    assert val(h, "k-steps over K") == 64
    assert val(h, "cp.async (16 B) per k-step") == 2048
    # wgmma m64n128k16: 128 / 64 rows x 64 / 16 = 8; mma.sync: 8 x 16 x 4 = 512
    assert val(h, "wgmma per k-step") == 8
    assert val(h, "mma.sync m16n8k16 per k-step") == 512
    # 2 x 64 x 128 x 16 = 262,144 FLOPs / 4,096 per clock = 64 clocks
    assert val(h, "clocks per wgmma (one SM)") == 64
    # a 128 x 256 tile: one m64n256k16 covers both column halves: 2 x 4 x 1 = 8 still
    wide = sheet("tma-wgmma", "--tile", "128x256")
    assert val(wide, "wgmma per k-step") == 8 and val(wide, "mma.sync m16n8k16 per k-step") == 1024
    a = sheet("tma-wgmma", "--gpu", "a100-80gb")
    assert a.warnings and "no TMA or wgmma" in a.warnings[0]
    assert val(a, "clocks per wgmma (one SM)") == 128  # 262,144 / 2,048


def test_paged_indirection_h100_and_h200() -> None:
    h = sheet("paged-indirection")
    # tile 64 over blocks of 16: 4 blocks, 4 table loads, 2 x 4 TMA boxes of 16 x 128 x 2 B
    assert val(h, "blocks per KV tile") == 4
    assert val(h, "TMA boxes per tile (K and V)") == 8
    # K + V of one head: 2 x 64 x 128 x 2 = 32,768 B at 3.35e12 / 132 B/s per SM = 1,291 ns;
    # table then data: ceil(1200 / 1291) + 1 = 2 tiles in flight
    assert val(h, "tile stream time per SM") == pytest.approx(32768 * 132 / 3.35e12)
    assert val(h, "stages to hide table + data latency") == 2
    # table 4 x 8192 / 16 = 2,048 B vs KV 32 x 2 x 8 x 128 x 2 x 8192 = 1 GiB
    assert val(h, "block table per sequence vs its KV") == pytest.approx(2048 / 2**30)
    # block 1 (token-level) on H200: 64 lookups, 128 boxes of 256 B; 32,768 / (4.8e12 / 132)
    # = 901 ns -> ceil(1200 / 901) + 1 = 3 stages
    t = sheet("paged-indirection", "--block-size", "1", "--gpu", "h200")
    assert val(t, "dependent loads per tile") == 64
    assert val(t, "stages to hide table + data latency") == 3
    # a block of 48 does not divide a 64 tile: a tile can straddle ceil(64/48) + 1 = 3 blocks
    assert val(sheet("paged-indirection", "--block-size", "48"), "blocks per KV tile") == 3
