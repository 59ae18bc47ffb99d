"""The step-time model: how long one engine step takes, from what the step computes.

    t_step = a + b * new_tokens + c * seqs + d * kv_tokens_read

``new_tokens``: tokens fed this step (prompt chunks, decodes, drafts); ``seqs``: requests in the
step; ``kv_tokens_read``: the cached context the step's attention reads, summed over requests
(a chunk of n tokens at position p reads p + n). ``a`` is the per-step cost (weights streamed
once, launch and Python overhead), ``b`` the per-token matmul cost, ``c`` per-sequence work
(sampling, logits row, bookkeeping), ``d`` the per-KV-token attention read.

The same shape serves two sources:

- **measured** (this machine): least-squares fit of profiled steps
  (:func:`fit_step_model`, ``fitserve profile --workload calibrate``), saved under
  ``$FITSERVE_HOME/step-models`` and loaded by the engine for ``--scheduling-policy slo``;
- **roofline** (a GPU from the catalog): :func:`roofline_step_model`, the memory and compute
  floors added term by term.

Pure functions, no torch.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import Hardware, get_hardware

STEP_MODEL_VERSION = 1
COEFFICIENTS = ("a", "b", "c", "d")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, as the model sees it."""

    new_tokens: int
    seqs: int
    kv_tokens_read: int


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step: its shape and its wall time in seconds."""

    shape: StepShape
    seconds: float


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """``t = a + b*new_tokens + c*seqs + d*kv_tokens_read`` seconds; every coefficient >= 0."""

    a: float
    b: float
    c: float
    d: float
    source: str = ""

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise PlanError(f"step-time model coefficient {name} must be a finite number >= 0, got {v!r}")
        if self.a + self.b + self.c + self.d <= 0:
            raise PlanError("a step-time model needs at least one coefficient > 0")

    def predict(self, new_tokens: int, seqs: int, kv_tokens_read: int) -> float:
        """Predicted seconds of a step of this shape."""
        return self.a + self.b * new_tokens + self.c * seqs + self.d * kv_tokens_read

    def predict_shape(self, shape: StepShape) -> float:
        return self.predict(shape.new_tokens, shape.seqs, shape.kv_tokens_read)

    def max_new_tokens(self, budget_s: float, *, new_tokens: int = 0, seqs: int = 0,
                       kv_tokens_read: int = 0, kv_per_token: int = 1) -> int:
        """The most extra tokens a step may take and stay within ``budget_s``.

        The step already holds ``new_tokens``/``seqs``/``kv_tokens_read``; the extra tokens
        come as one more sequence whose chunk adds ``kv_per_token`` read per token (a prompt
        chunk starting at 0 reads its own tokens). 0 when even one token would not fit::

            a + b (new + x) + c (seqs + 1) + d (kv + kv_per_token x) <= budget
            x <= (budget - a - b new - c (seqs + 1) - d kv) / (b + d kv_per_token)
        """
        slack = budget_s - self.predict(new_tokens, seqs + 1, kv_tokens_read)
        per = self.b + self.d * kv_per_token
        if slack < 0:
            return 0
        if per <= 0:
            return 1 << 30  # tokens cost nothing in this model: no cap
        return int(math.floor(slack / per + 1e-9))

    def to_dict(self) -> dict[str, float | str | int]:
        return {"version": STEP_MODEL_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> StepTimeModel:
        """From :meth:`to_dict`'s JSON; a missing or bad field is a PlanError naming it."""
        if d.get("version") != STEP_MODEL_VERSION:
            raise PlanError(f"step-time model version {d.get('version')!r} is not {STEP_MODEL_VERSION}")
        try:
            vals = {k: float(d[k]) for k in COEFFICIENTS}  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"step-time model needs numbers a, b, c, d: {exc}") from None
        return cls(**vals, source=str(d.get("source", "")))

    def describe(self) -> str:
        return (f"t_step = {self.a * 1e3:.3f} ms + {self.b * 1e6:.3f} us x new_tokens + "
                f"{self.c * 1e6:.3f} us x seqs + {self.d * 1e9:.3f} ns x kv_tokens_read")


# ------------------------------------------------------------------------------------ fitting


def _solve(rows: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(rhs)
    m = [r[:] + [v] for r, v in zip(rows, rhs, strict=True)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    for k in range(col, n + 1):
                        m[r][k] -= f * m[col][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def _features(s: StepShape) -> list[float]:
    return [1.0, float(s.new_tokens), float(s.seqs), float(s.kv_tokens_read)]


def _rank(rows: Sequence[Sequence[float]], tol: float = 1e-9) -> int:
    """Column rank of ``rows`` (each column scaled to unit length first, so that a column of
    token counts in the thousands and the constant column compare on one scale)."""
    if not rows:
        return 0
    ncol = len(rows[0])
    norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) for j in range(ncol)]
    m = [[r[j] / norms[j] if norms[j] else 0.0 for j in range(ncol)] for r in rows]
    rank = 0
    for col in range(ncol):
        piv = max(range(rank, len(m)), key=lambda r: abs(m[r][col]), default=None)
        if piv is None or abs(m[piv][col]) <= tol:
            continue
        m[rank], m[piv] = m[piv], m[rank]
        for r in range(len(m)):
            if r != rank:
                f = m[r][col] / m[rank][col]
                for k in range(col, ncol):
                    m[r][k] -= f * m[rank][k]
        rank += 1
    return rank


def fit_step_model(samples: Sequence[StepSample], source: str = "") -> StepTimeModel:
    """Non-negative least squares on relative error: minimise sum ((pred - t) / t)^2, all
    coefficients >= 0.

    NOTE: relative weighting because steps span 100x (a decode of one sequence vs a 2k-token
    prefill); absolute least squares would fit the long prefills and miss the decode steps the
    TPOT target is about. Non-negativity by trying every subset of free coefficients (2^4) and
    keeping the best feasible one: exact for four unknowns.
    """
    data = [(_features(s.shape), s.seconds) for s in samples if s.seconds > 0]
    if len(data) < 4:
        raise PlanError(f"fitting a step-time model needs at least 4 timed steps, got {len(data)}")
    # NOTE: every subset with `a` alone always solves, so without this check steps that are
    # all alike (or decode-only steps, where new_tokens == seqs) would "fit" a model whose
    # split between the terms is arbitrary and whose predictions off those shapes are wrong.
    rank = _rank([x for x, _ in data])
    # NOTE: an engine that never holds more than one sequence (max_num_seqs 1) times every step
    # at seqs == 1: c cannot be told from a there, and no step it will ever run needs the split,
    # so c is held at 0 (folded into a) and the other three terms must be determined.
    one_seq_count = len({x[2] for x, _ in data}) == 1
    columns = (0, 1, 3) if one_seq_count else (0, 1, 2, 3)
    if one_seq_count:
        rank = _rank([[x[i] for i in columns] for x, _ in data]) + 1
    if rank < 4:
        raise PlanError(f"the timed steps do not determine a step-time model: their shapes span "
                        f"{rank} of the 4 terms (1, new_tokens, seqs, kv_tokens_read); time "
                        f"steps that vary each of them independently")
    best: tuple[float, list[float]] | None = None
    for k in range(1, len(columns) + 1):
        for free in itertools.combinations(columns, k):
            # normal equations of the weighted problem (weights 1/t^2) over the free columns
            ata = [[sum(x[i] * x[j] / (t * t) for x, t in data) for j in free] for i in free]
            atb = [sum(x[i] / t for x, t in data) for i in free]
            sol = _solve(ata, atb)
            if sol is None or any(v < 0 for v in sol):
                continue
            coef = [0.0] * 4
            for i, v in zip(free, sol, strict=True):
                coef[i] = v
            loss = sum(((sum(c * f for c, f in zip(coef, x, strict=True)) - t) / t) ** 2 for x, t in data)
            if best is None or loss < best[0]:
                best = (loss, coef)
    if best is None:
        raise PlanError("the timed steps do not determine a step-time model (all shapes alike?)")
    a, b, c, d = best[1]
    return StepTimeModel(a, b, c, d, source=source)


@dataclass(frozen=True, slots=True)
class FitError:
    """How far a model's predictions are from measured steps (relative: |pred - t| / t)."""

    n: int
    median_rel: float
    p90_rel: float
    max_rel: float
    median_abs_ms: float

    def describe(self) -> str:
        return (f"{self.n} held-out steps: median error {self.median_rel:.1%} "
                f"({self.median_abs_ms:.2f} ms), p90 {self.p90_rel:.1%}, max {self.max_rel:.1%}")


def _quantile(sorted_vals: list[float], q: float) -> float:
    pos = (len(sorted_vals) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def fit_error(model: StepTimeModel, samples: Sequence[StepSample]) -> FitError:
    """The model's error on ``samples`` (use steps it was not fitted on)."""
    if not samples:
        raise PlanError("no steps to measure the step-time model's error on")
    rel = sorted(abs(model.predict_shape(s.shape) - s.seconds) / s.seconds for s in samples)
    absms = sorted(abs(model.predict_shape(s.shape) - s.seconds) * 1e3 for s in samples)
    return FitError(len(rel), _quantile(rel, 0.5), _quantile(rel, 0.9), rel[-1], _quantile(absms, 0.5))


def split_held_out(samples: Sequence[StepSample], every: int = 4) -> tuple[list[StepSample], list[StepSample]]:
    """(fit, held-out): every ``every``-th sample is held out, the rest fit the model."""
    if every < 2:
        raise PlanError(f"hold out every k-th step needs k >= 2, got {every}")
    fit = [s for i, s in enumerate(samples) if i % every != every - 1]
    held = [s for i, s in enumerate(samples) if i % every == every - 1]
    return fit, held


# ---------------------------------------------------------------------------- what it implies


def predicted_knee(model: StepTimeModel, *, prompt_tokens: int, output_tokens: int,
                   tpot_s: float) -> float:
    """The highest request rate (req/s) the engine sustains with every step within ``tpot_s``.

    Steady state of requests of P prompt and O output tokens at rate lambda, each step lasting
    T = tpot_s (Little's law): B = lambda O T sequences are decoding, and a step computes
    N = lambda (P + O) T tokens, over B + 1 sequences (one prompt chunk), reading
    B (P + O/2) + P cached tokens. The step fits when a + b N + c (B + 1) + d kv <= T::

        lambda* = (T - a - c - d P) / (T (b (P + O) + c O + d O (P + O/2)))

    0 when even an empty engine cannot meet T. Above lambda* queues grow without bound.
    """
    p, o, t = prompt_tokens, output_tokens, tpot_s
    if p < 1 or o < 1 or t <= 0:
        raise PlanError(f"the knee needs prompt and output tokens >= 1 and a TPOT > 0, got {p}, {o}, {t}")
    head = t - model.a - model.c - model.d * p
    per = t * (model.b * (p + o) + model.c * o + model.d * o * (p + o / 2))
    if head <= 0:
        return 0.0
    return head / per if per > 0 else math.inf


def roofline_step_model(spec: ModelSpec, hw: Hardware | str, *, weight_fmt: str = "bf16",
                        kv_dtype: str = "bf16", tp: int = 1, step_tokens: int = 1
                        ) -> StepTimeModel:
    """The step-time model of a device (a catalog GPU's name, or a Hardware such as the measured
    CPU) from its roofline, term by term:

        a = weight bytes read per step per rank / bandwidth   (weights streamed once per step)
            or a CPU's weight-kernel time at one row if larger (fitserve.ledger.dequant)
            + a CPU's fixed cost per step and per layer (Hardware.step_overhead, measured)
        b = FLOPs per token / peak                       (the matmuls, no attention context)
            or a CPU's weight-kernel time per extra row if larger
            + a CPU's element-wise work per token (speed.token_seconds: measured per element)
        c = a CPU's cost per sampled sequence (measured: scheduler, sampler, argmax per logit);
            0 on a GPU's roofline
        d = KV bytes per token per rank / bandwidth      (each cached token read once)

    ``weight_fmt``: a format or a per-tensor mix ("gpt-oss-mxfp4": each tensor in its own
    format, plan.weights). A mixture-of-experts model reads the non-expert tensors and only the
    experts a step of ``step_tokens`` tokens touches, E (1 - (1 - k/E)^n) of E under uniform
    routing (plan.moe): 1 = the k experts of one decode token; the capacity sheet passes its
    steady-state step.

    NOTE: the roofline is max(memory, compute); this adds them, so it is an upper bound that
    is exact where one term dominates (small-batch decode: a; long prefill: b) and at most 2x
    off where they balance. Collectives under TP are left out (see plan.parallel).
    """
    from fitserve.ledger.dequant import dequant_seconds
    from fitserve.ledger.flops import flops_per_token
    from fitserve.ledger.kv import request_kv
    from fitserve.ledger.moe import moe_step_weight_read
    from fitserve.ledger.speed import token_seconds
    from fitserve.ledger.weights import roofline_weight_bytes

    if isinstance(hw, str):
        hw = get_hardware(hw)
    if step_tokens < 1:
        raise PlanError(f"a step carries at least 1 token, got step_tokens={step_tokens}")
    wb = roofline_weight_bytes(spec, weight_fmt, tp=tp)
    bw = hw.mem_bytes_per_s
    read = moe_step_weight_read(spec, wb, step_tokens)

    def kernels(rows: int) -> float:  # a CPU's weight kernels (0 elsewhere): plan.dequant
        return dequant_seconds(wb, rows=rows, cores=hw.cores,
                               read_fraction=read / wb.total if wb.total else 1.0)

    # NOTE: the kernels overlap the weight stream (a = the larger), and their cost per extra
    # row of x includes the FMAs the FLOP floor counts (b = the larger)
    # a CPU's fixed cost per step and per layer (Hardware.step_overhead) adds to a
    a = max(read / bw, kernels(1)) + hw.step_overhead(spec.num_layers)
    b = max(flops_per_token(spec, 0).total / tp / hw.peak_flops(weight_fmt),
            kernels(2) - kernels(1))
    # a CPU's element-wise work per token and cost per sampled sequence (speed.token_seconds)
    b += token_seconds(spec, hw, new_tokens=1, sampled=0, tp=tp)
    c = token_seconds(spec, hw, new_tokens=0, sampled=1, tp=tp)
    d = request_kv(spec, 1, kv_dtype, tp=tp).bytes_reclaimed / bw
    moe = (f", experts read by {step_tokens:,}-token steps" if spec.num_experts else "")
    return StepTimeModel(a, b, c, d, source=f"roofline of {hw.name} ({weight_fmt} weights, "
                                              f"{kv_dtype} KV, tp={tp}{moe})")


# ---------------------------------------------------------------------------------- on disk


def save_step_model(model: StepTimeModel, path: Path, *, error: FitError | None = None,
                    meta: dict[str, object] | None = None) -> None:
    """Write the model (and its held-out error) as JSON."""
    body: dict[str, object] = {**model.to_dict(), "meta": meta or {}}
    if error is not None:
        body["held_out_error"] = asdict(error)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)


def load_step_model(path: Path) -> StepTimeModel:
    """Read :func:`save_step_model`'s JSON; a missing or corrupt file is a PlanError naming it."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise PlanError(f"cannot read the step-time model {path}: {exc}") from None
    except ValueError as exc:
        raise PlanError(f"{path} is not a step-time model (bad JSON: {exc})") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path} is not a step-time model (not a JSON object)")
    try:
        return StepTimeModel.from_dict(data)
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None
