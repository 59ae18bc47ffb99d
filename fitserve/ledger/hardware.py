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
from typing import Any

from fitserve.envs import fitserve_home
from fitserve.ledger.errors import PlanError

CPU_CACHE_VERSION = 1


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


def _machine_key() -> str:
    return f"{platform.node()}|{platform.machine()}|{os.cpu_count()}|v{CPU_CACHE_VERSION}"


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


def measure_copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-``repeats`` bytes/s of a numpy copy, counting read + write (2 x nbytes)."""
    import numpy as np

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def measure_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """Best-of-``repeats`` FLOP/s of an n x n float32 numpy matmul (2 n^3 FLOPs)."""
    import numpy as np

    a = np.ones((n, n), dtype=np.float32)
    b = np.ones((n, n), dtype=np.float32)
    a @ b  # warm-up (thread pool start)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def cpu_hardware(*, refresh: bool = False) -> Hardware:
    """This machine: copy bandwidth and matmul FLOP/s measured with numpy (< 5 s), cached
    in $FITSERVE_HOME/hardware-cpu.json for this host; ``refresh`` measures again."""
    path = fitserve_home() / "hardware-cpu.json"
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.pop("key", None) == _machine_key():
                return Hardware(**data)
        except (OSError, ValueError, TypeError):
            pass  # a bad cache is measured again
    bw, flops = measure_copy_bandwidth(), measure_matmul_flops()
    hw = Hardware(
        name="cpu", memory_bytes=_mem_total(), mem_bytes_per_s=bw, bf16_flops=flops,
        fp8_flops=None, power_w=None, link="none", link_bytes_per_s=0.0, link_latency_s=0.0,
        source=(f"measured on {platform.node()} ({os.cpu_count()} CPUs): numpy copy of 256 MiB "
                f"(read+write) and a 1024^3 float32 matmul, best of 5; f32 FLOP/s stands in "
                f"for bf16; memory = physical RAM"),
        measured=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": _machine_key(), **asdict(hw)}, indent=1))
    except OSError:
        pass  # a read-only home only costs a re-measure next time
    return hw
