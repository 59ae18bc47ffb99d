"""The step-time model: fitting, error, what it implies, roofline coefficients, files on disk.

Pure: synthetic timings with known coefficients, hand-computed numbers, no engine.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.params import count_params
from fitserve.ledger.step_time import (
    FitError,
    StepSample,
    StepShape,
    StepTimeModel,
    fit_error,
    fit_step_model,
    load_step_model,
    predicted_knee,
    roofline_step_model,
    save_step_model,
    split_held_out,
)
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.model_source import catalog_entry

TRUE = StepTimeModel(a=2e-3, b=5e-5, c=3e-4, d=2e-7)


def sweep_shapes() -> list[StepShape]:
    """Decodes of several batches and contexts, prompt chunks, mixed steps: all four terms vary."""
    shapes = [StepShape(b, b, b * ctx) for b in (1, 2, 4, 8, 16, 32) for ctx in (32, 512, 2048)]
    shapes += [StepShape(n, 1, n) for n in (16, 64, 256, 1024)]
    shapes += [StepShape(n, 1, 1024 + n) for n in (16, 256)]  # chunks after a cached prefix
    shapes += [StepShape(8 + n, 9, 8 * 600 + n) for n in (64, 512)]  # decodes + a prompt chunk
    return shapes


def timed(model: StepTimeModel, shapes: list[StepShape], noise: float = 0.0,
          seed: int = 0) -> list[StepSample]:
    rng = random.Random(seed)
    return [StepSample(s, model.predict_shape(s) * (1 + rng.gauss(0, noise))) for s in shapes]


def coefs(m: StepTimeModel) -> tuple[float, float, float, float]:
    return (m.a, m.b, m.c, m.d)


# ------------------------------------------------------------------------------------ fitting


def test_fit_recovers_known_coefficients_exactly_without_noise() -> None:
    fitted = fit_step_model(timed(TRUE, sweep_shapes()), source="synthetic")
    assert coefs(fitted) == pytest.approx(coefs(TRUE), rel=1e-8)
    assert fitted.source == "synthetic"
    assert fit_error(fitted, timed(TRUE, sweep_shapes())).max_rel < 1e-8


def test_fit_with_seeded_noise_is_within_tolerance() -> None:
    samples = timed(TRUE, sweep_shapes() * 8, noise=0.01, seed=7)
    fit, held = split_held_out(samples)
    fitted = fit_step_model(fit)
    for got, want in zip(coefs(fitted), coefs(TRUE), strict=True):
        assert got == pytest.approx(want, rel=0.05)
    err = fit_error(fitted, held)
    assert err.median_rel < 0.02 and err.p90_rel < 0.03


def _loss_gradient(m: StepTimeModel, samples: list[StepSample]) -> list[float]:
    """d/dcoef of sum ((pred - t) / t)^2."""
    grad = [0.0] * 4
    for s in samples:
        r = (m.predict_shape(s.shape) - s.seconds) / s.seconds
        x = (1.0, s.shape.new_tokens, s.shape.seqs, s.shape.kv_tokens_read)
        for i in range(4):
            grad[i] += 2 * r * x[i] / s.seconds
    return grad


def test_fit_keeps_coefficients_non_negative_where_least_squares_goes_negative() -> None:
    import numpy as np

    # more sequences make these steps *faster*: unconstrained least squares fits c < 0
    shapes = sweep_shapes()
    samples = [StepSample(s, 0.02 + 1e-4 * s.new_tokens - 4e-4 * s.seqs + 1e-7 * s.kv_tokens_read
                          + 4e-4 * 33) for s in shapes]
    x = np.array([[1, s.shape.new_tokens, s.shape.seqs, s.shape.kv_tokens_read] for s in samples], float)
    t = np.array([s.seconds for s in samples])
    ols = np.linalg.lstsq(x / t[:, None], np.ones_like(t), rcond=None)[0]
    assert ols[2] < 0  # the premise: plain least squares wants a negative per-sequence cost

    fitted = fit_step_model(samples)
    assert all(v >= 0 for v in coefs(fitted)) and fitted.c == 0
    # KKT of the non-negative problem: zero gradient on the free coefficients, >= 0 on the
    # ones held at 0 (moving them up would only raise the loss)
    grad = _loss_gradient(fitted, samples)
    scale = [max(abs(v) for v in col) for col in zip(*x / t[:, None], strict=True)]
    for v, g, sc in zip(coefs(fitted), grad, scale, strict=True):
        if v > 0:
            assert abs(g) <= 1e-6 * sc * len(samples)
        else:
            assert g >= -1e-9 * sc * len(samples)


def test_fit_needs_four_timed_steps() -> None:
    samples = timed(TRUE, sweep_shapes()[:3])
    with pytest.raises(PlanError, match="at least 4 timed steps, got 3"):
        fit_step_model(samples)
    # steps with no positive time do not count
    zeroed = [StepSample(s.shape, 0.0) for s in timed(TRUE, sweep_shapes()[3:6])]
    with pytest.raises(PlanError, match="got 3"):
        fit_step_model(samples + zeroed)


def test_fit_with_one_sequence_per_step_holds_c_at_zero() -> None:
    """max_num_seqs 1: every step has seqs == 1, so c folds into a (exact at seqs == 1)."""
    shapes = [StepShape(n, 1, kv) for n in (1, 16, 64, 256) for kv in (n, 512 + n, 2048 + n)]
    fitted = fit_step_model(timed(TRUE, shapes))
    assert fitted.c == 0
    assert (fitted.a, fitted.b, fitted.d) == pytest.approx((TRUE.a + TRUE.c, TRUE.b, TRUE.d),
                                                           rel=1e-8)
    # still refused when the other terms are not determined either
    with pytest.raises(PlanError, match="span 3 of the 4 terms"):
        fit_step_model(timed(TRUE, [StepShape(1, 1, kv) for kv in (64, 512, 2048, 4096)]))


@pytest.mark.parametrize("shapes", [
    [StepShape(1, 1, 100)] * 6,  # all alike
    [StepShape(b, b, b * 100) for b in range(1, 9)],  # decodes at one context: b, c, d collinear
    [StepShape(b, b, b * ctx) for b in (1, 4, 16) for ctx in (64, 512)],  # decodes only: b = c
])
def test_fit_rejects_shapes_that_do_not_determine_the_model(shapes: list[StepShape]) -> None:
    with pytest.raises(PlanError, match="do not determine"):
        fit_step_model(timed(TRUE, shapes))


# ------------------------------------------------------------------------------------- error


def test_fit_error_on_a_hand_computed_example() -> None:
    flat = StepTimeModel(a=0.010, b=0.0, c=0.0, d=0.0)
    shape = StepShape(1, 1, 1)
    samples = [StepSample(shape, t) for t in (0.010, 0.008, 0.0125, 0.020)]
    # |0.010 - t| / t = 0, 0.25, 0.2, 0.5 -> sorted 0, 0.2, 0.25, 0.5; abs ms 0, 2, 2.5, 10
    err = fit_error(flat, samples)
    assert err.n == 4
    assert err.median_rel == pytest.approx(0.225)  # halfway between 0.2 and 0.25
    assert err.p90_rel == pytest.approx(0.25 + 0.7 * 0.25)  # position 2.7
    assert err.max_rel == pytest.approx(0.5)
    assert err.median_abs_ms == pytest.approx(2.25)
    assert "4 held-out steps" in err.describe() and "22.5%" in err.describe()
    with pytest.raises(PlanError, match="no steps"):
        fit_error(flat, [])


def test_split_held_out_takes_every_kth() -> None:
    samples = [StepSample(StepShape(i + 1, 1, i + 1), 0.01) for i in range(10)]
    fit, held = split_held_out(samples)
    assert [s.shape.new_tokens for s in held] == [4, 8]
    assert [s.shape.new_tokens for s in fit] == [1, 2, 3, 5, 6, 7, 9, 10]
    fit, held = split_held_out(samples, every=2)
    assert [s.shape.new_tokens for s in held] == [2, 4, 6, 8, 10]
    with pytest.raises(PlanError, match="k >= 2"):
        split_held_out(samples, every=1)


# ---------------------------------------------------------------------------- what it implies


def test_max_new_tokens_hand_computed() -> None:
    m = StepTimeModel(a=0.01, b=1e-4, c=1e-3, d=1e-6)
    # held: 8 decodes at 1000 context each; one more sequence: 0.01 + 8e-4 + 9e-3 + 8e-3
    # = 0.0278 s, slack 0.0222 s, each extra token 1e-4 + 1e-6 -> floor(219.8) = 219
    assert m.max_new_tokens(0.05, new_tokens=8, seqs=8, kv_tokens_read=8000) == 219
    # kv_per_token=0 (extra tokens read no cache): each costs b alone -> floor(222) = 222
    assert m.max_new_tokens(0.05, new_tokens=8, seqs=8, kv_tokens_read=8000, kv_per_token=0) == 222
    assert m.max_new_tokens(0.0278, new_tokens=8, seqs=8, kv_tokens_read=8000) == 0  # no slack
    assert m.max_new_tokens(0.02, new_tokens=8, seqs=8, kv_tokens_read=8000) == 0  # over already
    # exactly on the boundary: 0.01 + 5 x 0.001 = 0.015 fits
    assert StepTimeModel(a=0.01, b=0.001, c=0.0, d=0.0).max_new_tokens(0.015) == 5
    assert StepTimeModel(a=0.01, b=0.0, c=0.0, d=0.0).max_new_tokens(0.015) == 1 << 30


def test_predicted_knee_hand_computed() -> None:
    m = StepTimeModel(a=0.01, b=1e-5, c=1e-4, d=1e-7)
    p, o, t = 100, 50, 0.05
    # (T - a - c - d P) / (T (b (P + O) + c O + d O (P + O/2)))
    # = (0.05 - 0.01 - 1e-4 - 1e-5) / (0.05 (1.5e-3 + 5e-3 + 6.25e-4)) = 0.03989 / 3.5625e-4
    knee = predicted_knee(m, prompt_tokens=p, output_tokens=o, tpot_s=t)
    assert knee == pytest.approx(0.03989 / 3.5625e-4)
    # at the knee the steady-state step (Little's law) lasts exactly T
    b = knee * o * t
    step = (m.a + m.b * knee * (p + o) * t + m.c * (b + 1) + m.d * (b * (p + o / 2) + p))
    assert step == pytest.approx(t)
    # an empty engine already misses a 5 ms target (a = 10 ms): no rate meets it
    assert predicted_knee(m, prompt_tokens=p, output_tokens=o, tpot_s=0.005) == 0.0
    assert predicted_knee(StepTimeModel(0.01, 0, 0, 0), prompt_tokens=p, output_tokens=o,
                          tpot_s=t) == math.inf
    with pytest.raises(PlanError, match="knee needs"):
        predicted_knee(m, prompt_tokens=0, output_tokens=o, tpot_s=t)


def test_roofline_coefficients_are_the_planners_numbers() -> None:
    l8 = catalog_entry("Llama-3.1-8B").spec
    h100 = get_hardware("h100")
    m = roofline_step_model(l8, "h100")
    assert m.a == pytest.approx(model_weight_bytes(l8, "bf16").total / h100.mem_bytes_per_s)
    assert m.a == pytest.approx(8_030_261_248 * 2 / 3.35e12)  # every parameter in bf16
    assert m.b == pytest.approx(2 * count_params(l8).active_matmul / h100.bf16_flops)
    assert m.c == 0
    # K and V, 32 layers x 8 KV heads x 128 x 2 B = 131,072 B read per cached token
    assert m.d == pytest.approx(32 * 2 * 8 * 128 * 2 / h100.mem_bytes_per_s)
    fp8 = roofline_step_model(l8, "h100", weight_fmt="fp8", kv_dtype="fp8", tp=2)
    assert fp8.a == pytest.approx(model_weight_bytes(l8, "fp8", tp=2, base_dtype="bf16").total
                                  / h100.mem_bytes_per_s)
    assert h100.fp8_flops is not None
    assert fp8.b == pytest.approx(2 * count_params(l8).active_matmul / 2 / h100.fp8_flops)
    assert fp8.d == pytest.approx(32 * 2 * 4 * 128 * 1 / h100.mem_bytes_per_s)  # 4 heads a rank
    assert "h100" in m.source


def test_model_rejects_negative_or_all_zero_coefficients() -> None:
    with pytest.raises(PlanError, match="coefficient c"):
        StepTimeModel(a=0.01, b=0.0, c=-1e-6, d=0.0)
    with pytest.raises(PlanError, match="coefficient a"):
        StepTimeModel(a=math.nan, b=0.0, c=0.0, d=0.0)
    with pytest.raises(PlanError, match="at least one"):
        StepTimeModel(0.0, 0.0, 0.0, 0.0)


# ---------------------------------------------------------------------------------- on disk


def test_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "model.json"
    err = FitError(n=5, median_rel=0.01, p90_rel=0.02, max_rel=0.05, median_abs_ms=0.3)
    model = StepTimeModel(a=2e-3, b=5e-5, c=3e-4, d=2e-7, source="measured here")
    save_step_model(model, path, error=err, meta={"key": "k", "threads": 2})
    assert load_step_model(path) == model
    body = json.loads(path.read_text())
    assert body["held_out_error"]["median_rel"] == 0.01 and body["meta"] == {"key": "k", "threads": 2}
    assert not path.with_suffix(".tmp").exists()


@pytest.mark.parametrize(("text", "match"), [
    (None, "cannot read"),
    ("{not json", "bad JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"version": 1, "a": 0.01, "b": 0, "c": 0}', "needs numbers a, b, c, d"),
    ('{"version": 1, "a": 0.01, "b": 0, "c": 0, "d": -1}', "coefficient d"),
    ('{"version": 99, "a": 0.01, "b": 0, "c": 0, "d": 0}', "version 99"),
])
def test_missing_or_corrupt_file_is_a_plan_error_naming_the_path(tmp_path: Path, text: str | None,
                                                                 match: str) -> None:
    path = tmp_path / "step-model.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(PlanError, match=match) as info:
        load_step_model(path)
    assert str(path) in str(info.value)
