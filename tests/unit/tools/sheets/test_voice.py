"""`fitserve plan voice`: the first-audio budget and the LLM tier, against figures derived by
hand below from the catalog's config values and GPU sheets (not from the ledger's functions).

Llama-3.1-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads, head_dim 128, intermediate 14336,
vocab 128256, untied, bf16):
  params       = 2 x 128256 x 4096 (embedding + lm_head) + 32 x (2 x 4096^2 + 2 x 1024 x 4096
                 + 3 x 14336 x 4096 + 2 x 4096) + 4096 = 8,030,261,248 -> 16,060,522,496 B bf16
  body matmul  = 32 x (2 x 4096^2 + 2 x 1024 x 4096 + 3 x 14336 x 4096) = 6,979,321,856
  lm_head      = 128256 x 4096 = 525,336,576
  KV per token = 32 layers x 2 x 8 heads x 128 x 2 B = 131,072 B
  attention    = 4 x 32 heads x 128 = 16,384 FLOPs per position per layer, x 32 layers = 524,288
  prefill(P)   = 2 x body x P + 2 x lm_head + 524,288 x P (P + 1) / 2
  per token(c) = 2 x (body + lm_head) + 524,288 x c = 15,009,316,864 + 524,288 c

Qwen2.5-7B (hidden 3584, 28 layers, 28 heads, 4 KV heads, head_dim 128, intermediate 18944,
vocab 152064, untied, q/k/v biases, bf16):
  params       = 2 x 152064 x 3584 + 28 x (2 x 3584^2 + 2 x 512 x 3584 + 3 x 18944 x 3584
                 + 3584 + 2 x 512 + 2 x 3584) + 3584 = 7,615,616,512 -> 15,231,233,024 B bf16
  body matmul  = 28 x (2 x 3584^2 + 2 x 512 x 3584 + 3 x 18944 x 3584) = 6,525,288,448
  lm_head      = 152064 x 3584 = 544,997,376
  KV per token = 28 x 2 x 4 x 128 x 2 = 57,344 B; attention = 4 x 28 x 128 x 28 = 401,408

GPUs (catalog/gpus.json): h100 3.35e12 B/s, 989.4e12 bf16 FLOP/s, 80e9 B;
l40s 864e9 B/s, 362.05e12 FLOP/s; a100-80gb 2039e9 B/s, 312e12 FLOP/s.

Defaults: P = 1024 prompt tokens, N = 8 first-clause tokens (decode context P + N = 1032),
fixed stages 100 + 30 + 2 x 20 + 50 = 220 ms, so the LLM budget is 300 - 220 = 80 ms.
"""

from __future__ import annotations

import json

import pytest

from fitserve.tools.sheets.sheet import build_sheet, run_tool

L8_W = 16_060_522_496
L8_BODY, L8_LM = 6_979_321_856, 525_336_576
L8_KV = 131_072
H100_BW, H100_PEAK = 3.35e12, 989.4e12


def l8_prefill_flops(p: int) -> int:
    return 2 * L8_BODY * p + 2 * L8_LM + 524_288 * p * (p + 1) // 2


def l8_token_flops(c: int) -> int:
    return 2 * (L8_BODY + L8_LM) + 524_288 * c


def l8_llm_ms(b: int, p: int = 1024, n: int = 8) -> float:
    """TTFT(B) + (N - 1) x TPOT(B) for Llama-3.1-8B on h100, by the formulas in the header."""
    c = p + n
    ttft = max((L8_W + p * L8_KV + (b - 1) * c * L8_KV) / H100_BW,
               (l8_prefill_flops(p) + (b - 1) * l8_token_flops(c)) / H100_PEAK)
    tpot = max((L8_W + b * c * L8_KV) / H100_BW, b * l8_token_flops(c) / H100_PEAK)
    return (ttft + (n - 1) * tpot) * 1e3


def test_llama8b_h100_budget_line_by_line() -> None:
    sh = build_sheet("voice", ["Llama-3.1-8B", "--gpu", "h100"])
    # prefill_flops(1024) = 2 x 6,979,321,856 x 1024 + 2 x 525,336,576 + 524,288 x 524,800
    #                     = 14,569,848,176,640 FLOPs; / 989.4e12 = 14.7259 ms (compute-bound:
    # memory (16,060,522,496 + 1024 x 131,072) / 3.35e12 = 4.834 ms)
    assert l8_prefill_flops(1024) == 14_569_848_176_640
    ttft = 14_569_848_176_640 / 989.4e12 * 1e3
    assert sh.line("LLM TTFT, prefill 1,024 tokens at batch 1").value == pytest.approx(ttft)
    assert ttft == pytest.approx(14.7259, abs=1e-4)
    # TPOT(1) = (16,060,522,496 + 1032 x 131,072) / 3.35e12 = 16,195,788,800 / 3.35e12
    #         = 4.83456 ms; the first clause is 7 of them (token 1 comes from the prefill)
    tpot = 16_195_788_800 / 3.35e12 * 1e3
    assert sh.line("LLM first clause, 8 tokens").value == pytest.approx(7 * tpot)
    assert 7 * tpot == pytest.approx(33.842, abs=1e-3)
    # first audio = 100 + 30 + 40 + 14.726 + 33.842 + 50 = 268.568 ms; slack 31.432 ms
    assert sh.line("network up + down").value == pytest.approx(40.0)
    assert sh.line("first audio").value == pytest.approx(220 + ttft + 7 * tpot)
    assert sh.line("slack").value == pytest.approx(300 - 220 - ttft - 7 * tpot)
    assert sh.data["first_audio_ms"] == pytest.approx(268.568, abs=1e-3)
    assert sh.ok


def test_llama8b_h100_tier_is_latency_bound_at_106() -> None:
    sh = build_sheet("voice", ["Llama-3.1-8B", "--gpu", "h100"])
    # B = 106: TTFT = (14,569,848,176,640 + 105 x 15,550,382,080) / 989.4e12 = 16.376 ms,
    #          TPOT = (16,060,522,496 + 106 x 135,266,304) / 3.35e12 = 9.0743 ms
    #          -> 16.376 + 7 x 9.0743 = 79.896 ms <= 80
    # B = 107: 16.392 + 7 x 9.1146 = 80.194 ms > 80
    assert l8_llm_ms(106) == pytest.approx(79.896, abs=1e-3) and l8_llm_ms(106) <= 80
    assert l8_llm_ms(107) == pytest.approx(80.194, abs=1e-3) and l8_llm_ms(107) > 80
    assert sh.line("LLM budget").value == pytest.approx(80.0)
    assert sh.line("largest batch in budget").value == 106
    assert sh.line("LLM at batch 106").value == pytest.approx(l8_llm_ms(106))
    assert sh.line("LLM at batch 107").value == pytest.approx(l8_llm_ms(107))
    # KV ceiling: pool = 80e9 - weights 16,060,522,496 - activations 2048 x (2 x (3 x 4096 +
    # 3 x 14336) + 24) = 226,541,568 - logits 64 x 128256 x 4 = 32,833,536 - workspace 1 GiB
    # - headroom 8e9 = 54,606,360,576 B -> // (16 x 131,072 = 2,097,152) = 26,038 blocks;
    # ceil(1032 / 16) = 65 blocks per conversation -> 400
    assert sh.line("KV ceiling at 1,032 tokens").value == 26_038 // 65 == 400
    assert sh.line("LLM tier per engine").value == 106
    assert sh.data["tier"] == 106 and sh.data["tier_by_kv"] == 400


def test_concurrency_moves_the_budget_lines() -> None:
    sh = build_sheet("voice", ["Llama-3.1-8B", "--gpu", "h100", "--concurrency", "64"])
    assert sh.line("LLM TTFT, prefill 1,024 tokens at batch 64").value == pytest.approx(
        (l8_prefill_flops(1024) + 63 * l8_token_flops(1032)) / H100_PEAK * 1e3)
    assert sh.line("first audio").value == pytest.approx(220 + l8_llm_ms(64))
    assert sh.ok


def test_streams_size_the_replicas() -> None:
    sh = build_sheet("voice", ["Llama-3.1-8B", "--gpu", "h100", "--streams", "1000"])
    # ceil(1000 / 106) = 10 engines of one h100
    assert sh.line("replicas for 1,000 conversations").value == 10


def test_qwen7b_l40s_misses_and_names_what_meets_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["Qwen2.5-7B", "--gpu", "l40s"]
    sh = build_sheet("voice", argv)
    # prefill_flops(1024) = 2 x 6,525,288,448 x 1024 + 2 x 544,997,376 + 401,408 x 524,800
    #                     = 13,575,539,654,656 FLOPs / 362.05e12 = 37.4963 ms
    # TPOT(1) = (15,231,233,024 + 1032 x 57,344) / 864e9 = 15,290,412,032 / 864e9 = 17.6972 ms
    # LLM = 37.4963 + 7 x 17.6972 = 161.377 ms > 80: first audio 381.377 ms, 81.377 ms over
    ttft = 13_575_539_654_656 / 362.05e12 * 1e3
    tpot = 15_290_412_032 / 864e9 * 1e3
    assert sh.line("LLM TTFT, prefill 1,024 tokens at batch 1").value == pytest.approx(ttft)
    assert sh.line("first audio").value == pytest.approx(220 + ttft + 7 * tpot)
    assert sh.line("overrun").value == pytest.approx(300 - 220 - ttft - 7 * tpot)
    assert sh.line("overrun").miss
    assert sh.data["first_audio_ms"] == pytest.approx(381.377, abs=1e-3)
    assert not sh.ok and sh.line("largest batch in budget").value == 0
    # on h100: 13,575,539,654,656 / 989.4e12 + 7 x 15,290,412,032 / 3.35e12 = 13.72 + 31.95
    #          = 45.67 ms <= 80: meets it
    # on a100-80gb: / 312e12 + 7 x / 2039e9 = 43.51 + 52.49 = 96.0 ms > 80: does not
    found = sh.data["meets_instead"]
    assert isinstance(found, list)
    meets = {(m["model"], m["gpu"]) for m in found}
    assert ("Qwen2.5-7B", "h100") in meets and ("Qwen2.5-7B", "a100-80gb") not in meets
    assert run_tool("voice", argv) == 1
    assert "does not meet the budget" in capsys.readouterr().out


def test_llama70b_h100_misses_on_memory_and_time() -> None:
    # weights: 70,553,706,496 params x 2 B = 141,107,412,992 B > 80e9: no KV block is left
    sh = build_sheet("voice", ["Llama-3.3-70B", "--gpu", "h100"])
    assert sh.line("KV ceiling at 1,032 tokens").value == 0
    assert not sh.ok and "KV" in sh.verdict and "> 300 ms" in sh.verdict


def test_the_assumption_flags_change_the_answer() -> None:
    # network 50 ms each way: fixed 100 + 30 + 100 + 50 = 280 ms, 20 ms for the LLM, and the
    # 8B's batch-1 LLM time is 14.726 + 33.842 = 48.568 ms: nothing fits
    sh = build_sheet("voice", ["Llama-3.1-8B", "--gpu", "h100", "--network-ms", "50"])
    assert sh.line("LLM budget").value == pytest.approx(20.0)
    assert sh.line("largest batch in budget").value == 0 and not sh.ok
    # a one-token clause: no decode step before TTS starts
    one = build_sheet("voice", ["Llama-3.1-8B", "--gpu", "h100", "--first-clause-tokens", "1"])
    assert one.line("LLM first clause, 1 tokens").value == 0.0


@pytest.mark.parametrize(("argv", "needle"), [
    (["--gpu", "nope"], "unknown GPU"),
    (["--asr-ms", "-5"], "--asr-ms"),
    (["--endpointing-ms", "-1"], "--endpointing-ms"),
    (["--budget-ms", "200"], "--budget-ms 200 leaves nothing"),
    (["--budget-ms", "220"], "--budget-ms"),
    (["--budget-ms", "0"], "--budget-ms"),
    (["--first-clause-tokens", "0"], "--first-clause-tokens"),
    (["--prompt-tokens", "0"], "--prompt-tokens"),
    (["--gpu", "cpu"], "--gpu cpu"),
])
def test_bad_input_exits_2_naming_it(argv: list[str], needle: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("voice", ["Llama-3.1-8B", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("voice", ["Llama-3.1-8B", "--gpu", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["data"]["tier"] == 106
    assert all(ln["formula"] and ln["explain"] for s in out["sections"] for ln in s["lines"])


def test_explain_renders(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("voice", ["Qwen2.5-7B", "--gpu", "h100", "--explain"]) == 0
    assert "arithmetic" in capsys.readouterr().out  # the --explain column
