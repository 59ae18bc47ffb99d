"""The measured step-time model of this engine on this machine: calibrate, save, resolve.

``calibrate_step_model`` times the sweep of :mod:`fitserve.engine.calibration_sweep` on an idle engine,
fits ``t = a + b*new_tokens + c*seqs + d*kv_tokens_read`` on three steps of every four and
reports the error on the fourth (held out). ``resolve_step_model`` is what the engine calls for
``--scheduling-policy slo``: the file the config names, else the one saved for this engine's
key under ``$FITSERVE_HOME/step-models``, else a quick calibration saved there.

The key is what changes a step's time: the model file, how its weights are held, the dtype,
the KV format and block size, torch's thread count, the CPU (or GPU) and the device.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

from fitserve.engine.calibration_sweep import (
    FULL_SWEEP,
    QUICK_SWEEP,
    Engine,
    EngineLimits,
    clip_sweep,
    run_sweep,
    samples_of,
)
from fitserve.envs import fitserve_home
from fitserve.ledger.errors import PlanError
from fitserve.ledger.step_time import (
    FitError,
    StepSample,
    StepTimeModel,
    fit_error,
    fit_step_model,
    load_step_model,
    save_step_model,
    split_held_out,
)

log = logging.getLogger("fitserve.engine")

HELD_OUT_EVERY = 4
"""Every 4th timed step is held out of the fit and measures its error."""


def cpu_model_name() -> str:
    """The CPU's name (/proc/cpuinfo "model name"), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _device_name(engine: Engine) -> str:
    import torch

    if engine.device.type == "cuda":
        return f"{engine.device} {torch.cuda.get_device_name(engine.device)}"
    return str(engine.device)


def _key_fields(engine: Engine) -> dict[str, str | int]:
    import torch

    cfg = engine.config
    loaded = getattr(engine, "loaded", None)
    model = str(loaded.path) if loaded is not None else cfg.model
    return {
        "model": model, "weights": str(engine.weights_choice),
        "dtype": str(engine.dtype).removeprefix("torch."), "kv_cache_dtype": cfg.cache.kv_cache_dtype,
        "kv_cache_scales": cfg.cache.kv_cache_scales, "block_size": cfg.cache.block_size,
        "threads": torch.get_num_threads(), "cpu": cpu_model_name(), "device": _device_name(engine),
    }


def step_model_key(engine: Engine) -> str:
    """A stable file stem naming this engine's step-time model: readable fields, sanitised,
    plus a short hash of every field (the model's full path and the CPU name included)."""
    f = _key_fields(engine)
    stem = Path(str(f["model"])).stem or str(f["model"])
    readable = (f"{stem}-{f['weights']}-{f['dtype']}-kv-{f['kv_cache_dtype']}-b{f['block_size']}"
                f"-t{f['threads']}-{str(f['device']).split()[0]}")
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", readable).strip("._-")[:96]
    digest = hashlib.sha256(json.dumps(f, sort_keys=True).encode()).hexdigest()[:10]
    return f"{safe}-{digest}"


def step_model_path(engine: Engine) -> Path:
    """Where this engine's measured step-time model is saved."""
    return fitserve_home() / "step-models" / f"{step_model_key(engine)}.json"


@dataclass(frozen=True, slots=True)
class Calibration:
    """One calibration: every timed step, the fit, its held-out error, how long it took."""

    model: StepTimeModel
    error: FitError
    fitted: list[StepSample]
    held_out: list[StepSample]
    seconds: float
    quick: bool


def run_calibration(engine: Engine, *, quick: bool = False) -> Calibration:
    """Time the sweep on ``engine`` (left idle, prefix cache empty) and fit the model."""
    import torch

    if engine.has_unfinished_requests():
        raise ValueError("calibrating the step-time model needs an idle engine (requests are running)")
    t0 = time.perf_counter()
    sweep = clip_sweep(QUICK_SWEEP if quick else FULL_SWEEP, EngineLimits.of(engine))
    samples = samples_of(run_sweep(engine, sweep))
    fitted, held = split_held_out(samples, every=HELD_OUT_EVERY)
    source = (f"measured on {cpu_model_name()} ({torch.get_num_threads()} threads, "
              f"{'quick' if quick else 'full'} sweep, {datetime.date.today().isoformat()})")
    model = fit_step_model(fitted, source=source)
    error = fit_error(model, held)
    return Calibration(model, error, fitted, held, time.perf_counter() - t0, quick)


def calibrate_step_model(engine: Engine, *, quick: bool = False) -> tuple[StepTimeModel, FitError]:
    """Run the sweep on this engine (left idle: every request finished or aborted, prefix cache
    reset), fit on the non-held-out steps; the model and its held-out error."""
    cal = run_calibration(engine, quick=quick)
    return cal.model, cal.error


def calibration_meta(engine: Engine, cal: Calibration) -> dict[str, object]:
    """What is saved beside the coefficients: the key's fields, when, how long, how many."""
    return {
        "key": step_model_key(engine), **_key_fields(engine),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "calibration_seconds": round(cal.seconds, 3), "quick": cal.quick,
        "fitted_steps": len(cal.fitted), "held_out_steps": len(cal.held_out),
    }


def save_calibration(engine: Engine, cal: Calibration, path: Path | None = None) -> Path:
    """Save ``cal`` for this engine (default: :func:`step_model_path`); the path written."""
    path = path or step_model_path(engine)
    save_step_model(cal.model, path, error=cal.error, meta=calibration_meta(engine, cal))
    return path


def resolve_step_model(engine: Engine) -> StepTimeModel:
    """The step-time model the engine schedules with.

    ``engine.config.step_model`` set: that file (a missing or bad file is a PlanError). Else
    the model saved for :func:`step_model_path` when it loads; else a quick calibration on
    this engine, saved there (a failure to save is logged, not raised).
    """
    if engine.config.step_model:
        return load_step_model(Path(engine.config.step_model))
    path = step_model_path(engine)
    if path.exists():
        try:
            model = load_step_model(path)
        except PlanError as exc:
            log.warning("%s; measuring a new step-time model", exc)
        else:
            log.info("step-time model from %s: %s", path, model.describe())
            return model
    log.info("no step-time model saved for this engine and machine: measuring one (quick sweep)")
    cal = run_calibration(engine, quick=True)
    try:
        save_calibration(engine, cal, path)
    except OSError as exc:
        log.warning("could not save the step-time model to %s: %s", path, exc)
    log.info("step-time model measured in %.1f s: %s; held-out error: %s; saved to %s",
             cal.seconds, cal.model.describe(), cal.error.describe(), path)
    return cal.model
