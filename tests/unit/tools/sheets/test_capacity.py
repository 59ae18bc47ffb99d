"""`fitserve plan capacity`: capacity units at an SLO, derived by hand from the catalog below.

Workload throughout: P = 1024 prompt + O = 256 new tokens, TPOT T = 50 ms, TTFT 500 ms, so a
prompt may take floor(500 / 50) - 1 = 9 chunk steps and needs a chunk cap of ceil(1024 / 9) =
114 tokens; decodes read a mean context of P + O/2 = 1152 tokens.

Roofline step model (plan.step_time): a = weight bytes / bandwidth, b = FLOPs per token /
peak, c = 0, d = KV bytes per token / bandwidth. Steady state:

    H = a + d P,   K = b (P + O) + d O (P + O/2)
    TPOT rate (T - H) / (T K);  at B sequences: B / (O H + B K)
    TTFT: cap(B) = floor((T - a - b B - d 1152 B) / (b + d)) >= 114
          <=>  B <= (T - a - 114 (b + d)) / (b + 1152 d)

Catalog (gpus.json): h100 3.35e12 B/s, 989.4e12 FLOP/s, 80e9 B; a100-80gb 2.039e12, 312e12,
80e9; b200 8e12, 2.25e15, 180e9.

Memory (plan.memory, engine order; utilization 0.9, 2048-token step budget, 1 GiB workspace,
16-token blocks): pool = total - weights - activation peak - logits (seqs x 128,256 x 4)
- 1 GiB - (total - 0.9 total); max_num_seqs is first the engine's 64, then raised to what the
pool holds (its logits line recomputed once).
"""

from __future__ import annotations

import json
import math

import pytest

from fitserve.tools.sheets.sheet import build_sheet, run_tool

P, NEW, T = 1024, 256, 0.050  # P and O of the docstring
BASE = ["--slo-tpot-ms", "50", "--slo-ttft-ms", "500"]

# Llama-3.1-8B, bf16: 8,030,261,248 params x 2 B (32 layers x (2 x 4096^2 + 2 x 4096 x 1024
# + 3 x 4096 x 14336) = 6,979,321,856 matmul, 2 x 128,256 x 4096 embedding + lm_head,
# 266,240 norm weights).  FLOPs/token = 2 x (6,979,321,856 + 525,336,576 lm_head).
W8, F8, KV8 = 16_060_522_496, 15_009_316_864, 32 * 2 * 1024 * 2  # KV: 131,072 B/token
# Llama-3.3-70B, bf16: 70,553,706,496 params x 2 B; per rank at tp=4 the matmuls are split and
# the 1,318,912 norm weights (2,637,824 B) replicated: (141,107,412,992 - 2,637,824) / 4 +
# 2,637,824 = 35,278,831,616 B.  FLOPs/token = 2 x (68,451,041,280 + 1,050,673,152).
W70, W70_TP4, F70 = 141_107_412_992, 35_278_831_616, 139_003_428_864
KV70 = 80 * 2 * 1024 * 2  # 327,680 B/token; at tp=4 each rank holds 2 of 8 KV heads: / 4


def rates(a: float, b: float, d: float, seqs: int) -> dict[str, float]:
    """The module docstring's closed forms, by hand."""
    h = a + d * P
    k = b * (P + NEW) + d * NEW * (P + NEW / 2)
    b_ttft = math.floor((T - a - 114 * (b + d)) / (b + 1152 * d))
    return {"H": h, "K": k, "tpot": (T - h) / (T * k), "kv": seqs / (NEW * h + seqs * k),
            "b_ttft": b_ttft, "ttft": b_ttft / (NEW * h + b_ttft * k)}


# h100, 8B: a = 16,060,522,496 / 3.35e12 = 4.79419 ms, b = 15,009,316,864 / 989.4e12 =
# 15.1701 us, d = 131,072 / 3.35e12 = 39.126 ns; H = 4.83425 ms, K = 30.9565 ms
# TPOT rate (50 - 4.83425) / (50 x 30.9565) = 29.180 req/s
# KV: pool with 64 seqs = 80e9 - 16,060,522,496 - 226,541,568 (2048 x (2 x 3 x (4096 +
#   14336) + 24)) - 32,833,536 - 1,073,741,824 - 8e9 = 54,606,360,576 B -> 26,038 blocks of
#   2,097,152 B -> 325 sequences of 80 blocks; with 325 seqs' logits (166,732,800 B) the pool
#   is 54,472,461,312 B -> 25,974 blocks -> 324 sequences.
#   KV rate 324 / (256 x 4.83425 + 324 x 30.9565) ms = 28.755 req/s
# TTFT: B <= (50 - 4.79419 - 114 x 0.0152092) ms / (15.1701 us + 1152 x 39.126 ns) = 721.6
#   -> 721, rate 30.606 req/s.  Capacity = min = 28.755 req/s, set by the KV pool.
H100_8B = rates(W8 / 3.35e12, F8 / 989.4e12, KV8 / 3.35e12, 324)
# a100-80gb, 8B: a = 7.87667 ms, b = 48.1068 us, d = 64.2825 ns; the same 80e9 B -> 324 seqs
# TPOT (50 - 7.94249) / (50 x 80.5344) = 10.4446 req/s < KV 11.519 < TTFT 11.450 (B <= 299)
A100_8B = rates(W8 / 2.039e12, F8 / 312e12, KV8 / 2.039e12, 324)
# b200, 8B: a = 2.00757 ms, b = 6.67081 us, d = 16.384 ns; pool 180e9 - ... - 18e9 ->
# 68,953 blocks -> 861 seqs; with 861 seqs' logits -> 68,758 blocks -> 859 sequences.
# TPOT 71.764, KV 71.563 (binding), TTFT 73.255 (B <= 1848) req/s
B200_8B = rates(W8 / 8e12, F8 / 2.25e15, KV8 / 8e12, 859)


def test_llama_8b_on_three_generations_by_hand() -> None:
    sh = build_sheet("capacity", ["Llama-3.1-8B", *BASE, "--gpus", "h100,a100-80gb,b200"])
    for gpu, want, seqs, b_ttft in (("h100", H100_8B, 324, 721), ("a100-80gb", A100_8B, 324, 299),
                                    ("b200", B200_8B, 859, 1848)):
        sec = next(s for s in sh.sections if s.title.startswith(f"{gpu} x 1"))
        got = {ln.name: ln.value for ln in sec.lines}
        assert got["tensor parallel size"] == 1
        assert got["KV ceiling, sequences of 1,280"] == seqs
        assert want["b_ttft"] == b_ttft
        assert got["per-step constant"] == pytest.approx(want["H"], rel=1e-12)
        assert got["per-request load"] == pytest.approx(want["K"], rel=1e-12)
        assert got["rate at the TPOT target"] == pytest.approx(want["tpot"], rel=1e-12)
        assert got["rate at the KV ceiling"] == pytest.approx(want["kv"], rel=1e-12)
        assert got["rate at the TTFT target"] == pytest.approx(want["ttft"], rel=1e-12)
        cap = min(want["tpot"], want["kv"], want["ttft"])
        assert got["replica capacity at the SLO"] == pytest.approx(cap, rel=1e-12)
    assert H100_8B["kv"] == pytest.approx(28.755, abs=1e-3)
    assert A100_8B["tpot"] == pytest.approx(10.4446, abs=1e-4)
    assert B200_8B["kv"] == pytest.approx(71.563, abs=1e-3)
    # units: 1 unit = 28.755 req/s on one h100; a100-80gb 10.4446 / 28.755 = 0.3632,
    # b200 71.563 / 28.755 = 2.4887
    unit = H100_8B["kv"]
    assert sh.line("capacity unit").value == pytest.approx(unit, rel=1e-12)
    assert sh.line("a100-80gb: units per GPU").value == pytest.approx(A100_8B["tpot"] / unit,
                                                                      rel=1e-12)
    assert sh.line("b200: units per GPU").value == pytest.approx(B200_8B["kv"] / unit, rel=1e-12)
    assert sh.line("b200: units per GPU").value == pytest.approx(2.4887, abs=1e-4)
    # at the a100's capacity the step takes the full 50 ms: H / (1 - lambda K) = T
    a100 = next(s for s in sh.sections if s.title.startswith("a100-80gb"))
    step = next(ln for ln in a100.lines if ln.name.startswith("at capacity: step time"))
    assert step.value == pytest.approx(T, rel=1e-12)


def test_purchase_cheapest_mix_and_fleet_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["Llama-3.1-8B", *BASE, "--gpus", "h100,a100-80gb,b200", "--demand-rps", "500",
            "--price", "h100=2.5,a100-80gb=1.5,b200=6"]
    sh = build_sheet("capacity", args)
    # buy for 500 / 0.8 = 625 req/s = 625 / 28.755 = 21.735 units
    assert sh.line("capacity to buy").value == pytest.approx(625)
    # alone: h100 ceil(625 / 28.755) = 22; a100 ceil(625 / 10.4446) = 60; b200
    # ceil(625 / 71.563) = 9
    assert sh.line("h100 alone").value == 22
    assert sh.line("a100-80gb alone").value == 60
    assert sh.line("b200 alone").value == 9
    # $ per req/s-hour: h100 2.5 / 28.755 = 0.08694, a100 1.5 / 10.4446 = 0.14361, b200
    # 6 / 71.563 = 0.08384 (the lowest). Rule: floor(625 / 71.563) = 8 b200, remainder
    # 625 - 8 x 71.563 = 52.499 req/s: h100 ceil(52.499 / 28.755) = 2 x $2.5 = $5, a100
    # 6 x $1.5 = $9, b200 1 x $6 -> 2 h100. 8 x 6 + 2 x 2.5 = $53/h (b200 alone: $54/h).
    assert sh.line("b200: $ per req/s-hour").value == pytest.approx(6 / B200_8B["kv"], rel=1e-12)
    mix = sh.line("cheapest mix")
    assert mix.value == pytest.approx(53.0)
    assert mix.shown.startswith("8 b200 + 2 h100 GPUs")
    # a fleet of 8 h100 + 8 a100: 8 x 28.755 + 8 x 10.4446 = 313.60 req/s; shares 73.36% and
    # 26.64%; at 80% it serves 250.88 req/s < 500: the answer is no (exit 1)
    fleet = build_sheet("capacity", [*args, "--fleet", "h100=8,a100=8"])
    total = 8 * H100_8B["kv"] + 8 * A100_8B["tpot"]
    assert fleet.line("fleet capacity at the SLO").value == pytest.approx(total, rel=1e-12)
    assert fleet.line("h100: share of traffic").value == pytest.approx(
        8 * H100_8B["kv"] / total, rel=1e-12)
    assert fleet.line("h100: share of traffic").value == pytest.approx(0.7336, abs=1e-4)
    assert not fleet.ok
    assert run_tool("capacity", [*args, "--fleet", "h100=8,a100=8"]) == 1
    assert "does NOT serve" in capsys.readouterr().out
    assert run_tool("capacity", [*args, "--fleet", "h100=16,b200=8"]) == 0  # 1032 x 0.8 > 500


def test_llama_70b_auto_tp_and_a_kv_bound_b200() -> None:
    # h100: tp=2 leaves no KV (70,555,025,408 B of weights per GPU against 72e9 usable, before
    # activations and the 1 GiB workspace), tp=4 holds it:
    #   pool = 80e9 - 35,278,831,616 - 188,792,832 (2048 x (2 x (3 x 8192 + 3 x 28672 / 4) +
    #   24)) - 32,833,536 - 1,073,741,824 - 8e9 = 35,425,800,192 -> 27,027 blocks of 1,310,720
    #   -> 337 seqs; with 337 seqs' logits -> 26,920 blocks -> 336 sequences.
    #   a = 35,278,831,616 / 3.35e12 = 10.5310 ms, b = 139,003,428,864 / 4 / 989.4e12 =
    #   35.1232 us, d = 81,920 / 3.35e12 = 24.4537 ns; TPOT 15.1215 < KV 16.608 < TTFT 17.545
    #   -> 15.1215 req/s per replica, 3.7804 per GPU
    # b200 at tp=1: pool = 180e9 - 141,107,412,992 - 453,033,984 - 32,833,536 - 1,073,741,824
    #   - 18e9 = 19,332,977,664 -> 3,687 blocks of 5,242,880 -> 46 sequences (< 64: no raise)
    #   a = 17.6384 ms, b = 61.7793 us, d = 40.96 ns; TPOT 7.0910, KV 46 / (256 x 17.6804 +
    #   46 x 91.1571) ms = 5.2756 req/s (binding), TTFT 9.0362 (B <= 232)
    h100 = rates(W70_TP4 / 3.35e12, F70 / 4 / 989.4e12, KV70 / 4 / 3.35e12, 336)
    b200 = rates(W70 / 8e12, F70 / 2.25e15, KV70 / 8e12, 46)
    sh = build_sheet("capacity", ["Llama-3.3-70B", *BASE, "--gpus", "h100,b200",
                                  "--unit-gpu", "b200"])
    sec = {s.title.split(":")[0]: {ln.name: ln.value for ln in s.lines} for s in sh.sections}
    assert sec["h100 x 4"]["KV ceiling, sequences of 1,280"] == 336
    assert sec["h100 x 4"]["weights per GPU"] == W70_TP4
    assert sec["h100 x 4"]["replica capacity at the SLO"] == pytest.approx(h100["tpot"], rel=1e-12)
    assert sec["b200 x 1"]["KV ceiling, sequences of 1,280"] == 46
    assert sec["b200 x 1"]["replica capacity at the SLO"] == pytest.approx(b200["kv"], rel=1e-12)
    assert b200["kv"] == pytest.approx(5.2756, abs=1e-4)
    # unit = one b200 = 5.2756 req/s; an h100 is worth (15.1215 / 4) / 5.2756 = 0.7166 units,
    # an h100 replica (4 GPUs) 2.866 of them: its routing weight
    unit = b200["kv"]
    assert sh.line("h100: units per GPU").value == pytest.approx(h100["tpot"] / 4 / unit, rel=1e-12)
    assert sh.line("h100: units per GPU").value == pytest.approx(0.7166, abs=1e-4)
    assert sh.line("h100: routing weight per replica").value == pytest.approx(h100["tpot"] / unit,
                                                                              rel=1e-12)
    # --tp 8 on the h100 is taken as given
    tp8 = build_sheet("capacity", ["Llama-3.3-70B", *BASE, "--gpus", "h100", "--tp", "8"])
    assert tp8.sections[0].title.startswith("h100 x 8")


def test_no_answer_when_the_unit_gpu_cannot_meet_the_slo(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    # 141 GB of 70B weights on one a100-40gb: no KV at all -> no unit (exit 1)
    assert run_tool("capacity", ["Llama-3.3-70B", *BASE, "--gpus", "a100-40gb", "--tp", "1"]) == 1
    assert "cannot meet the SLO" in capsys.readouterr().out
    # a 6 ms TPOT: the a100's weight read alone takes 7.88 ms -> 0 units, the h100 (4.79 ms)
    # still meets it at (6 - 4.83425) / (6 x 30.9565) ms = 6.276 req/s: a warning, and the
    # unit is the h100's
    sh = build_sheet("capacity", ["Llama-3.1-8B", "--slo-tpot-ms", "6", "--slo-ttft-ms", "500",
                                  "--gpus", "h100,a100-80gb"])
    assert sh.ok and any("a100-80gb: cannot meet the SLO" in w for w in sh.warnings)
    assert sh.line("a100-80gb: units per GPU").value == 0
    assert sh.line("capacity unit").value == pytest.approx(
        (0.006 - H100_8B["H"]) / (0.006 * H100_8B["K"]), rel=1e-12)
    # a 32k prompt on an idle h100: cap(0) = floor((50 - 4.79419) ms / 15.2092 us) = 2972
    # tokens a step, 9 steps = 26,748 < 32,768: TTFT missed even at no load
    idle = build_sheet("capacity", ["Llama-3.1-8B", *BASE, "--prompt-tokens", "32k"])
    assert not idle.ok and "TTFT" in idle.verdict


def test_json_and_explain(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["Llama-3.1-8B", *BASE, "--gpus", "h100,b200", "--demand-rps", "100"]
    assert run_tool("capacity", [*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"]["unit_rps"] == pytest.approx(H100_8B["kv"], rel=1e-12)
    assert out["data"]["b200"]["binding"] == "KV pool"
    assert run_tool("capacity", [*args, "--explain"]) == 0
    assert "arithmetic" in capsys.readouterr().out
    sh = build_sheet("capacity", args)
    assert all(ln.formula and ln.explain for sec in sh.sections for ln in sec.lines)


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "h100,h900"], "unknown GPU 'h900'"),
    (["--slo-ttft-ms", "80"], "--slo-ttft-ms 80 must be at least 2 x --slo-tpot-ms"),
    (["--slo-tpot-ms", "0"], "--slo-tpot-ms must be > 0"),
    (["--unit-gpu", "b200"], "--unit-gpu b200 is not one of --gpus"),
    (["--demand-rps", "0"], "--demand-rps must be > 0"),
    (["--demand-rps", "10", "--price", "b200=3"], "--price b200: not one of --gpus"),
    (["--demand-rps", "10", "--price", "h100=-1"], "--price h100 must be > 0"),
    (["--demand-rps", "10", "--price", "h100"], "--price: cannot read 'h100'"),
    (["--tp", "3"], "--tp 3 does not divide the 32 attention heads"),
    (["--utilization", "1.5"], "--utilization must be strictly between 0 and 1"),
    (["--fleet", "b200=4"], "--fleet b200=4: name a GPU of --gpus"),
    (["--prompt-tokens", "0"], "must be a positive whole number"),
])
def test_bad_input_exits_2_naming_the_problem(capsys: pytest.CaptureFixture[str],
                                              args: list[str], message: str) -> None:
    assert run_tool("capacity", ["Llama-3.1-8B", *BASE, *args]) == 2
    assert message in capsys.readouterr().err


def test_unknown_model_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("capacity", ["nope-7b", *BASE]) == 2
    assert "unknown model 'nope-7b'" in capsys.readouterr().err
