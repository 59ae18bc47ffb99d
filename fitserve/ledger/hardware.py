"""Accelerators as data (catalog/gpus.json) and ``cpu`` = this machine, measured and cached."""

from __future__ import annotations

import difflib
import functools
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fitserve.envs import fitserve_home
from fitserve.ledger import cpu_measure
from fitserve.ledger.errors import PlanError

CPU_CACHE_VERSION = 2


@dataclass(frozen=True)
class Hardware:
    """One device. Peaks are dense; ``link_bytes_per_s`` is per direction per device."""

    name: str
    memory_bytes: int
    mem_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float | None
    power_w: float | None
    link: str
    link_bytes_per_s: float
    link_latency_s: float
    source: str
    measured: bool = False
    measured_at: float | None = None  # unix time of a measured device's figures
    # a CPU: the cores its figures were measured with (the step-time model's dequant term,
    # fitserve.ledger.dequant, runs over them); 0 for an accelerator (no such term)
    cores: int = 0

    def peak_flops(self, weights_fmt: str) -> float:
        """Matmul peak for a weight format: fp8 GEMMs where the device has them, else bf16.

        NOTE: weight-only int4/int8 (W4A16, W8A16) dequantize to bf16 and run at the bf16 peak.
        """
        if weights_fmt.startswith("fp8") and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops


def _gpu_rows() -> list[dict[str, Any]]:
    text = resources.files("fitserve.ledger").joinpath("catalog/gpus.json").read_text()
    rows: list[dict[str, Any]] = json.loads(text)["gpus"]
    return rows


def _from_row(r: dict[str, Any]) -> Hardware:
    return Hardware(r["name"], int(r["memory_bytes"]), float(r["mem_bytes_per_s"]),
                    float(r["bf16_flops"]), r["fp8_flops"] and float(r["fp8_flops"]),
                    r["power_w"] and float(r["power_w"]), r["link"],
                    float(r["link_bytes_per_s"]), float(r["link_latency_s"]), r["source"])


def gpu_names() -> list[str]:
    return [r["name"] for r in _gpu_rows()] + ["cpu"]


def get_hardware(name: str) -> Hardware:
    """A catalog accelerator by name or alias, or "cpu" (this machine, measured)."""
    key = name.strip().lower()
    if key == "cpu":
        return cpu_hardware()
    table = {}
    for r in _gpu_rows():
        for k in (r["name"], *r.get("aliases", [])):
            table[k.lower()] = r
    if key in table:
        return _from_row(table[key])
    close = difflib.get_close_matches(key, [*table, "cpu"], n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise PlanError(f"unknown GPU {name!r}{hint} Known: {', '.join(gpu_names())}")


def machine_key() -> str:
    """This host, architecture and CPU count: what a per-machine cache is keyed by."""
    return f"{platform.node()}|{platform.machine()}|{os.cpu_count()}"


def _mem_total() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_has_fast_bf16() -> bool:
    """True where the CPU has native bf16 dot products (AVX512-BF16 or AMX): the engine's
    "auto" dtype on CPU is then bf16, else f32 (see ``cpu_engine_dtype``)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """True where the CPU has AMX bf16 tiles: torch's CPU flash attention then repacks K/V for
    its bf16 GEMM (``cpublas::need_pack``); without AMX (Zen 4, AVX2) it never does
    (``fitserve.ledger.scratch.cpu_sdpa_bytes``)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def cpu_engine_dtype() -> str:
    """The dtype the engine picks for ``--dtype auto`` on this CPU: "bf16" or "f32"."""
    return "bf16" if cpu_has_fast_bf16() else "f32"


def cpu_hardware(*, refresh: bool = False) -> Hardware:
    """This machine: copy bandwidth and matmul FLOP/s (``fitserve.ledger.cpu_measure``), cached
    in $FITSERVE_HOME/hardware-cpu.json and measured again when the cache no longer describes
    this CPU (another model or thread count, stale, or a quick probe > 25% off); ``refresh``
    measures again in any case."""
    path = fitserve_home() / "hardware-cpu.json"
    model, threads = cpu_measure.cpu_model(), cpu_measure.default_threads()
    figures = None if refresh else _read_cached(path)
    if figures is not None:
        usable, _why = cpu_measure.cached_is_usable(
            figures, now=time.time(), model=model, threads=threads,
            probe=lambda: cpu_measure.probe_copy_bandwidth(threads))
        figures = figures if usable else None
    if figures is None:
        figures = cpu_measure.measure_figures(threads)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"version": CPU_CACHE_VERSION, **asdict(figures)},
                                       indent=1))
        except OSError:
            pass  # a read-only home only costs a re-measure next time
    return Hardware(
        name="cpu", memory_bytes=_mem_total(), mem_bytes_per_s=figures.mem_bytes_per_s,
        bf16_flops=figures.flops, fp8_flops=None, power_w=None, link="none",
        link_bytes_per_s=0.0, link_latency_s=0.0,
        source=(f"{figures.describe()}: {figures.threads} parallel numpy copies of 256 MiB "
                f"(read+write), median of the undisturbed runs of 7; a 1024^3 float32 matmul "
                f"(f32 FLOP/s stands in for bf16); memory = physical RAM"),
        measured=True, measured_at=figures.measured_at, cores=figures.threads)


def _read_cached(path: Path) -> cpu_measure.CpuFigures | None:
    try:
        data = json.loads(path.read_text())
        if data.pop("version", None) != CPU_CACHE_VERSION:
            return None
        return cpu_measure.CpuFigures(**data)
    except (OSError, ValueError, TypeError):
        return None  # missing, old-format or damaged: measured again
