"""The flash-style prefill op (paged_prefill.h, ``paged_prefill_attention``): against float64
causal attention over the same scattered cache blocks (ragged chunk lengths, a cached prefix,
block and partition boundaries, GQA 1:1 / 4:1 / 8:1, sliding windows, a head_dim with a tail),
and every row bitwise equal to the decode kernel's row for that token (batch invariance). The
plain C++ tile (vectorized=False) and the AVX2 build (a tier subprocess) pass the same checks."""

from __future__ import annotations

import pytest
import torch

from fitserve.kernels.cpu.paged_attention import (
    AMX_MIN_GROUP,
    amx_mode,
    kernel_isa,
    paged_attention_available,
    paged_decode_attention,
    paged_prefill_attention,
    set_amx,
)
from tests.conftest import asked_tier, run_tests_at_tier

if not paged_attention_available():
    pytest.skip("the paged attention C++ extension is unavailable", allow_module_level=True)

# (cached, rows, Hq, Hkv, D, block_size, window, partition)
CASES = [
    (0, 37, 4, 4, 64, 16, None, 256),     # GQA 1:1, a ragged tile (37 = 32 + 5 rows)
    (40, 9, 8, 2, 64, 16, None, 256),     # 4:1 after a cached prefix, inside one block row
    (0, 130, 8, 1, 64, 16, None, 64),     # 8:1, rows across three partitions (merged)
    (21, 75, 6, 2, 80, 32, 16, 32),       # window smaller than a partition, head_dim tail
    (100, 48, 8, 2, 128, 16, 70, 64),     # window starting inside partitions, D = 128
    (63, 66, 9, 3, 64, 16, None, 64),     # prefix ending one key before a partition boundary
]
DTYPES = {  # name -> (cache dtype, q dtype, float64 tolerance)
    "bfloat16": (torch.bfloat16, torch.bfloat16, 2e-2),
    "float32": (torch.float32, torch.float32, 1e-5),
    "bf16-cache-f32-q": (torch.bfloat16, torch.float32, 1e-5),
    "float16": (torch.float16, torch.float16, 5e-3),
}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int, scale: float,
              window: int | None) -> torch.Tensor:
    """float64: row i (position cached + i) sees keys j <= cached + i and, with a window,
    cached + i - j < window; k, v [Hkv, L, D] in position order."""
    t, hq, d = q.shape
    g = hq // k.shape[0]
    pos = torch.arange(cached, cached + t).unsqueeze(1)
    keys = torch.arange(k.shape[1]).unsqueeze(0)
    visible = keys <= pos
    if window is not None:
        visible &= pos - keys < window
    kk = k.double().repeat_interleave(g, dim=0)  # [Hq, L, D]
    vv = v.double().repeat_interleave(g, dim=0)
    s = torch.einsum("thd,hld->htl", q.double(), kk) * scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("htl,hld->thd", p, vv)


def make_case(case: tuple, cache_dtype: torch.dtype, q_dtype: torch.dtype) -> tuple:
    cached, t, hq, hkv, d, bs, window, part = case
    gen = torch.Generator().manual_seed(cached * 131 + t)
    total = cached + t
    nblocks = -(-total // bs)
    order = torch.randperm(nblocks + 3, generator=gen)[:nblocks].to(torch.int32)
    k_cache = torch.randn(hkv, nblocks + 3, bs, d, generator=gen).to(cache_dtype)
    v_cache = torch.randn(hkv, nblocks + 3, bs, d, generator=gen).to(cache_dtype)
    q = torch.randn(t, hq, d, generator=gen).to(q_dtype)
    return q, k_cache, v_cache, order, cached, window, part


def case_inputs(case: tuple, cache_dtype: torch.dtype, q_dtype: torch.dtype) -> tuple:
    """make_case's tensors, the scale, the float64 reference, and the decode call's table / lens
    (one decode row per query)."""
    q, k_cache, v_cache, order, cached, window, part = make_case(case, cache_dtype, q_dtype)
    t, d = q.shape[0], q.shape[2]
    scale = d ** -0.5
    k = k_cache[:, order.long()].reshape(k_cache.shape[0], -1, d)[:, : cached + t]
    v = v_cache[:, order.long()].reshape(v_cache.shape[0], -1, d)[:, : cached + t]
    want = reference(q, k, v, cached, scale, window)
    table = order.unsqueeze(0).expand(t, -1).contiguous()
    lens = torch.arange(cached + 1, cached + t + 1, dtype=torch.int32)
    return q, k_cache, v_cache, order, cached, window, part, scale, want, table, lens


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_matches_float64_and_decode_rows(case: tuple, dtype: str) -> None:
    cache_dtype, q_dtype, tol = DTYPES[dtype]
    q, k_cache, v_cache, order, cached, window, part, scale, want, table, lens = case_inputs(
        case, cache_dtype, q_dtype)
    for vectorized in (True, False):  # the SIMD tiles of this build, and the plain C++ tile
        got = paged_prefill_attention(q, k_cache, v_cache, order, cached, scale, window,
                                      partition_size=part, vectorized=vectorized)
        assert got.dtype == q.dtype and got.shape == q.shape
        assert torch.allclose(got.double(), want, atol=tol, rtol=tol), (vectorized,
                                                                        (got.double() - want).abs().max())
        rows = paged_decode_attention(q, k_cache, v_cache, table, lens, scale, window,
                                      partition_size=part, vectorized=vectorized)
        assert torch.equal(got, rows), "a row differs from the decode kernel's bits"


# Shapes the AMX tile handles in more than one 16-row tile or chunk: G = 20 (two row-head tiles
# in decode), D = 256 (8 chunks of 32, 16 column blocks), D = 96 (an odd block count), D = 48
# (a chunk tail), rows spanning several query tiles and partitions.
AMX_CASES = [
    (5, 40, 40, 2, 64, 16, None, 64),
    (0, 35, 4, 2, 256, 16, None, 256),
    (30, 50, 6, 3, 96, 32, 40, 64),
    (17, 33, 2, 1, 48, 16, None, 256),
]


def _amx_available() -> bool:
    was = amx_mode()
    ok = set_amx("all") == "all"
    set_amx(was)
    return ok


@pytest.mark.skipif(not _amx_available(), reason="no AMX-BF16 attention tile on this CPU / build")
@pytest.mark.parametrize("case", CASES + AMX_CASES, ids=[f"case{i}" for i in range(len(CASES + AMX_CASES))])
def test_amx_tile_matches_float64_decode_rows_and_the_vnni_tile(case: tuple) -> None:
    """bf16 q and cache on the AMX-BF16 tile: float64 within bf16's tolerance, every prefill row
    the decode kernel's bits (both on AMX), and within tolerance of the VDPBF16PS tile. With the
    prefill alone on AMX ("prefill"), decode keeps the default tile's bits; "auto" is "all" for
    a group of AMX_MIN_GROUP heads or more (case 2: 8 per KV head), else "off"."""
    q, k_cache, v_cache, order, cached, window, part, scale, want, table, lens = case_inputs(
        case, torch.bfloat16, torch.bfloat16)
    prefill, decode = {}, {}
    was = amx_mode()
    try:
        for mode in ("all", "off", "prefill", "auto"):
            assert set_amx(mode) == mode
            prefill[mode] = paged_prefill_attention(q, k_cache, v_cache, order, cached, scale,
                                                    window, partition_size=part)
            decode[mode] = paged_decode_attention(q, k_cache, v_cache, table, lens, scale,
                                                  window, partition_size=part)
            err = (prefill[mode].double() - want).abs().max().item()
            assert err < 2e-2, (mode, err)
    finally:
        set_amx(was)
    for mode in ("all", "off"):
        assert torch.equal(prefill[mode], decode[mode]), ("a row differs from the decode bits", mode)
    assert torch.equal(prefill["prefill"], prefill["all"])  # the same tile for the prefill
    assert torch.equal(decode["prefill"], decode["off"])  # decode on the default tile
    # "auto": both ops on the tile from AMX_MIN_GROUP query heads per KV head, else neither
    same = "all" if q.shape[1] // k_cache.shape[0] >= AMX_MIN_GROUP else "off"
    assert torch.equal(prefill["auto"], prefill[same]) and torch.equal(decode["auto"], decode[same])
    assert torch.allclose(prefill["all"].double(), prefill["off"].double(), atol=2e-2, rtol=2e-2)


def test_amx_mode_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="AMX attention mode"):
        set_amx("sometimes")


def test_int64_table_and_empty_chunk() -> None:
    q, k_cache, v_cache, order, cached, window, part = make_case(CASES[1], torch.float32,
                                                                 torch.float32)
    a = paged_prefill_attention(q, k_cache, v_cache, order, cached, 0.125, window)
    b = paged_prefill_attention(q, k_cache, v_cache, order.long(), cached, 0.125, window)
    assert torch.equal(a, b)
    empty = paged_prefill_attention(q[:0], k_cache, v_cache, order, cached, 0.125, window)
    assert empty.shape == (0, *q.shape[1:])


def test_opcheck_and_torch_compile_fullgraph() -> None:
    """The registered fake (shape/dtype) agrees with the kernel, and torch.compile traces
    around the op in one graph."""
    q, k_cache, v_cache, order, cached, window, _ = make_case(CASES[1], torch.float32,
                                                              torch.float32)
    args = (q, k_cache, v_cache, order, cached, 0.125, 0, 256, True)
    torch.library.opcheck(torch.ops.fitserve.paged_prefill_attention.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    torch._dynamo.reset()

    def f(q: torch.Tensor) -> torch.Tensor:
        return paged_prefill_attention(q * 1.0, k_cache, v_cache, order, cached, 0.125) + 0.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q), f(q))


def test_rejects_inputs_that_would_read_outside_the_cache() -> None:
    q, k_cache, v_cache, order, cached, _, _ = make_case(CASES[1], torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="exceeds the block table"):
        paged_prefill_attention(q, k_cache, v_cache, order[:-1], cached, 0.125)
    bad = order.clone()
    bad[0] = k_cache.shape[1]
    with pytest.raises(RuntimeError, match="is not a block of the cache"):
        paged_prefill_attention(q, k_cache, v_cache, bad, cached, 0.125)
    with pytest.raises(RuntimeError, match="one sequence"):
        paged_prefill_attention(q, k_cache, v_cache, order.unsqueeze(0), cached, 0.125)
    with pytest.raises(RuntimeError, match="num_heads must be a multiple"):
        paged_prefill_attention(q[:, :7], k_cache, v_cache, order, cached, 0.125)


def test_tier_is_the_one_asked_for() -> None:
    assert asked_tier() == kernel_isa()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "avx512"])
def test_lower_tier_build_passes_the_reference(tier: str) -> None:
    """The AVX2 tiles, and the AVX-512 ones without AVX512-BF16, built with FITSERVE_CPU_TIER
    on a CPU whose own build runs the bf16-dot tiles, pass the same float64 and decode-row
    checks (the builds are the ones test_paged_attention_cpp.py's tier subprocesses use: same
    source and flags)."""
    run_tests_at_tier(__file__, tier, "tier_is or (matches_float64 and float32)")
