"""The M > 1 weight layout made once at load (qlinear_prepack.h, ``qlinear.prepack``): the
panel kernels read it instead of packing panels per call, with the same bits, within the
float64 bound, on ragged N (a tail of N % lanes rows packed per call) and K tails, at every
ISA tier; the registration lapses when a tensor is freed or written in place."""

from __future__ import annotations

import pytest
import torch

from fitserve.kernels.cpu.qlinear import (
    int4_linear,
    int8_linear,
    is_prepacked,
    prepack,
    qlinear_ops_available,
    qlinear_tier,
)
from tests.conftest import asked_tier, run_tests_at_tier

if not qlinear_ops_available():
    pytest.skip("the qlinear C++ extension could not be built here", allow_module_level=True)

from tests.kernels.test_qlinear_cpp import (  # noqa: E402
    act_quant_bound,
    check,
    int4_offsets64,
    make_int4,
    make_int8,
    make_x,
)

N, K = 37, 340  # N: 2 full panels of 16 (4 of 8 on avx2) + a tail; K: padded to the group
KINDS = ["int4-asym-g32", "int4-sym-g32", "int4-asym-g64", "int4-sym-g128", "int8-g32",
         "int8-g64", "int8-channel"]


def make(kind: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    """(tensors (qweight, scales, mins), group, run(x, tensors) -> y, w64, offsets64)."""
    if kind.startswith("int4"):
        g = int(kind.split("-g")[1])
        qw, sc, mn, w64 = make_int4(N, K, g, "asym" in kind, gen)
        return ((qw, sc, mn), g, lambda x, t: int4_linear(x, t[0], t[1], t[2], g, True), w64,
                int4_offsets64(sc, mn, g))
    q8, s8, g, w64 = make_int8(N, K, None if kind == "int8-channel" else int(kind.split("-g")[1]),
                               gen)
    return (q8, s8, None), g, lambda x, t: int8_linear(x, t[0], t[1], g, True), w64, None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", KINDS)
def test_prepacked_matches_per_call_and_float64(kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    plain, g, run, w64, off64 = make(kind, gen)
    packed = tuple(None if t is None else t.clone() for t in plain)
    blob = prepack(packed[0], packed[1], packed[2], g)
    assert blob.dtype == torch.uint8
    groups, int4 = packed[1].shape[1], kind.startswith("int4")
    assert blob.numel() == N * (packed[0].shape[1] + groups * 4 * (2 if int4 else 1))
    assert is_prepacked(packed[0], packed[1], packed[2], g)
    assert not is_prepacked(plain[0], plain[1], plain[2], g)
    for m in (2, 17, 300):
        x = make_x(m, K, w64.shape[1], dtype, gen)
        y = run(x, packed)
        assert torch.equal(y, run(x, plain)), f"{kind} M={m}: prepacked != packed per call"
        x64 = x.double()
        y64 = x64 @ w64.T
        check(y, y64, act_quant_bound(x64, w64, y64, dtype, off64), act_quant=True)
        alone = torch.cat([run(x[r:r + 1], packed) for r in (0, m - 1)])
        assert torch.equal(y[[0, m - 1]], alone), f"{kind} M={m}: rows differ from the row alone"


def test_registration_lapses_when_written_in_place_or_freed() -> None:
    gen = torch.Generator().manual_seed(6)
    (qw, sc, mn), g, run, w64, _ = make("int4-asym-g32", gen)
    blob = prepack(qw, sc, mn, g)
    x = make_x(8, K, w64.shape[1], torch.float32, gen)
    qw.copy_(torch.flip(qw, [0]))  # load_state_dict-style write: the panels are stale now
    assert not is_prepacked(qw, sc, mn, g)
    fresh = (qw.clone(), sc.clone(), mn.clone() if mn is not None else None)
    assert torch.equal(run(x, (qw, sc, mn)), run(x, fresh))
    blob = prepack(qw, sc, mn, g)
    assert is_prepacked(qw, sc, mn, g)
    assert not is_prepacked(qw, sc.clone(), mn, g)  # other scales: not this weight's panels
    del blob
    assert not is_prepacked(qw, sc, mn, g)


def test_bad_arguments_raise() -> None:
    q = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="scales"):
        prepack(q, torch.zeros(4, 2, dtype=torch.float32), None, 32)


def test_tier_is_the_one_asked_for() -> None:
    assert asked_tier() == qlinear_tier()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "scalar", "avx512"])
def test_lower_tiers_prepacked(tier: str) -> None:
    """The AVX2, AVX-512 (no VNNI) and scalar panels, built with FITSERVE_CPU_TIER."""
    run_tests_at_tier(__file__, tier, "tier_is or (prepacked_matches and not bf16) or lapses")


def test_packed_linear_prepack_is_used_and_counted() -> None:
    from fitserve.model.linear import PackedLinear, panels_apply
    from fitserve.quant.packed import pack

    gen = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (40, 64), generator=gen)
    sc = torch.rand(40, 2, generator=gen) * 0.01 + 0.001
    lin = PackedLinear(pack("int4", q, sc, -8 * sc, 32, 64))
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    before = lin(x)
    assert lin.prepack() and lin.panels is not None
    assert lin.panels.numel() == 40 * (32 + 2 * 8)  # codes + fp32 scales and offsets per row
    assert is_prepacked(lin.qweight, lin.scales, lin.mins, 32)
    assert torch.equal(lin(x), before)
    assert "panels" not in lin.state_dict()  # derived, never saved
    assert panels_apply("layers.0.self_attn.qkv_proj") and not panels_apply("lm_head")
    assert not panels_apply("layers.1.mlp.experts.3.down_proj")


def test_prepack_off_keeps_one_copy_and_the_ledger_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from fitserve.ledger.weights import EngineTensor, held_bytes, panel_bytes
    from fitserve.model.linear import PackedLinear, holds_panels, prepack_linears
    from fitserve.quant.packed import pack

    q = torch.randint(0, 16, (16, 64))
    model = nn.ModuleDict({"proj": PackedLinear(pack("int4", q, torch.full((16, 2), 0.01),
                                                     None, 32, 64))})
    monkeypatch.delenv("FITSERVE_PREPACK_PANELS", raising=False)  # the default: one copy
    assert prepack_linears(model) == 0 and not holds_panels(model)
    monkeypatch.setenv("FITSERVE_PREPACK_PANELS", "1")
    assert prepack_linears(model) == 1 and holds_panels(model)
    t = EngineTensor("model.layers.0.self_attn.q_proj.weight", (16, 64), "int4-g32-sym")
    panels = model["proj"].panels
    assert panels is not None and panel_bytes(t) == panels.numel()
    assert held_bytes([t], panels=False) + panel_bytes(t) == held_bytes([t], panels=True)
    assert panel_bytes(EngineTensor("lm_head.weight", (16, 64), "int4-g32-sym")) == 0
