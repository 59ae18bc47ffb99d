"""`fitserve plan canary`: sample sizes checked against hand arithmetic and textbook figures,
the latency-percentile conversion, the staged rollout, exit codes and bad input.

    n = (z_{1-a} sqrt(2 pbar qbar) + z_{1-b} sqrt(p1 q1 + p2 q2))^2 / (p2 - p1)^2

Normal quantiles used by hand (to 7 places): z_0.995 = 2.5758293, z_0.975 = 1.9599640,
z_0.95 = 1.6448536, z_0.99 = 2.3263479, z_0.9 = 1.2815516, z_0.8 = 0.8416212.
"""

from __future__ import annotations

import json

import pytest

from fitserve.tools.sheets.canary import lognormal_exceedance, sample_size
from fitserve.tools.sheets.sheet import build_sheet, run_tool

BRIEF = ["--baseline-rate", "0.02", "--regression-rate", "0.025", "--alpha", "0.01",
         "--power", "0.9"]


def test_two_percent_to_two_and_a_half_two_sided_alpha_001_power_09() -> None:
    # pbar = 0.0225, 2 pbar qbar = 2 x 0.0225 x 0.9775 = 0.0439875, sqrt = 0.2097320
    # p1 q1 + p2 q2 = 0.0196 + 0.024375 = 0.043975, sqrt = 0.2097022
    # z-sum = 2.5758293 x 0.2097320 + 1.2815516 x 0.2097022 = 0.5402339 + 0.2687442 = 0.8089781
    # n = 0.8089781^2 / 0.005^2 = 0.6544456 / 0.000025 = 26,177.8 -> 26,178 per arm
    # (Fleiss' continuity correction: n/4 (1 + sqrt(1 + 4 / (n x 0.005)))^2 = 26,576.3 -> 26,577)
    sh = build_sheet("canary", BRIEF)
    assert sh.line("z for alpha 0.01 (two-sided)").value == pytest.approx(2.5758293, abs=1e-7)
    assert sh.line("z for power 0.9").value == pytest.approx(1.2815516, abs=1e-7)
    assert sh.line("pooled rate").value == pytest.approx(0.0225)
    assert sh.line("requests per arm").value == 26_178
    assert sh.data["n_exact"] == pytest.approx(26_177.8, abs=0.05)
    assert sh.line("with continuity correction").value == 26_577
    assert sh.line("requests in both arms").value == 2 * 26_178


def test_textbook_ten_versus_fifteen_percent() -> None:
    # The classic textbook case: p1 = 0.10, p2 = 0.15, two-sided alpha 0.05, power 0.8 needs
    # 686 per group (725 with Fleiss' continuity correction):
    # pbar = 0.125: sqrt(2 x 0.125 x 0.875) = sqrt(0.21875) = 0.4677072
    # sqrt(0.09 + 0.1275) = sqrt(0.2175) = 0.4663690
    # (1.9599640 x 0.4677072 + 0.8416212 x 0.4663690)^2 / 0.05^2
    #   = (0.9166892 + 0.3925062)^2 / 0.0025 = 1.3091954^2 / 0.0025 = 685.6 -> 686
    ss = sample_size(0.10, 0.15, alpha=0.05, power=0.8)
    assert ss.n_exact == pytest.approx(685.6, abs=0.05)
    assert ss.n == 686
    assert ss.n_fleiss == 726  # 725.05, rounded up
    # one-sided at 0.05 (z 1.6448536): (1.6448536 x 0.4677072 + 0.3925062)^2 / 0.0025
    #   = (0.7693093 + 0.3925062)^2 / 0.0025 = 1.1618155^2 / 0.0025 = 539.93 -> 540
    sh = build_sheet("canary", ["--baseline-rate", "0.10", "--regression-rate", "0.15",
                                "--one-sided"])
    assert sh.line("requests per arm").value == 540
    assert sh.line("z for alpha 0.05 (one-sided)").value == pytest.approx(1.6448536, abs=1e-7)


def test_direction_does_not_change_a_two_sided_size() -> None:
    # n is symmetric in (p1, p2): a drop from 2.5% to 2% needs the same 26,178
    assert sample_size(0.025, 0.02, alpha=0.01, power=0.9).n == 26_178


def test_latency_p99_regression_as_an_exceedance_rate() -> None:
    # p99 800 ms -> 1000 ms, sigma 0.5 (the default): every latency x1.25, so the share over
    # the old p99 is 1 - Phi(z_0.99 - ln(1.25) / 0.5) = 1 - Phi(2.3263479 - 0.4462871)
    # = 1 - Phi(1.8800608) = 1 - 0.9699501 = 0.0300499; baseline 0.01.
    # n two-sided alpha 0.05 power 0.8: pbar = 0.02002495
    #   sqrt(2 x 0.02002495 x 0.97997505) = 0.1981106; sqrt(0.0099 + 0.0291469) = 0.1976029
    #   (1.9599640 x 0.1981106 + 0.8416212 x 0.1976029)^2 / 0.0200499^2
    #   = (0.3882897 + 0.1663068)^2 / 0.00040200 = 0.3075776 / 0.00040200 = 765.1 -> 766
    args = ["--metric", "latency", "--baseline-p99-ms", "800", "--regression-p99-ms", "1000"]
    sh = build_sheet("canary", args)
    assert sh.line("baseline exceedance").value == pytest.approx(0.01)
    assert sh.line("canary exceedance").value == pytest.approx(0.0300499, abs=1e-7)
    assert sh.line("requests per arm").value == 766
    # sigma from a median: ln(800 / 250) / z_0.99 = 1.1631508 / 2.3263479 = 0.5000 (the same)
    sh50 = build_sheet("canary", [*args, "--baseline-p50-ms", "250"])
    assert sh50.line("lognormal sigma").value == pytest.approx(0.4999900, abs=1e-6)
    # a wider spread makes the same p99 shift rarer to see: sigma 1.0 ->
    # 1 - Phi(2.3263479 - 0.2231436) = 1 - Phi(2.1032043) = 0.0177240
    assert lognormal_exceedance(1.25, 1.0, 99) == pytest.approx(0.0177240, abs=1e-6)
    # the exceedance given directly: 0.01 -> 0.02 is p1 = 0.01, p2 = 0.02
    direct = build_sheet("canary", ["--metric", "latency", "--exceedance-rate", "0.02"])
    assert direct.line("canary exceedance").value == 0.02
    assert direct.line("requests per arm").value == sample_size(0.01, 0.02, alpha=0.05,
                                                                power=0.8).n


def test_staged_rollout_times() -> None:
    # n = 26,178 per arm at 200 req/s: stage f waits for min(f, 1 - f) x 200 req/s per arm
    #   1%: 26,178 / 2 = 13,089 s;  5%: 26,178 / 10 = 2,617.8 s;  25%: 26,178 / 50 = 523.56 s
    #   100%: no control arm, no test. In all 16,230.36 s = 4.51 h
    # extra bad requests if the regression is real: 26,178 x 0.005 = 130.89 per stage;
    # false alarm over 3 gates at 0.01: 1 - 0.99^3 = 0.029701
    sh = build_sheet("canary", [*BRIEF, "--traffic-rps", "200"])
    assert sh.line("stage 1%: time to n per arm").value == pytest.approx(13_089)
    assert sh.line("stage 5%: time to n per arm").value == pytest.approx(2_617.8)
    assert sh.line("stage 25%: time to n per arm").value == pytest.approx(523.56)
    assert sh.line("stage 100%").shown == "full rollout"
    assert sh.line("gated stages, in all").value == pytest.approx(16_230.36)
    assert sh.line("extra bad requests per stage if real").value == pytest.approx(130.89)
    assert sh.line("false alarm over the gates").value == pytest.approx(0.029701)
    # past half the traffic the control arm is the smaller: 60% -> 26,178 / (0.4 x 200)
    sh60 = build_sheet("canary", [*BRIEF, "--traffic-rps", "200", "--stages", "60"])
    assert sh60.line("stage 60%: time to n per arm").value == pytest.approx(327.225)


def test_exit_codes_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("canary", [*BRIEF, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"]["n_per_arm"] == 26_178
    # 4.51 h of gated stages: within 5 h (0), over 4 h (1)
    assert run_tool("canary", [*BRIEF, "--traffic-rps", "200", "--max-rollout-hours", "5"]) == 0
    capsys.readouterr()
    assert run_tool("canary", [*BRIEF, "--traffic-rps", "200", "--max-rollout-hours", "4"]) == 1
    assert "OVER" in capsys.readouterr().out
    assert run_tool("canary", [*BRIEF, "--traffic-rps", "200", "--explain"]) == 0
    assert "arithmetic" in capsys.readouterr().out
    sh = build_sheet("canary", [*BRIEF, "--traffic-rps", "200"])
    assert all(ln.formula and ln.explain for sec in sh.sections for ln in sec.lines)


@pytest.mark.parametrize(("args", "message"), [
    (["--power", "1"], "--power must be strictly between 0 and 1"),
    (["--power", "0"], "--power must be strictly between 0 and 1"),
    (["--power", "1.5"], "--power must be strictly between 0 and 1"),
    (["--power", "0.004"], "--power 0.004 must exceed"),
    (["--alpha", "0"], "--alpha must be strictly between 0 and 1"),
    (["--alpha", "1.2"], "--alpha must be strictly between 0 and 1"),
    (["--regression-rate", "0.02"], "--regression-rate equals --baseline-rate"),
    (["--baseline-rate", "1.5"], "--baseline-rate must be strictly between 0 and 1"),
    (["--traffic-rps", "0"], "--traffic-rps must be > 0"),
    (["--traffic-rps", "10", "--stages", "0,50"], "--stages: each share must be in (0, 100]"),
    (["--max-rollout-hours", "3"], "--max-rollout-hours needs --traffic-rps"),
])
def test_bad_input_exits_2_naming_the_problem(capsys: pytest.CaptureFixture[str],
                                              args: list[str], message: str) -> None:
    # later flags override BRIEF's
    assert run_tool("canary", [*BRIEF, *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--baseline-p99-ms", "800", "--regression-p99-ms", "800"], "nothing to detect"),
    (["--baseline-p99-ms", "800"], "needs --baseline-p99-ms and --regression-p99-ms"),
    (["--baseline-p99-ms", "0", "--regression-p99-ms", "900"], "--baseline-p99-ms must be > 0"),
    (["--exceedance-rate", "0.01"], "nothing to detect"),
    (["--exceedance-rate", "2"], "--exceedance-rate must be strictly between 0 and 1"),
    (["--percentile", "100", "--exceedance-rate", "0.1"], "--percentile must be strictly"),
    (["--baseline-p99-ms", "800", "--regression-p99-ms", "900", "--sigma", "0"],
     "--sigma must be > 0"),
])
def test_bad_latency_input_exits_2(capsys: pytest.CaptureFixture[str], args: list[str],
                                   message: str) -> None:
    assert run_tool("canary", ["--metric", "latency", *args]) == 2
    assert message in capsys.readouterr().err
