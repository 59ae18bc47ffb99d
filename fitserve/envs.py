"""Every ``FITSERVE_*`` environment variable fitserve reads, and the one reader of each.

Each :class:`EnvVar` names a variable, its default, how its text becomes a value, and what it
does; call it to read the variable now (an unset or blank variable is its default). Other
modules read the environment through here only, so this file is the list of them all.
No torch and nothing else of fitserve's: the torch-free layers (ledger/, kv/, sched/) use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EnvVar(Generic[T]):
    """One environment variable: ``var()`` is its value now."""

    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def __call__(self) -> T:
        raw = os.environ.get(self.name, "").strip()
        return self.parse(raw) if raw else self.default


def _flag_unless_zero(text: str) -> bool:
    return text != "0"


def _flag_if_true(text: str) -> bool:
    return text.lower() in ("1", "true")


FITSERVE_HOME: EnvVar[str | None] = EnvVar(
    "FITSERVE_HOME", None, str,
    "root of fitserve's caches (models, C++ extensions, compiled steps, step-time models, "
    "measured hardware); default: platformdirs' user cache dir for fitserve")
FITSERVE_DISABLE_CPP: EnvVar[bool] = EnvVar(
    "FITSERVE_DISABLE_CPP", False, _flag_unless_zero,
    "1: load no C++ kernel; every op takes its pure-torch path (and the planner counts that)")
FITSERVE_CPU_TIER: EnvVar[str] = EnvVar(
    "FITSERVE_CPU_TIER", "", str.lower,
    "build the C++ kernels for a lower ISA tier than the CPU's: avx512, avx2 or scalar")
FITSERVE_DECODE_LOOP: EnvVar[bool] = EnvVar(
    "FITSERVE_DECODE_LOOP", True, _flag_unless_zero,
    "0: decode-only steps run through the model's modules, not the fused decode loop (same bits)")
FITSERVE_DECODE_NATIVE: EnvVar[bool] = EnvVar(
    "FITSERVE_DECODE_NATIVE", True, _flag_unless_zero,
    "0: the fused decode loop runs its layer loop in Python instead of the C++ op")
# NOTE: off by default: on Zen 5 the second copy (1.8x the packed weights' bytes) measured
# TTFT 1.01x and W2 0.97x against packing per call (docs/benchmarks.md); the per-call packing
# cost was measured at ~20% of a W2 step on an AMX Xeon, where it is worth trying.
FITSERVE_PREPACK_PANELS: EnvVar[bool] = EnvVar(
    "FITSERVE_PREPACK_PANELS", False, _flag_if_true,
    "1: packed projections also hold a second copy laid out at load for the M > 1 panel kernels "
    "(codes + fp32 scales, counted by the ledger) instead of packing panels per call")
# NOTE: the panel layout as THE held weight (one copy, the same bytes as row-major): the batch-1
# GEMV streams it at ~1.0 of a plain read where the row-major kernel reached ~0.5
# (docs/benchmarks.md, wt-panel); 0 keeps the weights row-major (A/B, debugging).
FITSERVE_HOLD_PANELS: EnvVar[bool] = EnvVar(
    "FITSERVE_HOLD_PANELS", True, _flag_unless_zero,
    "0: packed int4/int8 projections stay row-major instead of being held in the panel layout "
    "of the int8-activation kernels")
# NOTE: read by the C++ kernels themselves (amx_state.h), once per process; listed here so every
# FITSERVE_* variable is in one place.
FITSERVE_AMX: EnvVar[bool] = EnvVar(
    "FITSERVE_AMX", True, _flag_unless_zero,
    "0: no AMX tiles even where the CPU has them: held int4/int8 weights run on the AVX-512 VNNI "
    "panels (same bits) and bf16 attention on the VDPBF16PS tile (A/B, debugging)")
# NOTE: read by the C++ kernel itself (paged_attention.cpp), once per process.
FITSERVE_AMX_ATTENTION: EnvVar[str] = EnvVar(
    "FITSERVE_AMX_ATTENTION", "auto", str,
    "where the CPU has AMX-BF16, which bf16 attention ops run on its tiles: auto (decode and "
    "prefill from 8 query heads per KV head, where the tiles are faster for both), 1 (decode and "
    "prefill for every model: the prefill's attention ~1.9x faster, decode's ~1.7x slower at 3 "
    "heads per KV head), prefill (the prefill alone: no decode cost, but prefill rows no longer "
    "bitwise the decode kernel's), 0 (none)")
FITSERVE_ALLOW_LONG_MAX_MODEL_LEN: EnvVar[bool] = EnvVar(
    "FITSERVE_ALLOW_LONG_MAX_MODEL_LEN", False, _flag_if_true,
    "1: a max_model_len past the model's trained context is a warning, not an error "
    "(vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)")
FITSERVE_TP_WATCHDOG_S: EnvVar[float] = EnvVar(
    "FITSERVE_TP_WATCHDOG_S", 60.0, float,
    "seconds a tensor-parallel rank may wait in a collective before the group is declared broken")
FITSERVE_TP_PARENT: EnvVar[int] = EnvVar(
    "FITSERVE_TP_PARENT", 0, int,
    "set by the engine for the workers it spawns: its pid, which each worker watches to exit with it")
FITSERVE_LOG_STATS_INTERVAL: EnvVar[float] = EnvVar(
    "FITSERVE_LOG_STATS_INTERVAL", 10.0, float,
    "seconds between `fitserve serve`'s throughput log lines while busy (vLLM's "
    "VLLM_LOG_STATS_INTERVAL); 0 turns them off")
FITSERVE_API_KEY: EnvVar[str | None] = EnvVar(
    "FITSERVE_API_KEY", None, str,
    "`fitserve serve`'s default --api-key: requests must bring it as a Bearer token")

def fitserve_home() -> Path:
    """Root of fitserve's caches: ``$FITSERVE_HOME``, else platformdirs' user cache dir for
    "fitserve" (``~/.cache/fitserve`` on Linux)."""
    home = FITSERVE_HOME()
    if home:
        return Path(home).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fitserve"))
