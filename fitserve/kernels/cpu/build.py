"""Compile a C++ kernel source at first use and cache it under ``$FITSERVE_HOME/extensions``.

The cache key is the source's sha256, the ISA flags and the torch version, so a changed source,
another CPU or another torch never loads a stale build. While a build runs a log line says so
(it takes ~30-90 s on 2 cores). Without a compiler, on a failed build, or with
``FITSERVE_DISABLE_CPP=1`` the loader returns None and the caller runs its pure-torch path.

``python -m fitserve.kernels.cpu.build`` builds every extension this CPU's tier uses into the
cache ahead of time (``make setup`` runs it), so no server start compiles anything.
:func:`built_in_process` and :func:`loaded_extensions` say what this process compiled and loaded
(the start-up summary prints them; a test checks that nothing loads after /health is ok).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

from fitserve import envs
from fitserve.envs import fitserve_home
from fitserve.kernels.cpu.isa import CpuIsa, build_tier, compile_flags, detect_isa

log = logging.getLogger("fitserve.kernels.cpu")
SOURCE_DIR = Path(__file__).parent
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_built: list[str] = []  # extensions this process compiled (not found in the cache)
_name_locks: dict[str, threading.Lock] = {}  # one per extension name, held while it builds

EXTENSIONS: dict[str, str] = {
    "qlinear": "qlinear.cpp", "ggml_blocks": "ggml_blocks.cpp", "fused_ops": "fused_ops.cpp",
    "paged_attention": "paged_attention.cpp", "paged_attention_kvq": "paged_attention_kvq.cpp",
    "decode_step": "decode_step.cpp", "dense_gemv": "dense_gemv.cpp", "fp8_gemv": "fp8_gemv.cpp",
    "moe_experts": "moe_experts.cpp", "kvq_write": "kvq_write.cpp",
}
"""Every extension's name and source (the names ``load_extension`` is called with)."""


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


def _tier_flags(isa: CpuIsa, tier: str) -> list[str]:
    # NOTE: the tier macro is part of the key too: two tiers never share a build directory.
    return ["-DFITSERVE_TIER_" + tier.upper(), *compile_flags(isa, tier)]


def _all_flags() -> list[str]:
    isa = detect_isa()
    return _tier_flags(isa, build_tier(isa))


def compile_errors(name: str, isa: CpuIsa) -> str | None:
    """The compiler's errors for extension ``name`` built for another CPU ``isa`` (a syntax-only
    compile with the flags of that CPU's own tier, whatever FITSERVE_CPU_TIER says, and
    cpp_extension's include paths and standard), or None.

    NOTE: a CPU's build compiles only its own ISA's branches (the AMX tiles, the AVX512-BF16
    paths and their fallbacks), so code for other CPUs is otherwise never compiled here: an AMX
    attention tile once stopped compiling and no non-AMX host noticed."""
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    cmd = [os.environ.get("CXX", "c++"), "-std=c++20", "-fsyntax-only", "-fopenmp", "-w",
           *includes, *_tier_flags(isa, isa.tier), str(SOURCE_DIR / EXTENSIONS[name])]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else done.stderr[-4000:]


def load_extension(name: str, source: str) -> ModuleType | None:
    """The compiled module for ``fitserve/kernels/cpu/<source>``, or None (use the fallback).

    The source registers its ops with TORCH_LIBRARY; they are then reachable as
    ``torch.ops.fitserve.<op>`` and the returned module only signals that loading worked.
    """
    with _lock:
        if name in _loaded:
            return _loaded[name]
        name_lock = _name_locks.setdefault(name, threading.Lock())
    # NOTE: one lock per name, not the module's: build_all compiles several at once (threads;
    # each compile is a compiler subprocess), and a caller loading one never waits for another.
    with name_lock:
        with _lock:
            if name in _loaded:
                return _loaded[name]
        mod = _build(name, SOURCE_DIR / source)
        with _lock:
            _loaded[name] = mod
        return mod


def loaded_extensions() -> list[str]:
    """Names of the extensions loaded in this process (built or found in the cache), sorted."""
    with _lock:
        return sorted(n for n, m in _loaded.items() if m is not None)


def built_in_process() -> list[str]:
    """Names of the extensions this process compiled because the cache had no build."""
    with _lock:
        return list(_built)


def extensions_for_tier(tier: str) -> list[str]:
    """The extensions the engine can load on a CPU of ``tier`` (what a prebuild builds).

    NOTE: dense_gemv (batch-1 bf16 GEMV) runs only on the vector tiers (``bf16_gemv_preferred``);
    the scalar tier keeps torch's kernel, so it is not built there. Every other extension has a
    path on every tier.
    """
    return [n for n in EXTENSIONS if not (n == "dense_gemv" and tier == "scalar")]


def _load_cached(name: str, out_dir: Path, key: str) -> ModuleType | None:
    """The cached build in ``out_dir`` loaded directly (no ninja run), or None if absent/bad."""
    so = out_dir / f"{name}_{key}.so"
    if not so.is_file():
        return None
    try:
        import torch

        torch.ops.load_library(str(so))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as exc:  # a truncated or foreign .so: rebuild it
        log.warning("cached %s did not load (%s): rebuilding", so, exc)
        return None
    log.info("loaded C++ kernels %s (%s)", name, so)
    return ModuleType(name)


@contextlib.contextmanager
def build_dir_lock(out_dir: Path) -> Iterator[None]:
    """Hold this build directory against other fitserve processes for one build.

    torch's own lock is a file created and deleted around its build (``FileBaton``): a process
    killed mid-build (Ctrl-C, a test's start-up timeout) leaves it behind, and every later
    process then waits on it forever. This lock is an flock, released by the kernel when its
    holder dies, so once we hold it nobody else is building here and a torch ``lock`` file
    left in the directory is stale: it is removed.
    """
    with open(out_dir / ".fitserve-build.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = out_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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
    # NOTE: the key names the sources, flags and torch, so a .so under it is this build:
    # loading it directly skips cpp_extension's ninja check (~0.1-0.2 s per extension).
    cached = _load_cached(name, out_dir, key)
    if cached is not None:
        return cached
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with build_dir_lock(out_dir):
            cached = _load_cached(name, out_dir, key)  # another process built it meanwhile
            if cached is not None:
                return cached
            fresh = not any(out_dir.glob("*.so"))
            if fresh:
                log.warning("building C++ kernels %s for %s (first use; cached in %s)", name,
                            build_tier(detect_isa()), out_dir)
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
        with _lock:
            _built.append(name)
    log.info("loaded C++ kernels %s (%s)", name, out_dir)
    return mod if isinstance(mod, ModuleType) else ModuleType(name)


def build_all(names: list[str] | None = None) -> dict[str, bool]:
    """Build (or find in the cache) ``names`` (default: every extension this CPU's tier uses);
    returns name -> loaded.

    NOTE: the builds run side by side, one per core this process may use (each extension is one
    translation unit, so a compile keeps one core busy): on 2 cores a cold build of all ten
    takes about half the time of one after another.
    """
    tier = build_tier(detect_isa())
    todo = extensions_for_tier(tier) if names is None else list(names)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = min(len(todo), cores or 1)
    if workers < 2:
        return {n: load_extension(n, EXTENSIONS[n]) is not None for n in todo}
    with ThreadPoolExecutor(workers, thread_name_prefix="fitserve-build") as pool:
        loaded = list(pool.map(lambda n: load_extension(n, EXTENSIONS[n]) is not None, todo))
    return dict(zip(todo, loaded, strict=True))


def main(argv: list[str] | None = None) -> int:
    """``python -m fitserve.kernels.cpu.build [NAME ...]``: prebuild into $FITSERVE_HOME."""
    import argparse
    import time

    p = argparse.ArgumentParser(prog="python -m fitserve.kernels.cpu.build", description=main.__doc__,
                                allow_abbrev=False)
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"extensions to build (default: all this CPU uses; of {', '.join(EXTENSIONS)})")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in EXTENSIONS]
    if unknown:
        p.error(f"unknown extension {', '.join(unknown)} (known: {', '.join(EXTENSIONS)})")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if cpp_disabled():
        print("FITSERVE_DISABLE_CPP is set: nothing to build")
        return 0
    t0 = time.perf_counter()
    isa = detect_isa()
    results = build_all(args.names or None)
    failed = [n for n, ok in results.items() if not ok]
    print(f"{len(results) - len(failed)}/{len(results)} C++ kernels ready for {build_tier(isa)} "
          f"({isa.describe()}) in {fitserve_home() / 'extensions'}: {time.perf_counter() - t0:.1f} s"
          f"{'; failed: ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
