"""`fitserve plan explain TOPIC`: every sheet's numbers derived by hand from the catalog.

Catalog figures used below (fitserve/ledger/catalog/gpus.json, models.json):
  h100      3.35e12 B/s, bf16 989.4e12, fp8 1978.9e12, 80e9 B
  h200      4.8e12 B/s,  bf16 989.4e12,                141e9 B
  a100-80gb 2.039e12 B/s, a100-40gb 1.555e12 B/s, bf16 312e12
  b200      8e12 B/s, bf16 2.25e15
SM table (explain_micro): h100/h200 132 SMs x 4,096 tensor FLOPs/clk, a100 108 x 2,048,
b200 148 x 8,192; MUFU and converts 16/clk/SM, LOP3 64, issue 128; DRAM latency 600 ns.
Llama-3.1-8B: hidden 4096, intermediate 14336, 32 layers, 32 heads / 8 KV heads of 128,
vocab 128256 (untied); 8,030,261,248 parameters, 7,504,658,432 of them in matmuls.
SmolLM2-135M: hidden 576, intermediate 1536, 30 layers, 9 / 3 heads of 64, vocab 49152 tied.
"""

from __future__ import annotations

import json
import math

import pytest

from fitserve.ledger.hardware import get_hardware
from fitserve.tools.sheets.explain import TOPICS
from fitserve.tools.sheets.explain_quant import gemm_speedup
from fitserve.tools.sheets.sheet import Sheet, build_sheet, run_tool


def sheet(*argv: str) -> Sheet:
    return build_sheet("explain", list(argv))


def value(s: Sheet, name: str) -> float:
    v = s.line(name).value
    assert isinstance(v, (int, float)), (name, v)
    return float(v)


def rc_and_err(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        rc = run_tool("explain", list(argv))
    except SystemExit as e:  # argparse: bad choice / bad type
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


# -- the dispatcher -------------------------------------------------------------------------

def test_no_topic_and_list_show_every_topic() -> None:
    for argv in ((), ("--list",)):
        s = sheet(*argv)
        assert [ln.name for ln in s.sections[0].lines] == list(TOPICS)
        assert s.data["topics"] == list(TOPICS)
    assert len(TOPICS) == 18


def test_unknown_topic_is_exit_2_listing_topics(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = rc_and_err(capsys, "gemv-little")
    assert rc == 2
    assert "invalid choice" in err
    for name in TOPICS:
        assert name in err


@pytest.mark.parametrize(("argv", "needle"), [
    (("fa2-vs-fa3", "--gpu", "h1000"), "unknown GPU"),
    (("gemv-littles-law", "--gpu", "mi300x"), "no SM-level data for 'mi300x'"),
    (("int4-dequant", "--value", "16"), "--value must be in [0, 15], got 16"),
    (("int4-dequant", "--weights", "bf16"), "needs a 4-bit integer format"),
    (("fa2-vs-fa3", "--tile", "100x128"), "multiples of 16"),
    (("fa2-vs-fa3", "--tile", "128"), "write BRxBC"),
    (("gemv-littles-law", "--latency-ns", "-5"), "--latency-ns must be > 0"),
    (("llamacpp-vs-vllm", "--batch", "0"), "--batch must be >= 1, got 0"),
    (("qat-vs-ptq", "--mfu", "1.5"), "--mfu must be > 0 and <= 1"),
    (("qat-vs-ptq", "--model", "Mistral-7B-v0.1"), "no published pretraining token count"),
    (("w4a16-crossover", "--weights", "f32"), "not smaller than bf16"),
    (("w4a16-crossover", "--context", "12q"), "--context: cannot read token count"),
    (("q4km-cost", "--weights", "int4-g128"), "prices a llama.cpp mix"),
    (("q4km-cost", "--batch", "8"), "--batch does not apply to q4km-cost"),
    (("gemv-littles-law", "--model", "nosuch-model"), "unknown model"),
])
def test_bad_input_is_exit_2_naming_it(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                       needle: str) -> None:
    rc, err = rc_and_err(capsys, *argv)
    assert rc == 2
    assert needle in err


def test_non_numeric_flag_is_argparse_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = rc_and_err(capsys, "fa2-vs-fa3", "--head-dim", "abc")
    assert rc == 2 and "--head-dim" in err and "invalid int value" in err


@pytest.mark.parametrize("topic", list(TOPICS))
def test_every_line_has_formula_and_arithmetic(topic: str) -> None:
    s = sheet(topic)
    assert s.verdict and s.sections
    names = [ln.name for sec in s.sections for ln in sec.lines]
    assert len(names) == len(set(names)), topic  # Sheet.line(name) finds each one
    for sec in s.sections:
        for ln in sec.lines:
            assert ln.formula and ln.explain and ln.shown, (topic, ln.name)


def test_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("explain", ["int4-dequant", "--gpu", "h200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    lines = {ln["name"]: ln for sec in out["sections"] for ln in sec["lines"]}
    # h200: 989.4e12 x 4.15625 / (256 x 4.8e12) = 3.34651 instructions per weight
    assert lines["budget: instructions per weight"]["value"] == pytest.approx(3.346512, rel=1e-6)
    assert out["data"]["naive_fraction"] == pytest.approx(3.346512 / 8 / 2, rel=1e-6)


# -- gemv-littles-law -----------------------------------------------------------------------

def test_gemv_littles_law_h100_llama() -> None:
    s = sheet("gemv-littles-law")
    # 3.35e12 B/s x 600e-9 s = 2,010,000 B in flight; / 132 SMs = 15,227.3 B per SM
    assert value(s, "bytes in flight (whole GPU)") == pytest.approx(2_010_000)
    assert value(s, "bytes in flight per SM") == pytest.approx(2_010_000 / 132)
    # 15,227.3 / 16 B = 951.7 loads; / 2,048 threads = 0.4647
    assert value(s, "16-B loads in flight per SM") == pytest.approx(951.70, abs=0.01)
    assert value(s, "16-B loads in flight per thread") == pytest.approx(0.46470, abs=1e-4)
    # 90% of bandwidth needs S = 2,010,000 x 0.9 / 0.1 = 18,090,000 B
    assert value(s, "matrix size for 90.0% of bandwidth") == pytest.approx(18_090_000)
    # attn_k: 1024 x 4096 x 2 B = 8,388,608 B; 8,388,608 / (8,388,608 + 2,010,000) = 0.80670
    assert value(s, "attn_k 1024x4096") == pytest.approx(0.806705, abs=1e-6)
    # q, k, v fused: (4096 + 1024 + 1024) x 4096 x 2 = 50,331,648 B -> 0.96161
    assert value(s, "attn_qkv (fused) 6144x4096") == pytest.approx(
        50_331_648 / (50_331_648 + 2_010_000))
    # one kernel per matrix: 1 lm_head + 7 x 32 = 225 GEMVs, 2 x 7,504,658,432 B:
    # t = 225 x 600 ns + 15,009,316,864 / 3.35e12 = 0.135 ms + 4.48039 ms; 4.48039 / 4.61539
    assert value(s, "decode step, one kernel per matrix") == pytest.approx(0.970750, abs=1e-5)
    assert s.data["small_gemvs"] == []


def test_gemv_gpu_latency_and_format_change_the_answer() -> None:
    h200 = sheet("gemv-littles-law", "--gpu", "h200")
    # 4.8e12 x 600e-9 = 2,880,000 B; / 132 = 21,818.2
    assert value(h200, "bytes in flight per SM") == pytest.approx(2_880_000 / 132)
    assert value(h200, "attn_k 1024x4096") == pytest.approx(8_388_608 / (8_388_608 + 2_880_000))
    slow = sheet("gemv-littles-law", "--latency-ns", "800")
    assert value(slow, "bytes in flight (whole GPU)") == pytest.approx(3.35e12 * 800e-9)
    assert slow.warnings and "800 ns" in slow.warnings[0]
    # int4-g128 attn_k: 1024 rows x 4096 / 128 groups x 532 bits / 8 = 2,179,072 B
    # h100: 2,179,072 / (2,179,072 + 2,010,000) = 0.5202 (just above half: not small);
    # h200: 2,179,072 / (2,179,072 + 2,880,000) = 0.4307 (small)
    i4 = ["--model", "Llama-3.1-8B", "--weights", "int4-g128"]
    assert value(sheet("gemv-littles-law", *i4), "attn_k 1024x4096") == pytest.approx(
        0.520180, abs=1e-6)
    small = sheet("gemv-littles-law", "--gpu", "h200", *i4).data["small_gemvs"]
    assert small == ["attn_k 1024x4096", "attn_v 1024x4096"]


def test_gemv_small_model_is_latency_bound() -> None:
    s = sheet("gemv-littles-law", "--model", "SmolLM2-135M")
    # attn_k: 3 x 64 = 192 rows x 576 x 2 B = 221,184 B -> 221,184 / 2,231,184 = 0.09913
    assert value(s, "attn_k 192x576") == pytest.approx(221_184 / (221_184 + 2_010_000))
    # below 2,010,000 B: q, k, v, o (<= 663,552 B), gate/up/down (1536 x 576 x 2 = 1,769,472)
    # and fused qkv (960 x 576 x 2 = 1,105,920); lm_head and fused gate_up (3,538,944) are not
    assert len(s.data["small_gemvs"]) == 8
    assert s.verdict.startswith("8 of 10 GEMV shapes")


# -- fa2-vs-fa3 -----------------------------------------------------------------------------

def test_fa_h100_head_dim_128() -> None:
    s = sheet("fa2-vs-fa3")
    # clock = 989.4e12 / (132 x 4096) = 1.82998 GHz; MUFU = 16 x 132 x clock = 989.4e12 / 256
    assert value(s, "clock the peak implies") == pytest.approx(989.4e12 / (132 * 4096))
    assert value(s, "MUFU exponentials") == pytest.approx(3.86484e12, rel=1e-5)
    assert value(s, "matmul FLOP/s per exp/s") == pytest.approx(256.0)
    # FP32: 2 x 128 x 132 x 1.82998e9 = 61.84 TFLOP/s
    assert value(s, "FP32 non-matmul peak") == pytest.approx(989.4e12 / 16)
    # tile 128 x 128, d 128: 4 x 128^3 = 8,388,608 FLOPs = 2,048 clk; 16,384 exp / 16 = 1,024
    assert value(s, "tile matmul FLOPs") == 8_388_608
    assert value(s, "tile matmul FLOPs per exponential") == 512
    assert value(s, "matmul clocks per tile (one SM)") == 2048
    assert value(s, "exp clocks per tile (one SM)") == 1024
    assert value(s, "exp time / matmul time") == pytest.approx(0.5)  # 256 / (4 x 128)
    assert value(s, "FA2 ceiling: softmax after GEMMs") == pytest.approx(2 / 3)
    assert value(s, "FA3 ceiling: softmax under GEMMs") == pytest.approx(1.0)
    assert value(s, "exp / matmul at d=64") == pytest.approx(1.0)  # 256 / 256
    # fp8: 1978.9e12 / 3.86484e12 / 512 = 1.0000505
    assert value(s, "exp / matmul at d=128, fp8 GEMMs") == pytest.approx(1978.9 / 989.4 / 2)
    # 600 ns x 1.82998 GHz = 1,098 clk < 2,048 -> ceil(0.536) + 1 = 2 stages;
    # smem Q 128 x 128 x 2 = 32 KiB + 2 x (K + V) 2 x 128 x 128 x 2 = 64 KiB -> 160 KiB
    assert value(s, "warp specialization + TMA: hides load latency") == 2
    assert "160.00 KiB" in s.line("warp specialization + TMA: hides load latency").shown
    assert value(s, "ping-pong (2 warpgroups): hides softmax") == pytest.approx(1.5)
    assert value(s, "intra-warpgroup pipelining: softmax j || QK^T j+1") == 64  # 64x128x4/128/4
    assert value(s, "fp8: block quantization + incoherent processing") == 128 * 7
    assert not s.warnings


def test_fa_a100_and_other_inputs() -> None:
    a = sheet("fa2-vs-fa3", "--gpu", "a100-80gb")
    # 312e12 / (108 x 2048) = 1.41059 GHz; 16 x 108 x clock = 312e12 / 128 = 2.4375e12 exp/s
    assert value(a, "MUFU exponentials") == pytest.approx(2.4375e12)
    assert value(a, "matmul FLOP/s per exp/s") == pytest.approx(128.0)
    # 128 / 512 = 0.25: 8,388,608 / 2,048 = 4,096 clk of matmul vs 1,024 of exp; FA2 0.8
    assert value(a, "exp time / matmul time") == pytest.approx(0.25)
    assert value(a, "FA2 ceiling: softmax after GEMMs") == pytest.approx(0.8)
    assert value(a, "ping-pong (2 warpgroups): hides softmax") == pytest.approx(1.25)
    assert a.warnings and "sm80" in a.warnings[0]
    # head dim from the model: SmolLM2 has 64 -> 256 / 256 = 1.0 on h100, FA2 at 50%
    small = sheet("fa2-vs-fa3", "--model", "SmolLM2-135M")
    assert value(small, "exp time / matmul time") == pytest.approx(1.0)
    assert value(small, "FA2 ceiling: softmax after GEMMs") == pytest.approx(0.5)
    assert value(sheet("fa2-vs-fa3", "--head-dim", "256"), "exp time / matmul time") == (
        pytest.approx(0.25))
    # MLA (DeepSeek-V3): d_qk = 128 + 64 = 192, d_v = 128: 2 x (192 + 128) = 640 FLOPs per
    # exponential; tile 128 x 128 x 640 = 10,485,760; on h100 256 / 640 = 0.4
    mla = sheet("fa2-vs-fa3", "--model", "DeepSeek-V3")
    assert value(mla, "tile matmul FLOPs") == 10_485_760
    assert value(mla, "exp time / matmul time") == pytest.approx(0.4)
    # smem: Q 128 x 192 x 2 = 48 KiB + 2 stages x K,V 128 x 320 x 2 = 80 KiB -> 208 KiB fits
    # h100's 228 KiB, not a100's 164 KiB
    tma = "warp specialization + TMA: hides load latency"
    assert "208.00 KiB smem" in mla.line(tma).shown and "too big" not in mla.line(tma).shown
    a_mla = sheet("fa2-vs-fa3", "--model", "DeepSeek-V3", "--gpu", "a100-80gb")
    assert a_mla.line(tma).shown.endswith("> 164 KiB: too big")
    # tile 64 x 128: 4 x 64 x 128 x 128 = 4,194,304
    assert value(sheet("fa2-vs-fa3", "--tile", "64x128"), "tile matmul FLOPs") == 4_194_304
    # 4,000 ns x 1.82998 GHz = 7,320 clk -> ceil(3.574) + 1 = 5 stages
    slow = sheet("fa2-vs-fa3", "--latency-ns", "4000")
    assert value(slow, "warp specialization + TMA: hides load latency") == 5


# -- int4-dequant ---------------------------------------------------------------------------

def test_int4_budget_h100() -> None:
    s = sheet("int4-dequant")
    # int4-g128: 532 bits per 128 = 4.15625 bits; 3.35e12 x 8 / 4.15625 = 6.44812e12 weights/s
    assert value(s, "int4 codes arriving") == pytest.approx(6.7e12)
    assert value(s, "int4-g128 weights arriving (scales included)") == pytest.approx(
        3.35e12 * 8 / 4.15625)
    # issue 128 x 132 x (989.4e12 / (132 x 4096)) = 989.4e12 / 32 = 3.091875e13
    assert value(s, "instruction issue rate") == pytest.approx(3.091875e13)
    # 3.091875e13 / 6.44812e12 = 4.79500; LOP3 half of it, converts 1/8
    assert value(s, "budget: instructions per weight") == pytest.approx(4.795002, rel=1e-6)
    assert value(s, "budget: integer/logic (LOP3) per weight") == pytest.approx(4.795002 / 2)
    assert value(s, "budget: conversions (I2F, F2F) per weight") == pytest.approx(4.795002 / 8)
    # naive: min(1, 4.795 / 5.5, 0.599375 / 2) = 0.29969; magic: min(1, 4.795 / 2.125, ...) = 1
    assert value(s, "naive dequant: share of bandwidth") == pytest.approx(0.299688, abs=1e-6)
    assert value(s, "magic-number dequant: share of bandwidth") == 1.0


def test_int4_budget_changes_with_gpu_and_format() -> None:
    # a100-40gb: issue 312e12 / 16 = 1.95e13; 1.555e12 x 8 / 4.15625 = 2.99308e12 -> 6.51503
    a = sheet("int4-dequant", "--gpu", "a100-40gb")
    assert value(a, "budget: instructions per weight") == pytest.approx(6.515027, rel=1e-6)
    assert value(a, "naive dequant: share of bandwidth") == pytest.approx(6.515027 / 16)
    # b200: 2.25e15 / 64 = 3.515625e13 issue; 8e12 x 8 / 4.15625 = 1.5398496e13 -> 2.283096
    b = sheet("int4-dequant", "--gpu", "b200")
    assert value(b, "budget: instructions per weight") == pytest.approx(2.283096, rel=1e-6)
    # Q4_0: 18 B per 32 = 4.5 bits; h100: 989.4e12 x 4.5 / (256 x 3.35e12) = 5.191581
    q = sheet("int4-dequant", "--weights", "Q4_0")
    assert value(q, "budget: instructions per weight") == pytest.approx(5.191581, rel=1e-6)


def test_magic_number_bits() -> None:
    s = sheet("int4-dequant")  # n = 11
    assert value(s, "fp16 magic 0x6400") == 1024.0
    # 0x6400 | 0xB = 0x640B = 1024 + 11 = 1035; - 1024 = 11; - 0x6408 (1032) = 3
    assert s.line("0x6400 | 11 (OR the nibble into the mantissa)").shown == "0x640B = 1035"
    assert value(s, "minus the magic (HSUB2)") == 11.0
    assert value(s, "zero point 8 folded into the magic") == 3.0
    assert value(s, "LOP3 immLut for (a & b) | c") == 0xEA
    # q = 0x0004000B (n, 15 - n): (q & 0x000F000F) | 0x64006400 = 0x6404640B
    assert value(s, "two nibbles, one LOP3: q = 0x0004000B") == 0x6404640B
    # 0x6400 | 0xB0 = 0x64B0 = 1200; / 16 - 64 = 11
    assert value(s, "high nibble (bits 4-7): HFMA2 x 1/16 - 64") == 11.0
    assert value(s, "fp32 magic 0x4B000000") == 11.0  # 0x4B00000B = 8,388,619 - 2^23
    z = sheet("int4-dequant", "--value", "0")
    assert value(z, "minus the magic (HSUB2)") == 0.0
    assert value(z, "zero point 8 folded into the magic") == -8.0
    assert value(z, "two nibbles, one LOP3: q = 0x000F0000") == 0x640F6400


# -- w4a16-crossover ------------------------------------------------------------------------

def test_w4a16_gemm_crossover_per_gpu() -> None:
    s = sheet("w4a16-crossover")
    # ridge 989.4e12 / 3.35e12 = 295.343; int4-g128 GEMM compute-bound at 295.343 x 4.15625
    # / 16 = 76.72; bf16 at 295.34; between them speedup = ridge / b < 1.05 from
    # b > 295.343 / 1.05 = 281.28 -> 282
    assert value(s, "ridge point") == pytest.approx(295.34328, rel=1e-6)
    assert value(s, "int4-g128 GEMM compute-bound from batch") == pytest.approx(
        295.34328 * 4.15625 / 16, rel=1e-6)
    assert value(s, "GEMM speedup while both are memory-bound") == pytest.approx(16 / 4.15625)
    assert value(s, "GEMM stops paying (speedup < x1.05)") == 282
    # h200: 989.4 / 4.8 = 206.125 / 1.05 = 196.31 -> 197; a100-80gb: 312 / 2.039 = 153.02
    # / 1.05 = 145.73 -> 146; --threshold 0.2 on h100: 295.343 / 1.2 = 246.12 -> 247
    assert value(sheet("w4a16-crossover", "--gpu", "h200"),
                 "GEMM stops paying (speedup < x1.05)") == 197
    assert value(sheet("w4a16-crossover", "--gpu", "a100-80gb"),
                 "GEMM stops paying (speedup < x1.05)") == 146
    assert value(sheet("w4a16-crossover", "--threshold", "0.2"),
                 "GEMM stops paying (speedup < x1.2)") == 247


def test_gemm_speedup_regions() -> None:
    h100 = get_hardware("h100")
    # batch 1: both memory-bound, 2 B / (4.15625 / 8) B = 3.8496
    assert gemm_speedup(h100, 4.15625, 1) == pytest.approx(16 / 4.15625)
    # batch 100: int4 compute-bound (> 76.7), bf16 not (< 295.3): ridge / b = 2.95343
    assert gemm_speedup(h100, 4.15625, 100) == pytest.approx(295.34328 / 100, rel=1e-6)
    assert gemm_speedup(h100, 4.15625, 400) == 1.0  # both compute-bound


def test_w4a16_whole_step() -> None:
    s = sheet("w4a16-crossover")
    # int4-g128 Llama-3.1-8B: 6,979,321,856 decoder linear weights x 532 / 128 / 8 =
    # 3,625,975,808 B + embedding and lm_head in bf16 2 x 525,336,576 x 2 = 2,101,346,304 +
    # vectors 266,240 x 2 = 532,480 -> 5,727,854,592 B
    assert value(s, "int4-g128 weight bytes") == 5_727_854_592
    # KV at 2048: 32 layers x 8 heads x 2 x 128 x 2 B = 131,072 B/token x 2048 = 268,435,456
    assert value(s, "KV per sequence at 2,048") == 268_435_456
    # batch 1, both memory-bound: (16,060,522,496 + 268,435,456) / (5,727,854,592 +
    # 268,435,456) = 2.72318
    assert value(s, "step speedup at batch 1") == pytest.approx(2.723177, rel=1e-6)
    # at 2048 tokens KV/bandwidth (80 us a sequence) > F/peak (16 us): both steps stay
    # memory-bound, speedup = (W16 + b KV) / (W4 + b KV) < 1.05 from
    # b > (W16 - 1.05 W4) / (0.05 KV) = (16,060,522,496 - 6,014,247,321.6) / 13,421,772.8
    # = 748.51 -> 749
    assert value(s, "step stops paying (speedup < x1.05)") == 749
    # at 256 tokens int4 turns compute-bound and bf16 does not: (W16 + b KV) / bandwidth <
    # 1.05 b F / peak from b > W16 / (1.05 F bandwidth / peak - KV), F = 15,009,316,864 +
    # 32 x 4 x 32 x 128 x 256 = 15,143,534,592, KV = 33,554,432 -> 791.80 -> 792
    short = sheet("w4a16-crossover", "--context", "256")
    assert value(short, "step stops paying (speedup < x1.05)") == 792
    assert value(short, "GEMM stops paying (speedup < x1.05)") == 282  # no KV in one GEMM


# -- qat-vs-ptq -----------------------------------------------------------------------------

def test_qat_vs_ptq_llama_h100() -> None:
    s = sheet("qat-vs-ptq")
    n, cal = 7_504_658_432, 128 * 2048
    assert value(s, "calibration tokens") == 262_144
    assert value(s, "calibration forward") == 2 * n * cal
    # Hessians per token per layer: 2 x (3 x 4096^2 (qkv input, o input, gate/up input)
    # + 14336^2 (down input)) = 511,705,088; x 32 layers x 262,144 tokens
    assert value(s, "GPTQ Hessians") == 511_705_088 * 32 * cal
    # solve per layer: q, o 4096 x 4096^2 + 4096^3 // 3; k, v 1024 x 4096^2 + ...; gate, up
    # 14336 x 4096^2 + ...; down 4096 x 14336^2 + 14336^3 // 3 = 2,614,203,427,496; x 32
    assert value(s, "GPTQ column solve") == 2_614_203_427_496 * 32
    ptq = 2 * n * cal + 511_705_088 * 32 * cal + 2_614_203_427_496 * 32
    rate = 989.4e12 * 0.4
    assert value(s, "PTQ GPU-hours") == pytest.approx(ptq / rate / 3600)  # ~21 s
    # QAT: 0.001 x 15e12 = 1.5e10 tokens x 6 x N = 6.7542e20 FLOPs -> 474.07 h
    assert value(s, "QAT tokens") == pytest.approx(1.5e10)
    assert value(s, "QAT FLOPs") == pytest.approx(6 * n * 1.5e10)
    assert value(s, "QAT GPU-hours") == pytest.approx(474.07, abs=0.01)
    assert value(s, "QAT / PTQ") == pytest.approx(6 * n * 1.5e10 / ptq)


def test_qat_inputs_change_the_hours() -> None:
    base = value(sheet("qat-vs-ptq"), "QAT GPU-hours")
    # a100: 312e12 instead of 989.4e12 -> x 3.1712
    assert value(sheet("qat-vs-ptq", "--gpu", "a100-80gb"), "QAT GPU-hours") == pytest.approx(
        base * 989.4 / 312)
    assert value(sheet("qat-vs-ptq", "--mfu", "0.2"), "QAT GPU-hours") == pytest.approx(2 * base)
    # SmolLM2: 134,479,872 matmul params, 2T pretraining -> 2e9 tokens x 6 x N = 1.61376e18
    small = sheet("qat-vs-ptq", "--model", "SmolLM2-135M")
    assert value(small, "QAT FLOPs") == pytest.approx(6 * 134_479_872 * 2e9)
    # Mistral has no published token count: given outright it works
    m = sheet("qat-vs-ptq", "--model", "Mistral-7B-v0.1", "--qat-tokens", "1e9")
    assert value(m, "QAT tokens") == 1e9
    assert value(sheet("qat-vs-ptq", "--calib-samples", "256"), "calibration tokens") == 524_288


# -- llamacpp-vs-vllm -----------------------------------------------------------------------

def test_llamacpp_vs_vllm_llama_h100() -> None:
    s = sheet("llamacpp-vs-vllm")
    # 3.35e12 / 16,060,522,496 = 208.59 tok/s; / 4,912,898,048 (Q4_K_M) = 681.88
    assert value(s, "bf16 batch-1 ceiling, weights only") == pytest.approx(208.586, abs=1e-3)
    assert value(s, "Q4_K_M batch-1 ceiling, weights only") == pytest.approx(681.879, abs=1e-3)
    assert value(s, "Q4_K_M / bf16 at batch 1") == pytest.approx(16_060_522_496 / 4_912_898_048)
    # batch 256 at 1024 tokens: memory (16,060,522,496 + 256 x 134,217,728) / 3.35e12 =
    # 15.0508 ms > compute 256 x 15,546,187,776 / 989.4e12 = 4.0225 ms -> 256 / 15.0508 ms
    assert value(s, "bf16 at batch 256") == pytest.approx(256 * 3.35e12 / 50_420_260_864)
    # bf16 GEMMs turn compute-bound at the ridge 295.34; Q4_K_M at 295.34 x 4.8944 / 16
    assert value(s, "bf16 GEMMs compute-bound from batch") == pytest.approx(295.34328, rel=1e-6)
    # KV: 131,072 B/token; 80e9 - 16,060,522,496 = 63,939,477,504 B free;
    # contiguous 8192-token slots: // 1,073,741,824 = 59; paged 64 blocks of 16: // 134,217,728
    # = 476
    assert value(s, "memory left for KV") == 63_939_477_504
    assert value(s, "contiguous slots of 8,192 tokens") == 59
    assert value(s, "paged blocks, 1,024 tokens each") == 476


def test_llamacpp_inputs_change_the_answer() -> None:
    h200 = sheet("llamacpp-vs-vllm", "--gpu", "h200")
    # 4.8e12 / 4,912,898,048 = 977.02; free 141e9 - 16,060,522,496 = 124,939,477,504 B:
    # // 1,073,741,824 = 116 slots, // 134,217,728 = 930 paged
    assert value(h200, "Q4_K_M batch-1 ceiling, weights only") == pytest.approx(977.02, abs=0.01)
    assert value(h200, "contiguous slots of 8,192 tokens") == 116
    assert value(h200, "paged blocks, 1,024 tokens each") == 930
    s = sheet("llamacpp-vs-vllm", "--batch", "64", "--max-context", "4k", "--context", "512")
    # 4096-token slots: 131,072 x 4096 = 536,870,912 -> 119; 512 tokens = 32 blocks: 67,108,864
    # -> 952
    assert value(s, "contiguous slots of 4,096 tokens") == 119
    assert value(s, "paged blocks, 512 tokens each") == 952
    assert "bf16 at batch 64" in [ln.name for sec in s.sections for ln in sec.lines]


# -- q4km-cost ------------------------------------------------------------------------------

def test_q4km_llama() -> None:
    s = sheet("q4km-cost")
    assert value(s, "Q4_K bits per weight") == 4.5  # (4 + 12 + 128) B x 8 / 256
    assert value(s, "Q6_K bits per weight") == 6.5625  # (128 + 64 + 16 + 2) B x 8 / 256
    # use_more_bits over 32 layers: i < 4, i >= 28, i in 6, 9, ..., 27 -> 4 + 4 + 8 = 16
    assert value(s, "layers use_more_bits picks") == 16
    # lm_head 525,336,576 weights in Q6_K: / 256 x 210 = 430,940,160 B
    assert value(s, "lm_head in Q6_K") == 430_940_160
    # ffn_down in Q6_K in 16 layers: 16 x 58,720,256 / 256 x 210 = 770,703,360 B
    assert value(s, "ffn_down in Q6_K") == 770_703_360
    # total: embedding Q4_K 295,501,824 + lm_head 430,940,160 + q, o 2 x 301,989,888 + k
    # 75,497,472 + v 55,050,240 + 37,748,736 + gate, up 2 x 1,056,964,608 + down 770,703,360
    # + 528,482,304 + norms f32 65 x 4096 x 4 = 1,064,960 -> 4,912,898,048 B
    assert value(s, "file weight bytes") == 4_912_898_048
    # 4,912,898,048 x 8 / 8,030,261,248 = 4.89438
    assert value(s, "average bits per weight") == pytest.approx(4.894384, abs=1e-6)
    # Q6_K bytes: 430,940,160 + 55,050,240 + 770,703,360 = 1,256,693,760
    assert value(s, "share of bytes in Q6_K") == pytest.approx(1_256_693_760 / 4_912_898_048)
    assert value(s, "batch-1 decode ceiling on h100") == pytest.approx(3.35e12 / 4_912_898_048)
    assert not s.warnings


def test_q4km_other_model_and_mix() -> None:
    s = sheet("q4km-cost", "--model", "SmolLM2-135M")
    # 30 layers: i < 3, i >= 26, i in 5, 8, ..., 23 -> 3 + 4 + 7 = 14
    assert value(s, "layers use_more_bits picks") == 14
    # tied embedding = lm_head only: 49152 x 576 = 28,311,552 weights in Q6_K = 23,224,320 B
    assert value(s, "lm_head in Q6_K") == 23_224_320
    # total 86,677,056 B x 8 / 134,515,008 parameters = 5.15494 (lm_head in Q6_K weighs more
    # in a small model)
    assert value(s, "average bits per weight") == pytest.approx(86_677_056 * 8 / 134_515_008)
    # 576-wide rows are 2.25 super-blocks; ffn_down's 1536 = 6 x 256 is fine
    assert s.warnings and "attn_q (576)" in s.warnings[0] and "ffn_down" not in s.warnings[0]
    q5 = sheet("q4km-cost", "--weights", "Q5_K_M")
    assert value(q5, "Q5_K bits per weight") == 5.5  # (4 + 12 + 32 + 128) B x 8 / 256
    assert value(q5, "average bits per weight") > value(sheet("q4km-cost"),
                                                        "average bits per weight")


def test_numbers_are_finite() -> None:
    for topic in TOPICS:
        for sec in sheet(topic).sections:
            for ln in sec.lines:
                if isinstance(ln.value, float):
                    assert math.isfinite(ln.value), (topic, ln.name)
