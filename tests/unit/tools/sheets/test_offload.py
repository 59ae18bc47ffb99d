"""`fitserve plan offload`: host-link arithmetic for weights, embeddings and KV, against figures
derived by hand below from the catalog's config values and GPU sheets.

Llama-3.1-8B (hidden 4096, 32 layers, 8 KV heads, head_dim 128, intermediate 14336, vocab
128256, untied, bf16):
  decoder layer = 2 x 4096^2 + 2 x 1024 x 4096 + 3 x 14336 x 4096 + 2 x 4096 (norms)
                = 218,112,000 params -> 436,224,000 B
  weights       = 8,030,261,248 params -> 16,060,522,496 B
  embedding     = 128256 x 4096 x 2 B = 1,050,673,152 B; one row 4096 x 2 = 8,192 B
  KV            = 2 x 8 x 128 x 2 = 4,096 B per layer per token; x 32 layers = 131,072 B;
                  one 8k sequence = 8192 x 131,072 = 1,073,741,824 B = 512 blocks of 2,097,152
  KV pool, h100 = 80e9 - 16,060,522,496 (weights) - 226,541,568 (activations: 2048 x
                  (2 x (3 x 4096 + 3 x 14336) + 24)) - 32,833,536 (logits: 64 x 128256 x 4)
                  - 1,073,741,824 (workspace) - 8e9 (headroom) = 54,606,360,576 B
                  -> 26,038 blocks -> 50 sequences of 8k
  KV pool, h200 = 141e9 - the same lines - 14.1e9 headroom = 109,506,360,576 B
                  -> 52,216 blocks -> 101 sequences of 8k
  decode step   = (16,060,522,496 + B x 1,073,741,824) / bandwidth at 8k (memory-bound here)

Llama-3.3-70B (hidden 8192, 80 layers, 8 KV heads, intermediate 28672, vocab 128256):
  decoder layer = 2 x 8192^2 + 2 x 1024 x 8192 + 3 x 28672 x 8192 + 2 x 8192
                = 855,654,400 params -> 1,711,308,800 B; weights 141,107,412,992 B
  KV            = 80 x 4,096 = 327,680 B per token; one 8k sequence = 2,684,354,560 B
  KV pool, h100 = 80e9 - 141,107,412,992 - 453,033,984 (2048 x (2 x (3 x 8192 + 3 x 28672)
                  + 24)) - 32,833,536 - 1,073,741,824 - 8e9 = -70,667,022,336 B (no fit)

SmolLM2-135M: tied embeddings, lm_head = 49152 x 576 x 2 = 56,623,104 B.
Host link: 64e9 B/s, 10 us per transfer (the defaults).
"""

from __future__ import annotations

import json

import pytest

from fitserve.tools.sheets.sheet import build_sheet, run_tool

L8_W, L8_LAYER, L8_SEQ8K = 16_060_522_496, 436_224_000, 1_073_741_824
POOL_H100 = 54_606_360_576
LINK, LAT = 64e9, 10e-6


def l8_step(b: int, bw: float = 3.35e12) -> float:
    return (L8_W + b * L8_SEQ8K) / bw


def test_weights_8_layers_of_8b_on_h100_do_not_pay(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["Llama-3.1-8B", "--gpu", "h100", "--what", "weights", "--layers-offloaded", "8"]
    sh = build_sheet("offload", argv)
    # host 8 x 436,224,000 = 3,489,792,000 B; staging 2 layers = 872,448,000 B (prefetch)
    assert sh.line("weights in host memory").value == 3_489_792_000
    assert sh.line("staging buffers in HBM").value == 872_448_000
    assert sh.line("HBM freed").value == 2_617_344_000
    # each step streams the 8 layers once, whatever the batch: 8 x 10 us + 3,489,792,000 / 64e9
    # = 54.608 ms vs the HBM step (16,060,522,496 + 1,073,741,824) / 3.35e12 = 5.1147 ms
    t_link = 8 * LAT + 3_489_792_000 / LINK
    assert t_link == pytest.approx(0.054608)
    assert sh.line("link time per step").value == pytest.approx(t_link)
    assert sh.line("GPU step, batch 1 @ 8,192").value == pytest.approx(l8_step(1))
    assert sh.line("step with offload").value == pytest.approx(t_link)  # max(t_gpu, t_link)
    assert sh.line("latency added per step").value == pytest.approx(t_link - l8_step(1))
    assert sh.line("bytes per token").value == pytest.approx(3_489_792_000)
    # ceilings: 26,038 // 512 = 50 without; (54,606,360,576 + 2,617,344,000) // 1,073,741,824
    # = 53 with; 50 / 20.820 ms = 2,401.5 tok/s vs 53 / 54.608 ms = 970.6 tok/s: does not pay
    assert sh.data["ceiling_without"] == 50 and sh.data["ceiling_with"] == 53
    assert (POOL_H100 + 2_617_344_000) // L8_SEQ8K == 53
    assert sh.line("throughput at the ceiling without (50 seqs)").value == pytest.approx(
        50 / l8_step(50))
    assert sh.line("throughput at the ceiling with (53 seqs)").value == pytest.approx(53 / t_link)
    # hidden once (16,060,522,496 + B x 1,073,741,824) / 3.35e12 >= 54.608 ms: B >= 155.4 -> 156
    assert sh.line("link time hidden behind the step").value == "from batch 156"
    assert not sh.ok
    assert run_tool("offload", argv) == 1
    assert "does not pay" in capsys.readouterr().out


def test_fraction_and_no_prefetch() -> None:
    frac = build_sheet("offload", ["Llama-3.1-8B", "--what", "weights", "--fraction", "0.25"])
    assert frac.data["layers"] == 8  # ceil(0.25 x 32)
    # no prefetch: one staging layer, and the step is t_gpu + t_link = 5.1147 + 54.608 ms
    sh = build_sheet("offload", ["Llama-3.1-8B", "--what", "weights", "--layers-offloaded",
                                 "8", "--no-prefetch"])
    assert sh.line("HBM freed").value == 7 * L8_LAYER
    assert sh.line("step with offload").value == pytest.approx(l8_step(1) + 8 * LAT
                                                               + 8 * L8_LAYER / LINK)


def test_tokens_per_s_beyond_the_link_is_marked() -> None:
    sh = build_sheet("offload", ["Llama-3.1-8B", "--what", "weights", "--layers-offloaded",
                                 "8", "--tokens-per-s", "100"])
    # 100 tok/s x 3,489,792,000 B = 348,979,200,000 B/s > 64e9: at most 64e9 / 3,489,792,000
    # = 18.34 tok/s
    ln = sh.line("bandwidth at 100.0 tok/s")
    assert ln.value == pytest.approx(348_979_200_000)
    assert "18.3 tok/s" in ln.miss


def test_weights_70b_on_h100_fit_only_by_offload() -> None:
    sh = build_sheet("offload", ["Llama-3.3-70B", "--gpu", "h100", "--what", "weights"])
    # fewest layers N with -70,667,022,336 + (N - 2) x 1,711,308,800 >= 2,684,354,560:
    # N - 2 >= 73,351,376,896 / 1,711,308,800 = 42.86 -> N = 45
    assert sh.data["layers"] == 45
    assert sh.data["ceiling_without"] == 0 and sh.data["ceiling_with"] == 1
    # 45 x 10 us + 45 x 1,711,308,800 / 64e9 = 1.2037 s per step: 0.83 tok/s
    t_link = 45 * LAT + 45 * 1_711_308_800 / LINK
    assert sh.line("link time per step").value == pytest.approx(t_link)
    assert t_link == pytest.approx(1.203714)
    assert sh.line("throughput at the ceiling with (1 seqs)").value == pytest.approx(1 / t_link)
    # the HBM step: (141,107,412,992 + 2,684,354,560) / 3.35e12 = 42.923 ms
    assert sh.line("GPU step, batch 1 @ 8,192").value == pytest.approx(
        143_791_767_552 / 3.35e12)
    assert sh.ok and "nothing fits" in sh.verdict


def test_embeddings_untied_always_pay(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["Llama-3.1-8B", "--gpu", "h100", "--what", "embeddings"]
    sh = build_sheet("offload", argv)
    # the table 1,050,673,152 B goes to the host; per token only its row crosses: 8,192 B
    assert sh.line("embeddings in host memory").value == 1_050_673_152
    assert sh.line("bytes per token").value == 8_192
    assert sh.line("HBM freed").value == 1_050_673_152 - 8_192
    # never overlapped: t_gpu + 10 us + 8,192 / 64e9 = 5.1147 ms + 10.128 us
    assert sh.line("link time per step").value == pytest.approx(LAT + 8_192 / LINK)
    assert sh.line("step with offload").value == pytest.approx(l8_step(1) + LAT + 8_192 / LINK)
    # ceiling: (54,606,360,576 + 1,050,664,960) // 1,073,741,824 = 51 (50 without); at 51:
    # 51 / (21.1407 ms + 10 us + 51 x 8,192 / 64e9) = 2,410.5 tok/s > 2,401.5: pays
    assert sh.data["ceiling_with"] == 51
    t1 = 51 / (l8_step(51) + LAT + 51 * 8_192 / LINK)
    assert sh.line("throughput at the ceiling with (51 seqs)").value == pytest.approx(t1)
    assert t1 > 50 / l8_step(50) and sh.ok
    assert run_tool("offload", argv) == 0
    assert "pays" in capsys.readouterr().out


def test_embeddings_tied_free_nothing() -> None:
    # SmolLM2's table is also its lm_head: every step reads all 56,623,104 B of it, so its
    # staging buffer is as large as what moves: 0 B freed
    sh = build_sheet("offload", ["SmolLM2-135M", "--gpu", "a100-80gb", "--what", "embeddings"])
    assert sh.line("embeddings in host memory").value == 56_623_104
    assert sh.line("HBM freed").value == 0
    assert sh.line("bytes over the link per step").value == 56_623_104
    assert not sh.ok and "frees no HBM" in sh.verdict


def test_kv_4_layers_of_8b_on_h200() -> None:
    sh = build_sheet("offload", ["Llama-3.1-8B", "--gpu", "h200", "--what", "kv",
                                 "--layers-offloaded", "4", "--concurrency", "8"])
    # one layer's KV of the batch: 8 seqs x 4,096 B x 8,192 tokens = 268,435,456 B; 4 layers =
    # 1,073,741,824 B on the host, 2 staged, 536,870,912 B freed
    assert sh.line("kv in host memory").value == 1_073_741_824
    assert sh.line("HBM freed").value == 536_870_912
    # per token per sequence: its 4 offloaded layers at 8k: 4 x 4,096 x 8,192 = 134,217,728 B
    assert sh.line("bytes per token").value == 134_217_728
    # 4 x 10 us + 1,073,741,824 / 64e9 = 16.817 ms vs (16,060,522,496 + 8 x 1,073,741,824)
    # / 4.8e12 = 5.1355 ms: the link sets the step
    t_link = 4 * LAT + 1_073_741_824 / LINK
    assert sh.line("link time per step").value == pytest.approx(t_link)
    assert sh.line("GPU step, batch 8 @ 8,192").value == pytest.approx(l8_step(8, 4.8e12))
    assert sh.line("step with offload").value == pytest.approx(t_link)
    # ceilings: 52,216 // 512 = 101 without; 109,506,360,576 // (1,073,741,824 x (32 - 4 + 2)
    # / 32 = 1,006,632,960) = 108 with
    assert sh.data["ceiling_without"] == 101 and sh.data["ceiling_with"] == 108
    # at 108: link 4 x 10 us + 108 x 134,217,728 / 64e9 = 226.53 ms >> 27.5 ms: 476.8 tok/s
    # vs 101 / 25.939 ms = 3,893.7 tok/s
    t1 = 108 / (4 * LAT + 108 * 134_217_728 / LINK)
    assert sh.line("throughput at the ceiling with (108 seqs)").value == pytest.approx(t1)
    assert sh.line("throughput at the ceiling without (101 seqs)").value == pytest.approx(
        101 / l8_step(101, 4.8e12))
    # per-layer transfer 10 us + 268,435,456 / 64e9 = 4.2043 ms; floor(5.1355 / 4.2043) = 1
    assert sh.line("layers that hide at batch 8").value == 1
    # B = 1: 4 x 10 us + 134,217,728 / 64e9 = 2.137 ms <= 3.570 ms; B = 2: 4.234 > 3.794
    assert sh.line("link time hidden behind the step").value == "up to batch 1"
    assert not sh.ok


def test_kv_default_is_the_fewest_layers_that_fit() -> None:
    sh = build_sheet("offload", ["Llama-3.1-8B", "--gpu", "h100", "--what", "kv",
                                 "--concurrency", "64"])
    # 64 x 1,073,741,824 x (34 - N) / 32 <= 54,606,360,576 -> 34 - N <= 25.43 -> N = 9; it
    # then fits (50 -> 65) but runs slower than 50 sequences without offload: does not pay
    assert sh.data["layers"] == 9
    assert sh.data["ceiling_without"] == 50 and sh.data["ceiling_with"] == 65
    assert not sh.ok and "fit only with it" in sh.verdict


@pytest.mark.parametrize(("argv", "needle"), [
    (["--what", "weights", "--gpu", "nope"], "unknown GPU"),
    (["--what", "weights", "--host-link-gbs", "0"], "--host-link-gbs"),
    (["--what", "weights", "--host-link-gbs", "-64"], "--host-link-gbs"),
    (["--what", "weights", "--host-link-latency-us", "-1"], "--host-link-latency-us"),
    (["--what", "gpu"], "--what 'gpu'"),
    (["--what", "weights", "--layers-offloaded", "33"], "--layers-offloaded must be in 1..32"),
    (["--what", "weights", "--layers-offloaded", "0"], "--layers-offloaded"),
    (["--what", "weights", "--fraction", "0"], "--fraction"),
    (["--what", "weights", "--fraction", "0.5", "--layers-offloaded", "3"], "not both"),
    (["--what", "embeddings", "--layers-offloaded", "3"], "--layers-offloaded"),
    (["--what", "weights", "--tokens-per-s", "-1"], "--tokens-per-s"),
    (["--what", "weights", "--concurrency", "0"], "--concurrency"),
    (["--what", "kv", "--context", "-5"], "--context"),
    (["--what", "weights", "--gpu", "cpu"], "--gpu cpu"),
])
def test_bad_input_exits_2_naming_it(argv: list[str], needle: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("offload", ["Llama-3.1-8B", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("offload", ["Llama-3.1-8B", "--what", "embeddings", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["data"]["bytes_per_token"] == 8_192
    assert all(ln["formula"] and ln["explain"] for s in out["sections"] for ln in s["lines"])
