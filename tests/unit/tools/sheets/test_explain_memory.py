"""`plan explain fa-l2-reuse | gemv-coalescing | smem-swizzle`, derived by hand.

L2: H100 50 MiB (132 SMs), A100 40 MiB (108 SMs). Llama-3.1-8B: 32 / 8 heads of 128, hidden
4096; Llama-3.3-70B: 64 / 8 heads of 128, hidden 8192.
"""

from __future__ import annotations

import pytest

from fitserve.tools.sheets.sheet import Sheet, build_sheet

MIB = 2**20


def sheet(*argv: str) -> Sheet:
    return build_sheet("explain", list(argv))


def val(s: Sheet, name: str) -> float:
    v = s.line(name).value
    assert isinstance(v, (int, float)), (name, v)
    return float(v)


def test_fa_io_at_8k_naive_textbook_and_l2_h100() -> None:
    s = sheet("fa-l2-reuse")
    u = 8192 * 128 * 2  # 2 MiB
    # naive: 4U + S, P written and read: 4 x 8192^2 x 2 B = 512 MiB -> 520 MiB
    assert val(s, "naive attention per head") == 520 * MIB
    # textbook: Q + O + 64 query tiles x (K + V) = 2U + 128U = 260 MiB: only 2x below naive
    assert val(s, "textbook FlashAttention per head") == 260 * MIB
    # L2: each of Q, K, V, O once = 8 MiB: 65x below naive
    assert val(s, "with L2 reuse per head") == 4 * u
    assert s.data["naive_over_reuse"] == pytest.approx(65.0)
    assert s.data["naive_over_textbook"] == pytest.approx(2.0)
    # wave: 132 CTAs over 64 tiles per head -> ceil(2.06) + 1 = 4 query heads, group 4 ->
    # ceil(3/4) + 1 = 2 KV heads x 2 x 2 MiB = 8 MiB, + 132 x (Q, O) 2 x 128 x 128 x 2 B
    # = 8.25 MiB -> 16.25 MiB < 50 MiB
    assert val(s, "query heads per wave") == 4
    assert val(s, "L2 working set per wave") == 8 * MIB + 132 * 65536
    # the layer: 32 query heads x (Q, O) + 8 KV heads x (K, V) = 64U + 16U = 160 MiB
    assert val(s, "HBM bytes per layer (batch 1)") == 160 * MIB


def test_fa_spill_context_h100_and_a100() -> None:
    # past 64 x 132 tokens a wave lies within 2 query heads -> at most 2 KV heads:
    # 2 x 2 x N x 128 x 2 B + SMs x 64 KiB > L2
    # h100: 1024 N > 50 MiB - 8.25 MiB = 43,778,048 -> N > 42,752 -> first multiple of
    # 128 past it is 42,880; a100: 1024 N > 40 MiB - 6.75 MiB -> N > 34,048 -> 34,176
    h100 = sheet("fa-l2-reuse", "--model", "Llama-3.3-70B")
    a100 = sheet("fa-l2-reuse", "--model", "Llama-3.3-70B", "--gpu", "a100-80gb")
    assert h100.data["spill_context"] == 42_880
    assert a100.data["spill_context"] == 34_176
    # 70B: 64 q + 8 KV heads x 2U = 144U = 288 MiB per layer on either card
    assert val(a100, "HBM bytes per layer (batch 1)") == 288 * MIB


def test_fa_spilled_context_falls_back_to_textbook() -> None:
    s = sheet("fa-l2-reuse", "--context", "64k")
    # 65,536 x 128 x 2 = 16 MiB = U; Tr 512: textbook 2U + 1024U = 1026U per query head
    u = 65536 * 256
    assert val(s, "HBM bytes per layer (batch 1)") == 32 * 1026 * u


def test_gemv_coalescing_sectors() -> None:
    s = sheet("gemv-coalescing")
    # warp per row, 16-B vectors: 512 contiguous B = 16 sectors, all useful
    assert val(s, "row-major, warp per row, bf16 x8 (16-B vector)") == 1.0
    # thread per row: lanes 4096 x 2 B apart, one sector each for 2 B: 64 / 1024 = 1/16
    assert val(s, "row-major, thread per row, bf16 scalar") == pytest.approx(1 / 16)
    # int4 packed 8 per int32: 4 useful B per 32-B sector = 1/8
    assert val(s, "row-major, thread per row, int4 x8 (int32)") == pytest.approx(1 / 8)
    assert val(s, "column-major, thread per row, bf16 scalar") == 1.0


def test_smem_bank_conflicts() -> None:
    s = sheet("smem-swizzle", "--gpu", "a100-80gb")
    # fp32 [32][32]: word i x 32 -> bank 0 for every lane: 32-way; [32][33]: bank i: 1-way
    assert val(s, "fp32 [32][32], column read") == 32
    assert val(s, "fp32 [32][33] (1-word pad), column read") == 1
    # 16-B vectors, 8 lanes per phase; 128-B rows put chunk 0 of every row in banks 0-3: 8-way
    assert val(s, "bf16 [32][64] 16-B vectors, chunk-column read") == 8
    assert val(s, "bf16 [32][72] (16-B pad), chunk-column read") == 1  # +16/128 = 12.5%
    assert val(s, "bf16 [32][64] XOR swizzle chunk ^ (row % 8)") == 1
    assert "12.5%" in s.line("bf16 [32][72] (16-B pad), chunk-column read").shown


def test_gemv_lines_per_warp_load() -> None:
    s = sheet("gemv-coalescing")
    # 512 contiguous bytes: 16 sectors in 4 lines; 32 lanes 8 KiB apart: 32 sectors, 32 lines
    assert "16 sectors in 4 x 128-B lines" in s.line(
        "row-major, warp per row, bf16 x8 (16-B vector)").shown
    assert "32 sectors in 32 x 128-B lines" in s.line(
        "row-major, thread per row, bf16 scalar").shown
