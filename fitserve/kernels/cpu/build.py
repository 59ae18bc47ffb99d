"""Compile a C++ kernel source at first use and cache it under ``$FITSERVE_HOME/extensions``.

The cache key is the source's sha256, the ISA flags and the torch version, so a changed source,
another CPU or another torch never loads a stale build. While a build runs a log line says so
(it takes ~30-90 s on 2 cores). Without a compiler, on a failed build, or with
``FITSERVE_DISABLE_CPP=1`` the loader returns None and the caller runs its pure-torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from types import ModuleType

from fitserve import envs
from fitserve.envs import fitserve_home
from fitserve.kernels.cpu.isa import build_tier, compile_flags, detect_isa

log = logging.getLogger("fitserve.kernels.cpu")
SOURCE_DIR = Path(__file__).parent
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def cpp_disabled() -> bool:
    """True when FITSERVE_DISABLE_CPP is set (forces every pure-torch fallback)."""
    return envs.FITSERVE_DISABLE_CPP()


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def source_files(source: Path) -> list[Path]:
    """``source`` and every header it pulls in with ``#include "..."`` (recursively, resolved
    next to the including file), in a stable order: all of them go into the build key."""
    seen: dict[Path, None] = {}
    todo = [source.resolve()]
    while todo:
        f = todo.pop(0)
        if f in seen or not f.is_file():
            continue
        seen[f] = None
        includes = _LOCAL_INCLUDE.findall(f.read_bytes())
        todo.extend((f.parent / m.decode()).resolve() for m in includes)
    return list(seen)


def build_key(source: Path, flags: list[str]) -> str:
    """16 hex digits of sha256 over the source and its local headers, the flags and torch."""
    import torch

    h = hashlib.sha256()
    for f in source_files(source):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def build_dir(name: str, source: str) -> Path:
    """Where ``load_extension(name, source)`` builds (and finds) its cached module."""
    flags = _all_flags()
    return fitserve_home() / "extensions" / f"{name}-{build_key(SOURCE_DIR / source, flags)}"


def _all_flags() -> list[str]:
    isa = detect_isa()
    # NOTE: the tier macro is part of the key too: two tiers never share a build directory.
    return ["-DFITSERVE_TIER_" + build_tier(isa).upper(), *compile_flags(isa)]


def load_extension(name: str, source: str) -> ModuleType | None:
    """The compiled module for ``fitserve/kernels/cpu/<source>``, or None (use the fallback).

    The source registers its ops with TORCH_LIBRARY; they are then reachable as
    ``torch.ops.fitserve.<op>`` and the returned module only signals that loading worked.
    """
    with _lock:
        if name in _loaded:
            return _loaded[name]
        _loaded[name] = mod = _build(name, SOURCE_DIR / source)
        return mod


def _build(name: str, src: Path) -> ModuleType | None:
    if cpp_disabled():
        log.info("FITSERVE_DISABLE_CPP is set: %s runs its pure-torch path", name)
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler found: %s runs its pure-torch path", name)
        return None
    flags = _all_flags()
    key = build_key(src, flags)
    out_dir = fitserve_home() / "extensions" / f"{name}-{key}"
    out_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(out_dir.glob("*.so"))
    if fresh:
        log.warning("building C++ kernels %s for %s (first use; cached in %s)", name,
                    build_tier(detect_isa()), out_dir)
    try:
        from torch.utils import cpp_extension

        mod = cpp_extension.load(
            name=f"{name}_{key}", sources=[str(src)], build_directory=str(out_dir),
            extra_cflags=["-O3", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
        )
    except Exception as exc:  # compiler missing headers, bad flags, ... -> fallback, loudly
        log.warning("building %s failed (%s): using the pure-torch path", name,
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return None
    if fresh:
        log.warning("built %s", name)
    return mod if isinstance(mod, ModuleType) else ModuleType(name)
