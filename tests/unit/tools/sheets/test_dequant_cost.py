"""K-quant dequant cost in `plan explain llamacpp-vs-vllm`, `q4km-cost` and `w4a16-crossover`
(issue 42, item 4), derived by hand.

Per weight and step, bf16 takes max(2 / BW, 2b / P); a 4-bit file max(bits / 8 / BW,
2b / P + D / I), D the dequant instructions per weight (plan explain int4-dequant's magic-number
count, 9/8 + 1/2 = 1.625 for int4; Q4_K adds 8/32 for its 6-bit sub-block scales and mins:
1.875), I the device's issue rate. On sm90/sm80 the issue rate is 128 per clock per SM and the
tensor cores do 4,096 / 2,048 FLOPs per clock per SM, so I = P / 32 (H100) or P / 16 (A100),
and one dequant instruction costs P / (2 I) = 16 (H100) or 8 (A100) batch rows of MMA.

The 4-bit GEMM stops paying (speedup < 1.05) at b* = P / (BW x 1.05) - D x P / (2 I):
    H100 (P 989.4e12, BW 3.35e12):  281.28 - 1.875 x 16 = 251.28 -> batch 252 (was 282)
    A100-80GB (312e12, 2.039e12):   145.73 - 1.875 x 8  = 130.73 -> batch 131 (was 146)
The model does not enter: Llama-3.1-8B and Qwen2.5-7B in Q4_K cross at the same batch.
"""

from __future__ import annotations

import pytest

from fitserve.ledger.hardware import get_hardware
from fitserve.tools.sheets.dequant_cost import DEQUANT_INSTR, issue_rate
from fitserve.tools.sheets.sheet import Sheet, build_sheet


def sheet(*argv: str) -> Sheet:
    return build_sheet("explain", list(argv))


def value(s: Sheet, name: str) -> float:
    v = s.line(name).value
    assert isinstance(v, (int, float)), (name, v)
    return float(v)


def test_dequant_counts_and_issue_rate() -> None:
    assert DEQUANT_INSTR["int4"] == 9 / 8 + 1 / 2
    assert DEQUANT_INSTR["Q4_K"] == 9 / 8 + 1 / 2 + 8 / 32 == 1.875
    h100, a100 = get_hardware("h100"), get_hardware("a100-80gb")
    assert issue_rate(h100) == pytest.approx(989.4e12 / 32)   # 128 / 4,096 of the tensor rate
    assert issue_rate(a100) == pytest.approx(312e12 / 16)     # 128 / 2,048
    assert issue_rate(get_hardware("mi300x")) is None          # no SM table: dequant left out


@pytest.mark.parametrize("gpu,stop,rows", [("h100", 252, 16), ("a100-80gb", 131, 8)])
@pytest.mark.parametrize("model", ["Llama-3.1-8B", "Qwen2.5-7B"])
def test_q4k_stops_paying_at_one_batch_per_accelerator(gpu: str, stop: int, rows: int,
                                                      model: str) -> None:
    hw = get_hardware(gpu)
    ridge = hw.bf16_flops / (hw.mem_bytes_per_s * 1.05)
    b_star = ridge - 1.875 * rows
    assert stop == int(b_star) + 1   # the first integer batch past b*
    # Q4_K alone, through the crossover sheet, whose per-weight answer has no model in it
    x = sheet("w4a16-crossover", "--gpu", gpu, "--model", model, "--weights", "Q4_K")
    assert value(x, "one dequant instruction = MMA rows") == pytest.approx(rows)
    assert value(x, "Q4_K dequant per weight") == pytest.approx(1.875)
    assert value(x, "Q4_K GEMMs stop paying (< x1.05), dequant included") == stop
    # without the dequant the same sheet says int(ridge) + 1 (282 on H100, 146 on A100)
    assert value(x, "GEMM stops paying (speedup < x1.05)") == int(ridge) + 1


def test_q4km_cost_prints_the_crossover() -> None:
    # Llama-3.1-8B Q4_K_M: the GEMM weights (embedding, a lookup, left out) are Q4_K (D 1.875)
    # and Q6_K (D 1.625 + 4/8 + 1/16 = 2.1875) for lm_head, 16 attn_v and 16 ffn_down:
    #   Q6_K params: lm_head 525,336,576 + 16 x 4,194,304 + 16 x 58,720,256 = 1,531,969,536
    #   Q4_K params: 32 x (16,777,216 + 4,194,304 + 16,777,216 + 2 x 58,720,256)
    #                + 16 x 4,194,304 + 16 x 58,720,256 = 5,972,688,896
    q6, q4 = 1_531_969_536, 5_972_688_896
    d = (q6 * 2.1875 + q4 * 1.875) / (q6 + q4)
    s = sheet("q4km-cost")
    assert value(s, "Q4_K_M dequant per weight") == pytest.approx(d)
    b_star = 989.4e12 / (3.35e12 * 1.05) - d * 16          # 281.28 - 31.02 = 250.26
    assert value(s, "Q4_K_M GEMMs stop paying (< x1.05), dequant included") == int(b_star) + 1
    assert "stop paying against bf16 from batch 251" in s.verdict


def test_llamacpp_vs_vllm_batch_256_no_longer_pays() -> None:
    # Llama-3.1-8B, H100, 256 users at 1,024 tokens, kernel by kernel:
    #   attention (either file): 256 x 134,217,728 B bf16 KV / 3.35e12 = 10.2570 ms
    #   bf16 GEMMs: max(16,060,522,496 / 3.35e12 = 4.7942 ms, 256 x 15,009,316,864 / 989.4e12
    #               = 3.8835 ms) = 4.7942 ms  -> 15.0512 ms: 17,009 tok/s (as before)
    #   Q4_K_M GEMMs: max(4,912,898,048 / 3.35e12 = 1.4665 ms, 3.8835 ms + D_step / I) with
    #               D_step = 1,531,969,536 x 2.1875 + 5,972,688,896 x 1.875 = 14,549,975,040
    #               / 30.91875e12 = 0.47059 ms -> 4.3541 ms  -> 14.6111 ms: 17,521 tok/s
    # old sheet: one whole-step max() with no dequant, 21,837 tok/s (x1.28)
    kv = 256 * 134_217_728 / 3.35e12
    t16 = max(16_060_522_496 / 3.35e12, 256 * 15_009_316_864 / 989.4e12) + kv
    d_step = 1_531_969_536 * 2.1875 + 5_972_688_896 * 1.875
    tq = max(4_912_898_048 / 3.35e12, 256 * 15_009_316_864 / 989.4e12
             + d_step / (989.4e12 / 32)) + kv
    s = sheet("llamacpp-vs-vllm")
    assert value(s, "bf16 at batch 256") == pytest.approx(256 / t16, rel=1e-9)
    assert value(s, "Q4_K_M at batch 256") == pytest.approx(256 / tq, rel=1e-9)
    assert value(s, "Q4_K_M / bf16 at batch 256") == pytest.approx(t16 / tq, rel=1e-9)
    assert t16 / tq < 1.05 and "no longer pays" in s.verdict
    # on an A100 the Q4_K_M GEMMs are slower than bf16's at batch 256 (past both ridges)
    a = sheet("llamacpp-vs-vllm", "--gpu", "a100-80gb")
    assert value(a, "Q4_K_M / bf16 at batch 256") < 1.0
