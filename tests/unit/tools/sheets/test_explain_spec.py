"""`plan explain medusa-vs-eagle`, derived by hand.

Llama-3.3-70B: hidden 8192, intermediate 28672, 80 layers, 64 heads / 8 KV heads of 128,
vocab 128256. h100: 3.35e12 B/s, 80e9 B; a100-80gb: 2.039e12 B/s, bf16 312e12.
"""

from __future__ import annotations

import pytest

from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.speed import decode_step
from fitserve.ledger.weights import roofline_weight_bytes
from fitserve.tools.planner.model_source import resolve_model
from fitserve.tools.planner.speculative import verify_step
from fitserve.tools.sheets.sheet import Sheet, build_sheet, run_tool

H, V = 8192, 128256
MEDUSA_PARAMS = 4 * (H * H + H * V)  # 4 x (67,108,864 + 1,050,673,152) = 4,471,128,064
# FC 2h^2 134,217,728 + q,o 2 x 8192 x 8192 + k,v 2 x 8192 x 1024 + MLP 3 x 8192 x 28672
# (= 855,638,016) + the shared lm_head 1,050,673,152
EAGLE_PARAMS = 2 * H * H + (2 * H * H + 2 * H * 1024 + 3 * H * 28672) + H * V
MEDUSA_E = 1 + 0.6 + 0.6 * 0.45 + 0.6 * 0.45 * 0.35 + 0.6 * 0.45 * 0.35 * 0.25  # 1.988125
EAGLE_E = 1 + 0.75 + 0.75 ** 2 + 0.75 ** 3 + 0.75 ** 4  # 3.05078125


def sheet(*argv: str) -> Sheet:
    return build_sheet("explain", ["medusa-vs-eagle", *argv])


def val(s: Sheet, name: str) -> float:
    v = s.line(name).value
    assert isinstance(v, (int, float)), (name, v)
    return float(v)


def test_acceptance_params_and_draft_cost_h100() -> None:
    s = sheet()
    assert MEDUSA_PARAMS == 4_471_128_064 and EAGLE_PARAMS == 2_040_528_896
    assert val(s, "Medusa: expected tokens per round") == pytest.approx(MEDUSA_E)
    assert val(s, "EAGLE: expected tokens per round") == pytest.approx(EAGLE_E)
    assert val(s, "Medusa: params read per draft pass") == MEDUSA_PARAMS
    assert val(s, "EAGLE: params read per draft pass") == EAGLE_PARAMS
    # Medusa: one pass, 8,942,256,128 B / tp 2 / 3.35e12 = 1.33467 ms
    assert val(s, "Medusa: draft time per round at B=1") == pytest.approx(
        MEDUSA_PARAMS * 2 / 2 / 3.35e12)
    # EAGLE: 4 passes x (4,081,057,792 B + 4,096 tokens x 4,096 B draft KV) / 2 / 3.35e12
    assert val(s, "EAGLE: draft time per round at B=1") == pytest.approx(
        4 * (EAGLE_PARAMS * 2 + 4096 * 4096) / 2 / 3.35e12)
    # draft KV: one layer, 2 x 8 x 128 x 2 B = 4,096 B, 1/80 of the target's 327,680 B
    assert val(s, "EAGLE: draft KV per token") == 4096


def _rates(gpu: str, b: int, context: int, *, medusa: tuple[int, int, float] = (
        4, MEDUSA_PARAMS, MEDUSA_E), eagle: tuple[int, float] = (4, EAGLE_E)
           ) -> tuple[float, float, float]:
    """Per-sequence tokens/s (plain, Medusa, EAGLE) from the ledger's roofline, by hand:
    E / (t_verify(k) + passes x max(bytes / bw, B x 2 x params / bf16 peak)), TP 2."""
    spec, hw = resolve_model("Llama-3.3-70B").spec, get_hardware(gpu)
    wb = roofline_weight_bytes(spec, "fp8", tp=2)

    def verify(k: int) -> float:
        return verify_step(spec, hw, wb, batch=b, k=k, context=context, kv_dtype="bf16",
                           weights_fmt="fp8").seconds

    dec = decode_step(spec, hw, wb, batch=b, context=context, kv_dtype="bf16",
                      weights_fmt="fp8").seconds
    mk, mparams, me = medusa
    ek, ee = eagle
    med = max(mparams * 2 / 2 / hw.mem_bytes_per_s, b * 2 * mparams / 2 / hw.bf16_flops)
    eag = ek * max((EAGLE_PARAMS * 2 + b * context * 4096) / 2 / hw.mem_bytes_per_s,
                   b * 2 * EAGLE_PARAMS / 2 / hw.bf16_flops)
    return 1 / dec, me / (verify(mk) + med), ee / (verify(ek) + eag)


def test_long_eagle_chain_loses_to_two_strong_heads_past_batch_46() -> None:
    s = sheet("--draft-k", "8", "--heads-accept", "0.8,0.7", "--context", "512")
    # Medusa: 2 heads, E = 1 + 0.8 + 0.56 = 2.36, 2 x (h^2 + h V) params; EAGLE k = 8:
    # E = (1 - 0.75^9) / 0.25 = 3.6997. Verifying 9 positions costs ~9 decode steps once
    # compute-bound, 3 for Medusa: E / (k + 1) = 0.411 vs 0.787
    med = (2, 2 * (H * H + H * V), 2.36)
    eag = (8, (1 - 0.75 ** 9) / 0.25)
    assert val(s, "EAGLE: tokens per verified position") == pytest.approx(eag[1] / 9)
    assert val(s, "Medusa: tokens per verified position") == pytest.approx(2.36 / 3)
    before = _rates("h100", 45, 512, medusa=med, eagle=eag)
    at = _rates("h100", 46, 512, medusa=med, eagle=eag)
    assert before[2] > before[1] and at[1] > at[2]
    assert s.data["drafter_flips"] == [[46, "EAGLE", "Medusa"]]


@pytest.mark.parametrize(("gpu", "stop_medusa", "stop_eagle"), [
    ("h100", 150, 297), ("a100-80gb", 33, 53)])
def test_batch_where_each_stops_paying(gpu: str, stop_medusa: int, stop_eagle: int) -> None:
    s = sheet("--gpu", gpu, "--context", "512")
    plain, med, eag = _rates(gpu, 1, 512)
    assert val(s, "batch 1") == pytest.approx(eag)  # EAGLE wins at B=1: E 3.05 vs 1.99
    assert eag > med > plain
    assert s.data["stops_paying"] == {"Medusa": stop_medusa, "EAGLE": stop_eagle}
    for name, b, idx in (("Medusa", stop_medusa, 1), ("EAGLE", stop_eagle, 2)):
        before, at = _rates(gpu, b - 1, 512), _rates(gpu, b, 512)
        assert before[idx] >= before[0] and at[idx] < at[0], name
    # the winner goes from EAGLE straight to plain decode where EAGLE stops paying: EAGLE's
    # E / (k + 1) = 0.61 beats Medusa's 0.40 once verification is compute-bound
    assert s.data["flips"] == [[stop_eagle, "EAGLE", "plain decode"]]
    # (80e9 - fp8 weights / 2 - (Medusa 4.47e9 + EAGLE own 0.99e9) x 2 B / 2) / KV per seq
    # (512 x 327,680 / 2 = 83,886,080 B + 2 x 512 x 4,096 / 2 B) = 449 on both 80 GB cards
    assert s.data["fit_batch"] == 449
    assert bool(s.warnings) == (gpu == "a100-80gb")  # no fp8 tensor cores: weight-only fp8


def test_short_eagle_chain_or_weak_heads_change_the_answer() -> None:
    s = sheet("--heads-accept", "0.9,0.8", "--draft-accept", "0.5", "--draft-k", "2")
    # Medusa 1 + 0.9 + 0.72 = 2.62 beats EAGLE 1 + 0.5 + 0.25 = 1.75
    assert val(s, "Medusa: expected tokens per round") == pytest.approx(2.62)
    assert val(s, "EAGLE: expected tokens per round") == pytest.approx(1.75)
    assert str(s.line("batch 1").shown).startswith("Medusa")


@pytest.mark.parametrize(("argv", "needle"), [
    (("--heads-accept", "0.6,x"), "--heads-accept: cannot read"),
    (("--heads-accept", "0.6,1.5"), "must be in (0, 1]"),
    (("--draft-accept", "1.5"), "--draft-accept must be > 0 and <= 1"),
    (("--draft-k", "0"), "--draft-k must be in [1, 16]"),
])
def test_bad_input_names_the_flag(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                  needle: str) -> None:
    assert run_tool("explain", ["medusa-vs-eagle", *argv]) == 2
    assert needle in capsys.readouterr().err
