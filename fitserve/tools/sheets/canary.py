"""`fitserve plan canary`: requests per arm to detect a regression, and the staged rollout.

A rate (errors, timeouts, refusals): the two-proportion z-test's sample size per arm, with
pbar = (p1 + p2) / 2 and q = 1 - p,

    n = (z_{1-a} sqrt(2 pbar qbar) + z_{1-b} sqrt(p1 q1 + p2 q2))^2 / (p2 - p1)^2

where a = alpha / 2 for a two-sided test (a regression in either direction) and alpha for a
one-sided one, b = 1 - power. A latency percentile becomes a rate: the fraction of requests
slower than the baseline's p-th percentile x_p is 1 - p in the baseline arm; in the canary arm
it is what the regression implies. Assumed (stated on the sheet): latency is lognormal with
log-space spread sigma, and the regression scales every latency by r = new p-th / old p-th
(same sigma), so

    exceedance = P(L_new > x_p) = 1 - Phi(z_p - ln(r) / sigma)

or give the canary's exceedance directly (--exceedance-rate). The same n then applies.

A staged rollout (1% -> 5% -> 25% -> 100%) gates each stage below 100% on its own test: it
holds until both arms have n requests; at canary share f of R requests/s the smaller arm
fills at min(f, 1 - f) R, so the stage takes n / (min(f, 1 - f) R).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from statistics import NormalDist

from fitserve.ledger.errors import PlanError
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.sheets._rates import fmt_duration, number_list, open_fraction, positive
from fitserve.tools.sheets.sheet import Sheet

NORMAL = NormalDist()
DEFAULT_SIGMA = 0.5  # lognormal log-space spread: p99 / p50 = exp(2.326 x 0.5) = 3.2
DEFAULT_STAGES = "1,5,25,100"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metric", choices=["rate", "latency"], default="rate",
                   help="rate: a fraction of bad requests; latency: a percentile (default rate)")
    p.add_argument("--baseline-rate", type=float, default=None,
                   help="the baseline's rate, a fraction (0.02 = 2%% of requests)")
    p.add_argument("--regression-rate", type=float, default=None,
                   help="the canary's rate to detect (the regression's size)")
    p.add_argument("--alpha", type=float, default=0.05,
                   help="false-alarm probability of one test (default 0.05)")
    p.add_argument("--power", type=float, default=0.8,
                   help="probability of catching a regression of that size (default 0.8)")
    p.add_argument("--one-sided", action="store_true",
                   help="test only the regression's direction (default: two-sided)")
    p.add_argument("--percentile", type=float, default=99.0,
                   help="latency percentile p, in percent (default 99)")
    p.add_argument("--baseline-p99-ms", type=float, default=None,
                   help="the baseline's latency at --percentile, ms")
    p.add_argument("--regression-p99-ms", type=float, default=None,
                   help="the canary's latency at --percentile to detect, ms")
    p.add_argument("--sigma", type=float, default=None,
                   help=f"lognormal log-space spread of latency (default {DEFAULT_SIGMA}, or "
                        f"from --baseline-p50-ms)")
    p.add_argument("--baseline-p50-ms", type=float, default=None,
                   help="the baseline's median latency, ms: sigma = ln(x_p / x_50) / z_p")
    p.add_argument("--exceedance-rate", type=float, default=None,
                   help="the canary's fraction of requests over the baseline's p-th "
                        "percentile, given directly (no distribution assumed)")
    p.add_argument("--traffic-rps", type=float, default=None,
                   help="requests/s of the whole service (times each stage)")
    p.add_argument("--stages", default=DEFAULT_STAGES,
                   help=f"canary shares in percent, in order (default {DEFAULT_STAGES})")
    p.add_argument("--max-rollout-hours", type=float, default=None,
                   help="answer 'no' (exit 1) if the gated stages need longer")


@dataclass(frozen=True)
class SampleSize:
    """The two-proportion z-test's requests per arm, and its parts."""

    p1: float
    p2: float
    alpha: float
    power: float
    two_sided: bool
    z_alpha: float  # z_{1 - alpha/2} (two-sided) or z_{1 - alpha}
    z_beta: float  # z_{power}
    pbar: float
    n_exact: float

    @property
    def n(self) -> int:
        return math.ceil(self.n_exact - 1e-9)

    @property
    def n_fleiss(self) -> int:
        """With Fleiss' continuity correction: n/4 (1 + sqrt(1 + 4 / (n |p2 - p1|)))^2."""
        d = abs(self.p2 - self.p1)
        return math.ceil(self.n_exact / 4 * (1 + math.sqrt(1 + 4 / (self.n_exact * d))) ** 2)


def sample_size(p1: float, p2: float, *, alpha: float, power: float,
                two_sided: bool = True) -> SampleSize:
    """Requests per arm to tell rate ``p2`` from ``p1`` (see the module docstring)."""
    open_fraction("--alpha", alpha)
    open_fraction("--power", power)
    tail = alpha / 2 if two_sided else alpha
    if power <= tail:
        raise PlanError(f"--power {power:g} must exceed the test's false-alarm tail "
                        f"{tail:g}: a test that catches less often than it false-alarms "
                        f"detects nothing")
    if math.isclose(p1, p2, rel_tol=1e-9, abs_tol=1e-15):
        raise PlanError(f"the regression equals the baseline ({p1:g}): there is no difference "
                        f"to detect")
    za, zb = NORMAL.inv_cdf(1 - tail), NORMAL.inv_cdf(power)
    pbar = (p1 + p2) / 2
    num = za * math.sqrt(2 * pbar * (1 - pbar)) + zb * math.sqrt(p1 * (1 - p1) + p2 * (1 - p2))
    return SampleSize(p1, p2, alpha, power, two_sided, za, zb, pbar, num**2 / (p2 - p1) ** 2)


def lognormal_exceedance(ratio: float, sigma: float, percentile: float) -> float:
    """P(new latency > old p-th percentile) when every latency is scaled by ``ratio``."""
    zp = NORMAL.inv_cdf(percentile / 100)
    return 1 - NORMAL.cdf(zp - math.log(ratio) / sigma)


def _latency_rates(args: argparse.Namespace) -> tuple[float, float, list[Line], list[str]]:
    """(p1, p2, the lines that derive them, notes) for --metric latency."""
    pct = args.percentile
    if not (math.isfinite(pct) and 0 < pct < 100):
        raise PlanError(f"--percentile must be strictly between 0 and 100, got {pct:g}")
    p1 = (100 - pct) / 100
    zp = NORMAL.inv_cdf(pct / 100)
    lines = [Line("baseline exceedance", "1 - p", p1, f"{p1:.4%}",
                  f"1 - {pct:g}%: by definition of the baseline's p{pct:g}")]
    if args.exceedance_rate is not None:
        p2 = open_fraction("--exceedance-rate", args.exceedance_rate)
        lines.append(Line("canary exceedance", "--exceedance-rate", p2, f"{p2:.4%}",
                          "given: no latency distribution assumed"))
        return p1, p2, lines, []
    if args.baseline_p99_ms is None or args.regression_p99_ms is None:
        raise PlanError("--metric latency needs --baseline-p99-ms and --regression-p99-ms "
                        "(latencies at --percentile), or --exceedance-rate")
    x0 = positive("--baseline-p99-ms", args.baseline_p99_ms)
    x1 = positive("--regression-p99-ms", args.regression_p99_ms)
    if args.sigma is not None:
        sigma, how = positive("--sigma", args.sigma), "--sigma"
    elif args.baseline_p50_ms is not None:
        x50 = positive("--baseline-p50-ms", args.baseline_p50_ms)
        if pct <= 50 or x50 >= x0:
            raise PlanError(f"--baseline-p50-ms {x50:g} needs a percentile above 50 and a "
                            f"median below the p{pct:g} ({x0:g} ms)")
        sigma = math.log(x0 / x50) / zp
        how = f"ln({x0:g} / {x50:g}) / {zp:.4f}"
    else:
        sigma, how = DEFAULT_SIGMA, "default (p99/p50 = 3.2)"
    r = x1 / x0
    p2 = lognormal_exceedance(r, sigma, pct)
    lines += [
        Line("latency ratio", "r = new x_p / old x_p", r, f"x{r:.4g}", f"{x1:g} ms / {x0:g} ms"),
        Line("lognormal sigma", "sigma", sigma, f"{sigma:.4g}", how),
        Line("canary exceedance", "1 - Phi(z_p - ln r / sigma)", p2, f"{p2:.4%}",
             f"1 - Phi({zp:.4f} - ln({r:.4g}) / {sigma:.4g}) = 1 - Phi("
             f"{zp - math.log(r) / sigma:.4f})"),
    ]
    notes = [f"assumed: latency lognormal with log-space sigma {sigma:.4g}, the regression "
             f"multiplying every latency by {r:.4g} (same shape); the test counts requests "
             f"slower than the baseline's p{pct:g} = {x0:g} ms in each arm"]
    return p1, p2, lines, notes


def _test_lines(ss: SampleSize) -> list[Line]:
    side = "two-sided" if ss.two_sided else "one-sided"
    tail = f"1 - {ss.alpha:g}/2" if ss.two_sided else f"1 - {ss.alpha:g}"
    p1, p2, pb = ss.p1, ss.p2, ss.pbar
    return [
        Line(f"z for alpha {ss.alpha:g} ({side})", "z_{1-a}", ss.z_alpha, f"{ss.z_alpha:.4f}",
             f"inverse normal CDF at {tail}"),
        Line(f"z for power {ss.power:g}", "z_{1-b}", ss.z_beta, f"{ss.z_beta:.4f}",
             f"inverse normal CDF at {ss.power:g}"),
        Line("pooled rate", "pbar = (p1 + p2) / 2", pb, f"{pb:.5g}", f"({p1:g} + {p2:g}) / 2"),
        Line("requests per arm", "n = (z_{1-a} sqrt(2 pbar qbar) + z_{1-b} sqrt(p1 q1 + p2 q2))^2 "
             "/ (p2 - p1)^2", ss.n, f"{ss.n:,}",
             f"({ss.z_alpha:.4f} x sqrt(2 x {pb:.5g} x {1 - pb:.5g}) + {ss.z_beta:.4f} x "
             f"sqrt({p1:g} x {1 - p1:g} + {p2:g} x {1 - p2:g}))^2 / ({p2:g} - {p1:g})^2 = "
             f"{ss.n_exact:,.1f}, rounded up"),
        Line("with continuity correction", "n/4 (1 + sqrt(1 + 4 / (n |p2 - p1|)))^2",
             ss.n_fleiss, f"{ss.n_fleiss:,}",
             f"Fleiss: {ss.n_exact:,.1f} / 4 x (1 + sqrt(1 + 4 / ({ss.n_exact:,.1f} x "
             f"{abs(p2 - p1):g})))^2 (the tables' figure; exact binomial tests need about it)"),
        Line("requests in both arms", "2 n", 2 * ss.n, f"{2 * ss.n:,}", f"2 x {ss.n:,}"),
    ]


def _stages(text: str) -> list[float]:
    stages = number_list("--stages", text)
    for s in stages:
        if not (0 < s <= 100):
            raise PlanError(f"--stages: each share must be in (0, 100] percent, got {s:g}")
    return stages


def _rollout(ss: SampleSize, stages: list[float], rps: float, alpha: float
             ) -> tuple[Section, float]:
    lines: list[Line] = []
    total, gated = 0.0, 0
    for pct in stages:
        f = pct / 100
        if f >= 1:
            lines.append(Line(f"stage {pct:g}%", "no control arm", None, "full rollout",
                              "every request on the canary: nothing left to compare with"))
            continue
        arm = min(f, 1 - f)
        t = ss.n / (arm * rps)
        total += t
        gated += 1
        lines.append(Line(f"stage {pct:g}%: time to n per arm", "n / (min(f, 1 - f) R)", t,
                          fmt_duration(t), f"{ss.n:,} / (min({f:g}, {1 - f:g}) x {rps:g} "
                          f"req/s) = {t:,.0f} s; canary arm {f * rps:g} req/s"))
    extra = ss.n * (ss.p2 - ss.p1)
    fa = 1 - (1 - alpha) ** gated
    lines += [
        Line("gated stages, in all", "sum of stage times", total, fmt_duration(total),
             f"{gated} stage(s) each collecting {ss.n:,} requests per arm"),
        Line("extra bad requests per stage if real", "n (p2 - p1)", extra, f"{extra:,.1f}",
             f"{ss.n:,} x ({ss.p2:g} - {ss.p1:g}): the price of each look"),
        Line("false alarm over the gates", "1 - (1 - alpha)^k", fa, f"{fa:.2%}",
             f"1 - (1 - {alpha:g})^{gated}: each gate tested on its own at alpha"),
    ]
    return Section(f"Staged rollout at {rps:g} req/s", tuple(lines)), total


def build(args: argparse.Namespace) -> Sheet:
    notes: list[str] = []
    if args.metric == "rate":
        if args.baseline_rate is None or args.regression_rate is None:
            raise PlanError("--metric rate needs --baseline-rate and --regression-rate")
        p1 = open_fraction("--baseline-rate", args.baseline_rate)
        p2 = open_fraction("--regression-rate", args.regression_rate)
        if math.isclose(p1, p2, rel_tol=1e-9, abs_tol=1e-15):
            raise PlanError(f"--regression-rate equals --baseline-rate ({p1:g}): nothing to "
                            f"detect")
        rate_lines = [Line("baseline rate", "p1", p1, f"{p1:.4%}", "--baseline-rate"),
                      Line("regression rate", "p2", p2, f"{p2:.4%}", "--regression-rate")]
    else:
        p1, p2, rate_lines, notes = _latency_rates(args)
        if math.isclose(p1, p2, rel_tol=1e-9, abs_tol=1e-15):
            raise PlanError(f"the canary's exceedance equals the baseline's 1 - p = {p1:g} "
                            f"(--exceedance-rate, or --regression-p99-ms equal to "
                            f"--baseline-p99-ms): nothing to detect")
    ss = sample_size(p1, p2, alpha=args.alpha, power=args.power, two_sided=not args.one_sided)
    stages = _stages(args.stages)
    side = "two-sided" if ss.two_sided else "one-sided"
    if not ss.two_sided and p2 < p1:
        notes.append("one-sided toward a lower rate: the test looks only for a decrease")
    sections = [Section(f"Two-proportion z-test ({side}), alpha {ss.alpha:g}, power "
                        f"{ss.power:g}", (*rate_lines, *_test_lines(ss)), tuple(notes))]
    ok, total = True, None
    verdict = f"{ss.n:,} requests per arm ({side}, alpha {ss.alpha:g}, power {ss.power:g})"
    if args.traffic_rps is not None:
        sec, total = _rollout(ss, stages, positive("--traffic-rps", args.traffic_rps), ss.alpha)
        sections.append(sec)
        verdict += f"; gated stages take {fmt_duration(total)}"
        if args.max_rollout_hours is not None:
            limit = positive("--max-rollout-hours", args.max_rollout_hours) * 3600
            ok = total <= limit
            verdict += f" ({'within' if ok else 'OVER'} {fmt_duration(limit)})"
    elif args.max_rollout_hours is not None:
        raise PlanError("--max-rollout-hours needs --traffic-rps to time the stages")
    title = (f"fitserve plan canary: {args.metric} {p1:.4g} -> {p2:.4g}, stages "
             f"{' -> '.join(f'{s:g}%' for s in stages)}")
    # NOTE: stages, n_per_arm and stage_s (each stage's time at --traffic-rps; None for 100%)
    # are what POST /fleet/canary takes as its "plan" (fitserve.fleet.canary)
    rps = args.traffic_rps
    stage_s = None if rps is None else [None if p >= 100 else ss.n / (min(p, 100 - p) / 100 * rps)
                                        for p in stages]
    data: dict[str, object] = {"n_per_arm": ss.n, "n_exact": ss.n_exact, "p1": p1, "p2": p2,
                               "rollout_s": total, "stages": stages, "stage_s": stage_s}
    return Sheet(title, tuple(sections), (), verdict, ok, data)
