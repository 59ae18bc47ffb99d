"""`fitserve plan longctx`: golden figures derived by hand from the catalog configs.

Catalog facts used below (fitserve/ledger/catalog/{models,gpus}.json):

    Llama-3.1-8B   32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, FFN 14336,
                   vocab 128256 (untied), bf16 weights: 8,030,261,248 params x 2 B
    Llama-3.3-70B  80 layers, hidden 8192, 64 heads, 8 KV heads, head_dim 128, FFN 28672
    DeepSeek-V3    61 layers, MLA: kv_lora_rank 512 + qk_rope 64 cached per token per layer;
                   128 heads, qk_nope 128, v_head 128
    Gemma-3-27B    62 layers: 10 full + 52 sliding (window 1024), 16 KV heads, head_dim 128
    h100  80e9 B, 989.4e12 bf16 / 1978.9e12 fp8 FLOP/s, NVLink 450e9 B/s, 8 us
    b200  180e9 B, 2.25e15 bf16, NVLink 900e9 B/s, 8 us
    h200  141e9 B, 989.4e12 bf16, 450e9 B/s, 8 us
    mi300x 192e9 B, 1307.4e12 bf16, 448e9 B/s, 10 us
Usable memory per GPU = memory x 0.9 (the engine's default utilization).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fitserve.tools.sheets.context_parallel import (
    contiguous_shards,
    imbalance,
    min_hiding_shard,
    rank_work,
    zigzag_shards,
)
from fitserve.tools.sheets.sheet import Sheet, build_sheet, run_tool

M = 1 << 20  # "1m" = 1,048,576 tokens
GIB = 1 << 30


def _sheet(*argv: str) -> Sheet:
    return build_sheet("longctx", list(argv))


# -- Llama-3.1-8B, 1m tokens on 8 x h100, bf16 KV ---------------------------------------------
# KV per token per layer: 2 (K, V) x 8 heads x 128 x 2 B = 4,096 B; all layers 32 x 4,096
# = 131,072 B; one copy at 1m: 131,072 x 1,048,576 = 137,438,953,472 B (128 GiB).
# weights (tp=1): 8,030,261,248 x 2 = 16,060,522,496 B
#   = 2 x 128256 x 4096 (embed, lm_head) + 32 x (2 x 4096^2 + 2 x 1024 x 4096 + 3 x 14336 x
#     4096 + 2 x 4096 norms) + 4096, times 2 B
# reserve: activations of a 2048-token chunk, MLP phase 3 x 4096 + 3 x 14336 = 55,296 per token:
#   2048 x 2 B x 55,296 + 2048 x 24 B = 226,541,568, + 1 GiB workspace = 1,300,283,392 B
# TP1 x CP8: each GPU holds 1m / 8 = 131,072 tokens: 131,072 x 131,072 = 17,179,869,184 B
# need = 16,060,522,496 + 17,179,869,184 + 1,300,283,392 = 34,540,675,072 <= 72e9: the
# smallest TP that fits is TP1, so TP1 x CP8 is chosen.
LLAMA8_WEIGHTS = 8_030_261_248 * 2
LLAMA8_RESERVE = 2048 * 2 * (3 * 4096 + 3 * 14336) + 2048 * 24 + GIB


def test_llama8b_h100_kv_and_layout() -> None:
    sh = _sheet("Llama-3.1-8B", "--context", "1m", "--gpu", "h100", "--gpus", "8")
    assert sh.ok
    assert sh.line("KV per token per layer").value == 2 * 8 * 128 * 2 == 4096
    assert sh.line("KV per token, all layers").value == 32 * 4096 == 131_072
    assert sh.line(f"KV per request @ {M:,}, one copy").value == 131_072 * M == 137_438_953_472
    # TP1: the group is one GPU holding it all
    assert sh.line("KV per request on the TP1 group").value == 137_438_953_472
    assert sh.line("KV per GPU, TP1 x CP8").value == 131_072 * 131_072 == 17_179_869_184
    need = LLAMA8_WEIGHTS + 17_179_869_184 + LLAMA8_RESERVE
    assert need == 34_540_675_072
    assert sh.line("TP1 x CP8 (chosen)").value == need
    assert sh.data["layout"] == "TP1 x CP8"
    # TP2 x CP4 holds the same KV per GPU (4 heads x 262,144 tokens) and half the weights
    assert sh.line("KV per GPU, TP1 x CP8").value == 16 * GIB


def test_llama8b_h100_prefill_flops() -> None:
    sh = _sheet("Llama-3.1-8B", "--context", "1m", "--gpu", "h100")
    # attention per position: 4 x 32 heads x 128 = 16,384 FLOPs; causal positions per layer
    # N (N + 1) / 2; 32 layers
    attn = 16_384 * 32 * M * (M + 1) // 2
    # matmul: 2 x 32 layers' matmul params x N + 2 x lm_head (one logit position)
    layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096  # 218,103,808
    matmul = 2 * 32 * layer * M + 2 * 128_256 * 4096
    assert sh.line("prefill attention FLOPs").value == attn
    assert sh.line("prefill matmul FLOPs").value == matmul
    assert sh.line("attention share of prefill").value == pytest.approx(attn / (attn + matmul))
    assert 0.95 < attn / (attn + matmul) < 0.953  # 95.2%


def test_llama8b_h100_ring_hides() -> None:
    sh = _sheet("Llama-3.1-8B", "--context", "1m", "--gpu", "h100", "--gpus", "8")
    # block per step: 131,072 tokens x 4,096 B (one layer) = 536,870,912 B
    block = 131_072 * 4096
    assert sh.line("KV block sent per step per GPU").value == block == 536_870_912
    transfer = 8e-6 + block / 450e9  # 1.201 ms
    assert sh.line("transfer per step").value == pytest.approx(transfer, rel=1e-12)
    # one off-diagonal zigzag step: half of 131,072^2 pairs x 16,384 FLOPs at the bf16 peak
    compute = 131_072**2 // 2 * 16_384 / 989.4e12  # 142.2 ms
    assert sh.line("attention per step").value == pytest.approx(compute, rel=1e-12)
    assert sh.line("compute / transfer").value == pytest.approx(compute / transfer)
    assert 118 < compute / transfer < 119
    # smallest shard n: (F / 2P) n^2 - (b / B) n - latency = 0 with F = 16,384, b = 4,096
    a, b = 16_384 / (2 * 989.4e12), 4096 / 450e9
    root = (b + math.sqrt(b * b + 4 * a * 8e-6)) / (2 * a)  # 1,675.9
    assert sh.line("smallest shard that hides").value == math.ceil(root) == 1676
    assert sh.line("ring steps per layer").value == 7


def test_llama8b_causal_balance_exact() -> None:
    sh = _sheet("Llama-3.1-8B", "--context", "1m", "--gpu", "h100", "--gpus", "8")
    # c = 8, n = 131,072: rank 7 does 7 n^2 + n (n + 1) / 2 pairs; the mean N (N + 1) / 2 / 8
    n, c = 131_072, 8
    exact = Fraction((2 * c - 1) * n + 1, c * n + 1)
    assert sh.line("contiguous split: max / mean work").value == float(exact)
    assert abs(float(exact) - 15 / 8) < 1e-5
    assert sh.line("zigzag split: max / mean work").value == 1.0


def test_llama8b_h100_what_breaks() -> None:
    sh = _sheet("Llama-3.1-8B", "--context", "1m", "--gpu", "h100", "--gpus", "8")
    # context x2: KV 32 GiB -> 16,060,522,496 + 34,359,738,368 + 1,300,283,392 = 51,720,544,256
    assert sh.line("context x2").value == LLAMA8_WEIGHTS + 32 * GIB + LLAMA8_RESERVE
    assert "fits" in sh.line("context x2").shown
    # context x4: KV 64 GiB -> 86,080,282,624 > 72e9; the first break (x4 growth; MHA ties at
    # x4 and is listed after it)
    assert sh.line("context x4").value == LLAMA8_WEIGHTS + 64 * GIB + LLAMA8_RESERVE
    assert sh.line("context x4").value == 86_080_282_624
    assert "BREAKS" in sh.line("context x4").shown
    assert sh.line("first change that breaks it").value == "context x4"
    # replacement: fp8 KV (1 B) on TP1 x CP8 at 4m: 524,288 tokens x 32 x 2,048 B = 32 GiB
    assert sh.line("try: fp8 KV, same split").value == LLAMA8_WEIGHTS + 32 * GIB + LLAMA8_RESERVE
    assert str(sh.line("what replaces the layout").value).startswith("fp8 KV, same split")


def test_llama8b_b200_numbers_differ_and_nothing_breaks() -> None:
    sh = _sheet("Llama-3.1-8B", "--context", "1m", "--gpu", "b200", "--gpus", "8")
    # the same bytes; the link is 900e9 B/s and the peak 2.25e15 FLOP/s
    block = 131_072 * 4096
    assert sh.line("transfer per step").value == pytest.approx(8e-6 + block / 900e9, rel=1e-12)
    assert sh.line("attention per step").value == pytest.approx(
        131_072**2 // 2 * 16_384 / 2.25e15, rel=1e-12)
    # usable 180e9 x 0.9 = 162e9: context x4 (86,080,282,624 B) and MHA (KV x4, weights
    # + 2 x 32 x (4096 - 1024) x 4096 x 2 B = 17,671,135,232 B) both fit
    assert sh.line("context x4").value == 86_080_282_624
    assert "fits" in sh.line("context x4").shown
    assert sh.line("GQA -> MHA (32 KV heads)").value == 17_671_135_232 + 64 * GIB + LLAMA8_RESERVE
    assert sh.line("first change that breaks it").value is None
    assert "none of these" in sh.verdict


# -- Llama-3.3-70B on 8 x h100 -------------------------------------------------------------------
# weights per TP8 rank: embed and lm_head 16,032 x 8192 each; per layer q, o 8192 x 1024, k, v
# one head 128 x 8192, MLP 3 x 3584 x 8192, norms 2 x 8192 (replicated): 106,971,136 elements;
# 80 layers + 2 x 131,334,144 + 8192 = 8,820,367,360 elements x 2 B = 17,640,734,720 B
# KV per GPU at TP8 x CP1: one KV head: 80 x 2 x 128 x 2 B = 40,960 B x 1m = 42,949,672,960 B
# reserve (tp 8): MLP phase 3 x 8192 + 3 x 28672 / 8 = 35,328 per token:
#   2048 x 2 x 35,328 + 2048 x 24 + 1 GiB = 1,218,494,464 B
# TP8 x CP1 needs 61,808,902,144 <= 72e9; TP4 x CP2 needs ~35e9 weights + the same KV: no.
def test_llama70b_h100_needs_tp8() -> None:
    sh = _sheet("Llama-3.3-70B", "--context", "1m", "--gpu", "h100", "--gpus", "8")
    need = 17_640_734_720 + 42_949_672_960 + 1_218_494_464
    assert sh.line("TP8 x CP1 (chosen)").value == need == 61_808_902_144
    assert "no" in sh.line("TP4 x CP2").shown
    assert sh.line("KV per request on the TP8 group").value == 8 * 42_949_672_960
    # no ring on CP1: the ring section is the TP1 x CP8 alternative (a block of
    # 131,072 tokens x 80-layer model's one layer, 8 heads: 4,096 B a token)
    assert sh.line("KV block sent per step per GPU").value == 131_072 * 4096
    # context x2 doubles the KV: 104.9e9 > 72e9; fp8 KV at 2m holds exactly the bf16 1m bytes
    assert sh.line("first change that breaks it").value == "context x2"
    assert sh.line("try: fp8 KV, same split").value == need


# -- DeepSeek-V3 (MLA) ------------------------------------------------------------------------
# latent per token per layer: (512 + 64) x 2 B = 1,152 B bf16 (576 B fp8), the same on every TP
# rank; 61 layers: 70,272 B a token; 1m: 73,685,532,672 B, x8 on a TP8 group.
# attention per position (naive MLA): 2 x 128 x ((128 + 64) + 128) = 81,920 FLOPs.
def test_deepseek_mla_h200() -> None:
    sh = _sheet("DeepSeek-V3", "--context", "1m", "--gpu", "h200", "--gpus", "8")
    assert sh.line("KV per token per layer").value == (512 + 64) * 2 == 1152
    assert sh.line("KV per token, all layers").value == 61 * 1152 == 70_272
    one = 70_272 * M
    assert sh.line(f"KV per request @ {M:,}, one copy").value == one == 73_685_532_672
    assert sh.line("KV per request on the TP8 group").value == 8 * one  # latent replicated
    assert sh.line("KV per GPU, TP8 alone").value == one
    # ring alternative TP1 x CP8: 131,072 x 1,152 B blocks over 450e9 B/s
    block = 131_072 * 1152
    assert sh.line("transfer per step").value == pytest.approx(8e-6 + block / 450e9, rel=1e-12)
    assert sh.line("attention per step").value == pytest.approx(
        131_072**2 // 2 * 81_920 / 989.4e12, rel=1e-12)
    # weights (~85e9 B at TP8) + 73.7e9 B KV > 126.9e9 usable: exit 1, fp8 KV replaces it
    assert not sh.ok
    assert "fp8 KV, same split: TP8 x CP1" in sh.verdict


def test_deepseek_mla_mi300x_fits_and_mla_to_gqa() -> None:
    sh = _sheet("DeepSeek-V3", "--context", "1m", "--gpu", "mi300x", "--gpus", "8")
    assert sh.ok and sh.data["layout"] == "TP8 x CP1"
    block = 131_072 * 1152
    assert sh.line("transfer per step").value == pytest.approx(10e-6 + block / 448e9, rel=1e-12)
    assert sh.line("attention per step").value == pytest.approx(
        131_072**2 // 2 * 81_920 / 1307.4e12, rel=1e-12)
    # MLA -> GQA with 8 KV heads of 192: at TP8 one head per rank, 2 x 192 x 2 B = 768 B a
    # layer instead of the 1,152 B latent every rank holds: KV x 768 / 1152 = 0.667
    assert "x0.667" in sh.line("MLA -> GQA (8 KV heads of 192)").explain


def test_deepseek_fp8_kv_halves_the_latent() -> None:
    sh = _sheet("DeepSeek-V3", "--context", "1m", "--gpu", "h200", "--kv", "fp8")
    assert sh.line("KV per token per layer").value == 576
    # fp8 KV: attention at the fp8 peak, 1978.9e12
    assert sh.line("attention per step").value == pytest.approx(
        131_072**2 // 2 * 81_920 / 1978.9e12, rel=1e-12)
    assert sh.ok


# -- sliding windows (Gemma-3-27B): 2 x 16 x 128 x 2 B = 8,192 B a layer a token -----------------
def test_gemma3_windows_reclaimed_and_not() -> None:
    sh = _sheet("Gemma-3-27B", "--context", "1m", "--gpu", "h100")
    assert sh.line(f"KV per request @ {M:,}, one copy").value == 62 * 8192 * M
    # 10 full layers keep 1m tokens, 52 sliding keep 1,024
    assert sh.line("KV per request, windows reclaimed").value == (
        (10 * M + 52 * 1024) * 8192) == 86_335_553_536
    # TP1 x CP8: 131,072 tokens a GPU: (10 x 131,072 + 52 x 1,024) x 8,192
    assert sh.line("KV per GPU, TP1 x CP8").value == (10 * 131_072 + 52 * 1024) * 8192
    # every layer keeping every token: 62 x 8,192 B x 1m = 532.6e9 B, more than 8 GPUs hold
    allk = _sheet("Gemma-3-27B", "--context", "1m", "--gpu", "h100", "--windows", "all-layers",
                  "--tp", "2")
    assert allk.line("KV per GPU, TP2 x CP4").value == 62 * (8192 // 2) * (M // 4)
    assert not allk.ok


# -- pure functions -------------------------------------------------------------------------
@given(st.integers(1, 16), st.integers(1, 4096))
def test_zigzag_balanced_contiguous_exact(c: int, m: int) -> None:
    n_tokens = 2 * c * m
    assert imbalance(rank_work(zigzag_shards(n_tokens, c))) == 1
    n = n_tokens // c
    assert imbalance(rank_work(contiguous_shards(n_tokens, c))) == Fraction(
        (2 * c - 1) * n + 1, c * n + 1)


def test_min_hiding_shard_is_the_smallest() -> None:
    from fitserve.ledger.hardware import get_hardware

    hw = get_hardware("h100")
    n = min_hiding_shard(16_384, 989.4e12, 4096, hw)

    def hides(k: int) -> bool:
        return (k * k // 2) * 16_384 / 989.4e12 >= 8e-6 + k * 4096 / 450e9

    assert hides(n) and not hides(n - 1)


# -- the runner: exit status, errors, JSON ----------------------------------------------------
def test_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("longctx", ["Llama-3.1-8B", "--context", "1m", "--gpus", "8"]) == 0
    capsys.readouterr()
    # 405B bf16: 101e9 B of weights per GPU at TP8 alone > 72e9
    assert run_tool("longctx", ["Llama-3.1-405B", "--context", "1m", "--gpus", "8"]) == 1
    assert "does not fit" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "needle"), [
    (["--gpu", "h900"], "unknown GPU"),
    (["--context", "0"], "--context"),
    (["--context", "-5"], "--context"),
    (["--gpus", "8", "--tp", "3"], "not a multiple of --tp 3"),
    (["--gpus", "6", "--tp", "3"], "--tp 3 does not divide"),
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--chunk", "0"], "--chunk"),
    (["--kv", "fp7"], "unknown KV format"),
    (["--memory-utilization", "0"], "--memory-utilization"),
])
def test_bad_input_exit_2(argv: list[str], needle: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("longctx", ["Llama-3.1-8B", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err


def test_json_has_the_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("longctx", ["Llama-3.1-8B", "--context", "1m", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    lines = {ln["name"]: ln for sec in doc["sections"] for ln in sec["lines"]}
    assert lines["KV per token, all layers"]["value"] == 131_072
    assert all(ln["formula"] and ln["explain"] for ln in lines.values())
    assert doc["ok"] is True and doc["data"]["layout"] == "TP1 x CP8"
