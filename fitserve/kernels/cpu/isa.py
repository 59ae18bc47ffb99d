"""What this CPU can run, read at run time (never assumed): /proc/cpuinfo flags and torch's view.

The same box kind has been seen as AMD Zen 4 (AVX-512 + BF16/VNNI, no AMX) and Intel Xeon with
AMX, so kernels are compiled for, and chosen from, the features found here.

``FITSERVE_CPU_TIER=avx2`` (or ``scalar``, ``avx512``) builds the kernels for a LOWER tier than
the CPU offers, so the AVX2 and scalar paths can be tested on an AVX-512 machine; a tier the
CPU cannot run is ignored.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

from fitserve import envs


@dataclass(frozen=True, slots=True)
class CpuIsa:
    """The instruction-set features fitserve's kernels care about."""

    avx2: bool = False
    fma: bool = False
    f16c: bool = False
    avx512: bool = False  # F + BW + VL + DQ together (what the AVX-512 kernels need)
    avx512_vnni: bool = False
    avx512_bf16: bool = False
    avx_vnni: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False
    torch_capability: str = "DEFAULT"

    @property
    def tier(self) -> str:
        """The kernel tier compiled for this CPU: "avx512_vnni", "avx512", "avx2" or "scalar"."""
        if self.avx512 and self.avx512_vnni:
            return "avx512_vnni"
        if self.avx512:
            return "avx512"
        if self.avx2 and self.fma and self.f16c:
            return "avx2"
        return "scalar"

    def describe(self) -> str:
        feats = [n for n in ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx_vnni",
                             "amx_bf16", "amx_int8") if getattr(self, n)]
        return f"{' '.join(feats) or 'no SIMD extensions'} (torch: {self.torch_capability})"


def _cpuinfo_flags(text: str) -> set[str]:
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def isa_from_flags(flags: set[str], torch_capability: str = "DEFAULT") -> CpuIsa:
    """A CpuIsa from /proc/cpuinfo's flag names."""
    return CpuIsa(
        avx2="avx2" in flags, fma="fma" in flags, f16c="f16c" in flags,
        avx512={"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags,
        avx512_vnni="avx512_vnni" in flags, avx512_bf16="avx512_bf16" in flags,
        avx_vnni="avx_vnni" in flags, amx_bf16="amx_bf16" in flags, amx_int8="amx_int8" in flags,
        torch_capability=torch_capability,
    )


@functools.cache
def detect_isa() -> CpuIsa:
    """The ISA of the CPU this process runs on (x86 Linux; elsewhere: scalar)."""
    import torch

    cap = str(torch.backends.cpu.get_cpu_capability())
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return CpuIsa(torch_capability=cap)
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return CpuIsa(torch_capability=cap)
    return isa_from_flags(_cpuinfo_flags(text), cap)


def cpu_model_name() -> str:
    """/proc/cpuinfo's "model name" (what benchmarks print beside their figures)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


TIERS = ("scalar", "avx2", "avx512", "avx512_vnni")  # lowest to highest


def build_tier(isa: CpuIsa) -> str:
    """The tier to compile for: ``isa.tier``, lowered by ``FITSERVE_CPU_TIER`` when that names a
    tier below it (never raised above what the CPU runs)."""
    want = envs.FITSERVE_CPU_TIER()
    if want in TIERS and TIERS.index(want) < TIERS.index(isa.tier):
        return want
    return isa.tier


def compile_flags(isa: CpuIsa, tier: str | None = None) -> list[str]:
    """Explicit ISA flags for the tier (never -march=native: the cache key must name them).

    ``tier`` defaults to :func:`build_tier` (``isa.tier`` unless lowered by the environment).
    """
    tier = build_tier(isa) if tier is None else tier
    if tier == "scalar":
        return []
    flags = ["-mavx2", "-mfma", "-mf16c"]
    if tier in ("avx512", "avx512_vnni"):
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    if tier == "avx512_vnni":
        flags.append("-mavx512vnni")
    # NOTE: AVX512-BF16 only at the VNNI tier: every CPU with it has VNNI (Cooper Lake, Sapphire
    # Rapids, Zen 4/5), so the avx512 tier is Skylake-X's (no BF16), and a tier-subprocess test
    # at avx512 runs the BF16-less AVX-512 paths, which no CPU seen here runs otherwise.
    if isa.avx512_bf16 and tier == "avx512_vnni":
        flags.append("-mavx512bf16")
    # NOTE: AMX tiles (AMX-INT8 for the held int4/int8 panels, qlinear_amx.h; AMX-BF16 for the
    # bf16 attention tile, paged_attention_amx.h), compiled only where the CPU has them and the
    # compiler knows them (an older g++ would otherwise fail the whole build); the kernels still
    # ask the OS for the tile state before their first use.
    if tier == "avx512_vnni" and (isa.amx_int8 or isa.amx_bf16) and compiler_has_amx():
        flags.append("-mamx-tile")
        if isa.amx_int8:
            flags += ["-mamx-int8", "-DFITSERVE_AMX_INT8"]
        if isa.amx_bf16 and isa.avx512_bf16:
            flags += ["-mamx-bf16", "-DFITSERVE_AMX_BF16"]
    return flags


_AMX_PROBE = b"""#include <immintrin.h>
void f(void* c, const void* a) { _tile_loadconfig(c); _tile_loadd(0, a, 64); _tile_dpbssd(1, 0, 0);
  _tile_dpbf16ps(2, 0, 0); _tile_release(); }
"""


@functools.cache
def compiler_has_amx() -> bool:
    """Whether the C++ compiler the kernels build with accepts the AMX-INT8 and AMX-BF16
    intrinsics: a syntax-only compile of a few of them, its answer kept in FITSERVE_HOME per
    compiler binary (path, size, mtime) and probe text, so a start-up with the kernels cached
    does not run the compiler."""
    import hashlib
    import os
    import shutil
    import subprocess

    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        return False
    st = os.stat(os.path.realpath(cxx))
    key = hashlib.sha256(f"{os.path.realpath(cxx)}:{st.st_size}:{st.st_mtime_ns}".encode()
                         + _AMX_PROBE)
    mark = envs.fitserve_home() / "extensions" / f"amx-probe-{key.hexdigest()[:16]}"
    if mark.is_file():
        return mark.read_text().strip() == "1"
    try:
        done = subprocess.run([cxx, "-mamx-tile", "-mamx-int8", "-mamx-bf16", "-fsyntax-only",
                               "-x", "c++", "-"],
                              input=_AMX_PROBE, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    ok = done.returncode == 0
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text("1" if ok else "0")
    except OSError:  # a read-only home: ask again next time
        pass
    return ok
