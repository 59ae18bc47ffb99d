"""`fitserve plan layouts`: golden figures derived by hand from the catalog configs.

    Llama-3.1-405B  126 layers, hidden 16384, 128 heads, 8 KV heads x 128, FFN 53248,
                    vocab 128256 (untied)
    Llama-3.3-70B   80 layers, hidden 8192, 64 heads, 8 KV heads x 128, FFN 28672
    h100    80e9 B, 3.35e12 B/s, 989.4e12 bf16 FLOP/s, NVLink 450e9 B/s, 8 us a call
    a100-80gb 80e9 B, 2.039e12 B/s, NVLink 300e9 B/s, 8 us
    mi300x  192e9 B, 5.3e12 B/s, Infinity Fabric 448e9 B/s, 10 us
Inter-node default: 400 Gb/s = 50e9 B/s per GPU, 5 us. Usable = memory x 0.9.
Default step: 16 microbatches x 1 decode token, each sequence at 8,192 tokens.

405B weights per rank, bf16 (params.tensors, split by TP):
  TP8:  embed, lm_head 16,032 x 16384 each = 262,668,288; per layer q, o 2048 x 16384 =
        33,554,432 each, k, v one head 128 x 16384 = 2,097,152 each, MLP 3 x 6656 x 16384 =
        327,155,712, norms 2 x 16384: 398,491,648 a layer x 126 = 50,209,947,648;
        + 2 x 262,668,288 + 16,384 = 50,735,300,608 elements = 101,470,601,216 B
  TP16: q, o 16,777,216 each, k, v still one head 2,097,152 each (replicated), MLP
        163,577,856, norms 32,768: 201,359,360 x 126 + 2 x 131,334,144 + 16,384
        = 25,633,964,032 elements = 51,267,928,064 B
  fp8 TP8: the 126 x 7 matrices at 1 B (50,205,818,880) + a 4 B scale each (3,528) + embed,
        lm_head and norms in bf16 (1,050,673,152 + 8,290,304) = 51,264,785,864 B
KV per token per rank at TP8 and TP16 (one KV head): 126 x 2 x 128 x 2 B = 64,512 B

All-reduces are priced as the ledger prices them (plan.parallel.tp_allreduce: the fastest of
plan.collectives' alpha-beta models, c = the link's latency per call, a = 1 us per hop, B the
link's rate, p ranks, n bytes):
    ring      c + 2 (p - 1) a + 2 (p - 1) / p x n / B
    one-shot  c + a + (p - 1) x n / B
    tree      c + 2 ceil(log2 p) (a + n / B)
"""

from __future__ import annotations

import json

import pytest

from fitserve.tools.planner.report import Line
from fitserve.tools.sheets.sheet import Sheet, build_sheet, run_tool

GIB = 1 << 30
W8, W16, W8_FP8 = 101_470_601_216, 51_267_928_064, 51_264_785_864
KV_TOK = 126 * 2 * 128 * 2  # 64,512
CTX = 8192


HOP = 1e-6


def ring(n: float, p: int, rate: float, call: float) -> float:
    return call + 2 * (p - 1) * HOP + 2 * (p - 1) / p * n / rate


def one_shot(n: float, p: int, rate: float, call: float) -> float:
    return call + HOP + (p - 1) * n / rate


def tree(n: float, p: int, rate: float, call: float) -> float:
    depth = (p - 1).bit_length()  # ceil(log2 p)
    return call + 2 * depth * (HOP + n / rate)


def _sheet(*argv: str) -> Sheet:
    return build_sheet("layouts", list(argv))


def _line(sh: Sheet, section_prefix: str, name: str) -> Line:
    """A line in the first section whose title starts with ``section_prefix``."""
    sec = next(s for s in sh.sections if s.title.startswith(section_prefix))
    return next(ln for ln in sec.lines if ln.name == name)


def _reserve(tokens: int, per_token_elems: int) -> int:
    """activation_peak_bytes: tokens x 2 B x the larger phase + 24 B a token, + 1 GiB."""
    return tokens * 2 * per_token_elems + tokens * 24 + GIB


ARGS_405 = ("Llama-3.1-405B", "--gpu", "h100", "--nodes", "2", "--gpus-per-node", "8",
            "--microbatches", "16")


def test_405b_allreduces_per_token() -> None:
    sh = _sheet(*ARGS_405)
    assert sh.line("all-reduces per token at TP8").value == 2 * 126 == 252
    assert sh.line("bytes per all-reduce per token").value == 16384 * 2 == 32768
    # one token (32 KiB) at TP8 on NVLink: one-shot 8 + 1 + 7 x 32768 / 450e9 s = 9.51 us beats
    # the ring's 8 + 14 + 0.13 us: each rank sends its vector to the 7 others
    assert one_shot(32768, 8, 450e9, 8e-6) < min(ring(32768, 8, 450e9, 8e-6),
                                                 tree(32768, 8, 450e9, 8e-6))
    assert sh.line("sent per GPU per call at TP8").value == 7 * 32768 == 229_376


def test_405b_memory_per_layout() -> None:
    sh = _sheet(*ARGS_405)
    # MLP phase per token at TP8: 3 x 16384 + 3 x 53248 / 8 = 69,120 elements; TP16: 59,136
    # TP8 x DP2: 8 sequences a replica, all the weights on 8 GPUs: does not fit 72e9
    dp = W8 + 8 * CTX * KV_TOK + _reserve(8, 69_120)
    assert _line(sh, "TP8 x DP2", "memory per GPU").value == dp == 106_773_307_584
    assert "no" in _line(sh, "TP8 x DP2", "memory per GPU").shown
    # TP8 x PP2: half the layers and half the 16 sequences' KV; 1-token microbatches
    hyb = W8 // 2 + 16 * CTX * KV_TOK // 2 + _reserve(1, 69_120)
    assert _line(sh, "TP8 x PP2", "memory per GPU").value == hyb == 56_037_039_128
    tp16 = W16 + 16 * CTX * KV_TOK + _reserve(16, 59_136)
    assert _line(sh, "TP16", "memory per GPU").value == tp16 == 60_799_279_488


def _hybrid_stages(lat: float = 5e-6) -> tuple[float, float]:
    # memory-bound: (weights / 2 + 1 sequence's KV / 2) / 3.35e12
    fwd = (W8 / 2 + CTX * KV_TOK / 2) / 3.35e12
    ar = one_shot(32768, 8, 450e9, 8e-6)  # one 1-token all-reduce on NVLink: 9.51 us
    send = lat + 32768 / 50e9  # stage 0 -> stage 1 across the nodes
    return fwd + 126 * ar + send, fwd + 126 * ar


def _tp16_step(lat: float = 5e-6, rate: float = 50e9) -> float:
    # 16 tokens (512 KiB) across the nodes: the ring (35 us of hops + 19.7 us) beats one-shot
    # (15 x 10.5 us) and the tree (8 x 11.5 us)
    fwd = (W16 + 16 * CTX * KV_TOK) / 3.35e12
    n = 16 * 32768
    assert ring(n, 16, rate, lat) < min(one_shot(n, 16, rate, lat), tree(n, 16, rate, lat))
    return fwd + 252 * ring(n, 16, rate, lat)


def test_405b_step_times_and_bubble() -> None:
    sh = _sheet(*ARGS_405)
    s0, s1 = _hybrid_stages()
    assert _line(sh, "TP8 x PP2", "one all-reduce").value == pytest.approx(
        8e-6 + 1e-6 + 7 * 32768 / 450e9, rel=1e-12)
    assert _line(sh, "TP8 x PP2", "pipeline bubble").value == 1 / 17  # (2-1)/(16+2-1)
    # flush: both stages once + 15 more microbatches at the slowest stage
    assert _line(sh, "TP8 x PP2", "step time").value == pytest.approx(s0 + s1 + 15 * s0,
                                                                      rel=1e-12)
    assert _line(sh, "TP16", "one all-reduce").value == pytest.approx(
        5e-6 + 30e-6 + 2 * 15 / 16 * 16 * 32768 / 50e9, rel=1e-12)  # 54.66 us
    assert _line(sh, "TP16", "step time").value == pytest.approx(_tp16_step(), rel=1e-12)
    assert _line(sh, "PP16", "pipeline bubble").value == 15 / 31
    assert sh.data["best"] == "TP16"


def test_405b_crossover_latency() -> None:
    sh = _sheet(*ARGS_405)
    s0, s1 = _hybrid_stages(lat=0.0)
    t_pp = s0 + s1 + 15 * s0
    t_tp = _tp16_step(lat=0.0)
    # TP16 pays the latency 252 times; the pipeline 1 send + 15 more on the slowest stage
    lam = (t_pp - t_tp) / (252 - (1 + 15))
    got = sh.line("latency where TP8 x PP2 beats TP16").value
    assert got == pytest.approx(lam, rel=1e-9)
    assert 1.0e-3 < lam < 1.1e-3  # ~1.05 ms: at 5 us, TP16 is faster
    # at that latency the two steps are equal
    at = _sheet(*ARGS_405, "--inter-node-latency-us", str(lam * 1e6))
    assert _line(at, "TP8 x PP2", "step time").value == pytest.approx(
        _line(at, "TP16", "step time").value, rel=1e-9)


def test_405b_precision_forces_the_layout() -> None:
    sh = _sheet(*ARGS_405)
    # bf16 on one node: 101.5e9 B of weights per GPU > 72e9 -> TP8 x PP2 on 2 nodes
    assert sh.line("weights bf16").value == 2
    # fp8 on one node: 51,264,785,864 + 16 x 8192 x 64,512 (8,455,716,864)
    #   + 16 tokens' reserve (1,075,954,048) = 60,796,456,776 <= 72e9 -> one node
    assert W8_FP8 + 16 * CTX * KV_TOK + _reserve(16, 69_120) == 60_796_456_776
    assert sh.line("weights fp8").value == 1
    fp8 = _sheet(*ARGS_405, "--weights", "fp8")
    assert _line(fp8, "TP8 x DP2", "memory per GPU").value == (
        W8_FP8 + 8 * CTX * KV_TOK + _reserve(8, 69_120))
    assert "fits" in _line(fp8, "TP8 x DP2", "memory per GPU").shown


def test_405b_slow_link() -> None:
    sh = _sheet(*ARGS_405)
    # TP16's ring is bound by the NIC: at 0.25 x 50e9 every call's bandwidth term is 4x
    # (5 + 30 + 78.6 us a call: still the ring)
    assert sh.line("TP16 step, one slow link").value == pytest.approx(
        _tp16_step(rate=0.25 * 50e9), rel=1e-12)
    # TP8 x PP2: one NVLink in node 0 at 112.5e9: stage 0 slows, the pipeline follows it
    fwd = (W8 / 2 + CTX * KV_TOK / 2) / 3.35e12
    slow0 = fwd + 126 * one_shot(32768, 8, 0.25 * 450e9, 8e-6) + 5e-6 + 32768 / 50e9
    _, s1 = _hybrid_stages()
    assert sh.line("TP8 x PP2 step, one slow link").value == pytest.approx(
        slow0 + s1 + 15 * slow0, rel=1e-12)
    half = _sheet(*ARGS_405, "--slow-link-factor", "0.5")
    assert half.line("TP16 step, one slow link").value == pytest.approx(
        _tp16_step(rate=0.5 * 50e9), rel=1e-12)


def test_bisection_rounds() -> None:
    sh = _sheet(*ARGS_405)
    assert sh.line("rounds").value == 4  # log2 16
    # round 1: each node's 8 GPUs, 256 MiB: 8 us + 2 x 7/8 x 2^28 / 450e9
    ok = 8e-6 + 2 * 7 / 8 * (256 << 20) / 450e9
    assert sh.line("round 1: 16 -> 2 x 8").value == pytest.approx(ok, rel=1e-12)
    big = _sheet("Llama-3.1-405B", "--nodes", "4", "--gpus-per-node", "8")
    assert big.line("rounds").value == 5  # log2 32


def test_405b_mi300x_fits_one_node() -> None:
    sh = _sheet("Llama-3.1-405B", "--gpu", "mi300x", "--nodes", "2", "--gpus-per-node", "8")
    # 172.8e9 usable: bf16 fits one node (101.5e9 + 8.46e9 + 1.08e9)
    assert sh.line("weights bf16").value == 1
    assert _line(sh, "TP8 x PP2", "one all-reduce").value == pytest.approx(
        one_shot(32768, 8, 448e9, 10e-6), rel=1e-12)  # 11.51 us
    fwd = (W8 + 8 * CTX * KV_TOK) / 5.3e12  # a replica: 8 sequences, all its weights
    ar = one_shot(8 * 32768, 8, 448e9, 10e-6)  # 10 + 1 + 7 x 262144 / 448e9 s = 15.10 us
    assert _line(sh, "TP8 x DP2", "step time").value == pytest.approx(fwd + 252 * ar, rel=1e-12)


# -- Llama-3.3-70B, 4 microbatches ---------------------------------------------------------------
@pytest.mark.parametrize(("gpu", "link", "lat"), [("h100", 450e9, 8e-6),
                                                 ("a100-80gb", 300e9, 8e-6)])
def test_70b_two_accelerators(gpu: str, link: float, lat: float) -> None:
    sh = _sheet("Llama-3.3-70B", "--gpu", gpu, "--microbatches", "4")
    assert sh.line("all-reduces per token at TP8").value == 2 * 80 == 160
    assert sh.line("bytes per all-reduce per token").value == 8192 * 2 == 16384
    assert sh.line("sent per GPU per call at TP8").value == 7 * 16384  # one-shot
    assert _line(sh, "TP8 x PP2", "pipeline bubble").value == 1 / 5  # (2-1)/(4+2-1)
    assert _line(sh, "TP8 x PP2", "one all-reduce").value == pytest.approx(
        lat + 1e-6 + 7 * 16384 / link, rel=1e-12)
    # TP16 over 4 tokens (65,536 B) across the nodes: the tree, 5 + 8 x (1 + 1.31) us = 23.49 us
    # beats one-shot (6 + 15 x 1.31 = 25.66 us) and the ring (35 + 2.46 = 37.46 us)
    n = 4 * 16384
    assert tree(n, 16, 50e9, 5e-6) < min(ring(n, 16, 50e9, 5e-6), one_shot(n, 16, 50e9, 5e-6))
    assert _line(sh, "TP16", "one all-reduce").value == pytest.approx(
        5e-6 + 8 * (1e-6 + n / 50e9), rel=1e-12)
    assert _line(sh, "TP8 x DP2", "all-reduces per forward per stage").value == 160
    assert _line(sh, "TP8 x PP2", "all-reduces per forward per stage").value == 80
    assert sh.line("weights bf16").value == 1  # 17.6e9 B a GPU at TP8


def test_inter_node_flags_change_the_figures() -> None:
    sh = _sheet(*ARGS_405, "--inter-node-gbps", "800", "--inter-node-latency-us", "2")
    assert _line(sh, "TP16", "one all-reduce").value == pytest.approx(
        ring(16 * 32768, 16, 100e9, 2e-6), rel=1e-12)


# -- the runner ---------------------------------------------------------------------------
def test_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("layouts", list(ARGS_405)) == 0
    capsys.readouterr()
    # one node of 2 GPUs: TP2 holds 405 GB a GPU: no layout fits
    assert run_tool("layouts", ["Llama-3.1-405B", "--nodes", "1", "--gpus-per-node", "2"]) == 1
    assert "no layout fits" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "needle"), [
    (["--gpu", "h900"], "unknown GPU"),
    (["--inter-node-gbps", "0"], "--inter-node-gbps"),
    (["--inter-node-gbps", "-400"], "--inter-node-gbps"),
    (["--inter-node-latency-us", "-1"], "--inter-node-latency-us"),
    (["--microbatches", "0"], "--microbatches must be >= 1"),
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be >= 1"),
    (["--gpus-per-node", "3"], "--gpus-per-node 3: --tp 3 does not divide the 128"),
    (["--context", "0"], "--context must be >= 1"),
    (["--slow-link-factor", "0"], "--slow-link-factor"),
    (["--slow-link-factor", "1.5"], "--slow-link-factor"),
    (["--weights", "fp5"], "unknown weight format"),
])
def test_bad_input_exit_2(argv: list[str], needle: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("layouts", ["Llama-3.1-405B", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_json_has_the_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("layouts", [*ARGS_405, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    lines = [ln for sec in doc["sections"] for ln in sec["lines"]]
    names = {ln["name"] for ln in lines}
    assert {"all-reduces per token at TP8", "pipeline bubble", "rounds"} <= names
    assert next(ln for ln in lines if ln["name"] == "all-reduces per token at TP8")["value"] == 252
    assert all(ln["formula"] and ln["explain"] for ln in lines)
    assert doc["data"]["best"] == "TP16"
