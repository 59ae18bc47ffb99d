"""A torch.profiler window over the first steps of a workload: trace file and op tables.

The window is a separate pass over the same workload (after the timed run), so the profiler's
own overhead (``record_shapes`` costs ~10-30 us per op) never enters the step times, the
latency percentiles or the utilisation: those come from the clean run. The pass starts the
workload afresh, runs ``steps`` engine steps under the profiler (the first ones: prompt chunks,
then decodes), then aborts the rest and empties the prefix cache.

Tables, from ``prof.key_averages()``:

- per op (``ops.csv``): each event key (ATen ops, custom kernels such as
  ``fitserve::int4_linear``, and ``engine.step``), its calls, self CPU ms in total and per
  profiled step, and its share of all self CPU time in the window (self times do not double
  count). NOTE: ``engine.step``'s self time is everything in a step outside any op: the
  engine's Python (scheduling, bookkeeping, outputs) *plus the profiler's own per-op cost*,
  so it overstates the Python share; compare ``forward_seconds`` with ``seconds`` in the
  clean run's shapes table for the unprofiled split;
- per op and input shape (``ops_by_shape.csv``): the same grouped by input shapes
  (``group_by_input_shape=True``), the top rows by self CPU time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitserve.tools.profile.workloads import Workload, sampling_params
from fitserve.types import StepRecord

if TYPE_CHECKING:
    from fitserve.engine.core import Engine

STEP_LABEL = "engine.step"
TOP_SHAPE_ROWS = 60


@dataclass(frozen=True, slots=True)
class OpRow:
    """One row of the per-op table."""

    op: str
    calls: int
    self_cpu_ms: float
    self_cpu_ms_per_step: float
    share: float  # of all self CPU time in the window
    cpu_total_ms: float  # self + children


@dataclass(frozen=True, slots=True)
class OpShapeRow:
    """One row of the per-op, per-input-shape table."""

    op: str
    input_shapes: str
    calls: int
    self_cpu_ms: float
    self_cpu_us_per_call: float
    share: float


@dataclass(frozen=True, slots=True)
class TraceResult:
    """The profiled window: how many steps (and their records), where the trace is, the tables."""

    steps: int
    trace_path: Path
    ops: list[OpRow]
    ops_by_shape: list[OpShapeRow]
    step_records: list[StepRecord]  # the profiled steps (their times include profiler overhead)


def op_rows(events: Any, steps: int) -> list[OpRow]:
    """The per-op table of ``key_averages()`` events, most self CPU time first."""
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    rows = [OpRow(e.key, int(e.count), e.self_cpu_time_total / 1e3,
                  e.self_cpu_time_total / 1e3 / max(steps, 1), e.self_cpu_time_total / total,
                  e.cpu_time_total / 1e3) for e in events]
    return sorted(rows, key=lambda r: -r.self_cpu_ms)


def op_shape_rows(events: Any, top: int = TOP_SHAPE_ROWS) -> list[OpShapeRow]:
    """The top ``top`` rows of ``key_averages(group_by_input_shape=True)`` by self CPU time."""
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    rows = [OpShapeRow(e.key, str(e.input_shapes), int(e.count), e.self_cpu_time_total / 1e3,
                       e.self_cpu_time_total / max(int(e.count), 1), e.self_cpu_time_total / total)
            for e in events]
    return sorted(rows, key=lambda r: -r.self_cpu_ms)[:top]


def _activities(engine: Engine) -> list[Any]:
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def profile_window(engine: Engine, workload: Workload, prompts: list[list[int]], steps: int,
                   trace_path: Path) -> TraceResult:
    """Run the first ``steps`` steps of ``workload`` under torch.profiler (see module doc)."""
    from torch.profiler import profile, record_function

    params = sampling_params(workload.output_len, workload.ignore_eos)
    engine.reset_prefix_cache()  # the timed run computed these prompts: compute them again
    from fitserve.sched.slo import AdmissionRejected

    ids = []
    for p in prompts:
        with contextlib.suppress(AdmissionRejected):  # slo admission: as in the timed run
            ids.append(engine.add_request(p, params))
    first, ran = engine.num_steps, 0
    try:
        with profile(activities=_activities(engine), record_shapes=True) as prof:
            while ran < steps and engine.has_unfinished_requests():
                with record_function(STEP_LABEL):
                    engine.step()
                ran += 1
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.reset_prefix_cache()
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    return TraceResult(ran, trace_path, op_rows(prof.key_averages(), ran),
                       op_shape_rows(prof.key_averages(group_by_input_shape=True)),
                       [r for r in engine.step_log if r.index > first])
