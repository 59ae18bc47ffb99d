"""The C++ build machinery (fitserve/kernels/cpu/build.py, isa.py): cache keys, tiers, opt-out."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fitserve.kernels.cpu import build
from fitserve.kernels.cpu.isa import (
    TIERS,
    CpuIsa,
    build_tier,
    compile_flags,
    compiler_has_amx,
    detect_isa,
    isa_from_flags,
)

ROOT = Path(__file__).resolve().parents[2]


def test_disable_cpp_makes_the_ops_unavailable() -> None:
    code = ("from fitserve.kernels.cpu.qlinear import qlinear_ops_available, int4_linear\n"
            "import torch\n"
            "assert qlinear_ops_available() is False\n"
            "try:\n"
            "    int4_linear(torch.ones(1, 32), torch.zeros(1, 16, dtype=torch.uint8),\n"
            "                torch.ones(1, 1).half(), None, 32, False)\n"
            "except RuntimeError as e:\n"
            "    assert 'unavailable' in str(e)\n"
            "else:\n"
            "    raise SystemExit('no error without the extension')\n"
            "print('ok')\n")
    env = {**os.environ, "FITSERVE_DISABLE_CPP": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_build_key_follows_source_headers_flags(tmp_path: Path) -> None:
    src, hdr = tmp_path / "k.cpp", tmp_path / "k_impl.h"
    hdr.write_text("int f() { return 1; }\n")
    src.write_text('#include "k_impl.h"\n#include <vector>\nint g() { return f(); }\n')
    assert build.source_files(src) == [src.resolve(), hdr.resolve()]
    key = build.build_key(src, ["-mavx2"])
    assert key == build.build_key(src, ["-mavx2"])  # stable
    assert build.build_key(src, ["-mavx2", "-mfma"]) != key  # other flags
    hdr.write_text("int f() { return 2; }\n")
    key_h = build.build_key(src, ["-mavx2"])
    assert key_h != key  # a changed header rebuilds
    src.write_text('#include "k_impl.h"\nint g() { return -f(); }\n')
    assert build.build_key(src, ["-mavx2"]) not in (key, key_h)


def test_changed_source_gets_a_new_build_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for f in build.source_files(build.SOURCE_DIR / "qlinear.cpp"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    before = build.build_dir("qlinear", "qlinear.cpp")
    with (tmp_path / "qlinear_simd.h").open("a") as fh:
        fh.write("\n// a change\n")
    after = build.build_dir("qlinear", "qlinear.cpp")
    assert before != after and before.parent == after.parent
    assert after.name.startswith("qlinear-")


def test_loaded_extension_lives_in_its_build_dir() -> None:
    from fitserve.kernels.cpu.qlinear import qlinear_ops_available

    if not qlinear_ops_available():
        pytest.skip("the qlinear extension could not be built here")
    assert any(build.build_dir("qlinear", "qlinear.cpp").glob("*.so"))


def test_tier_from_flags_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    zen4 = isa_from_flags({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                           "avx512_vnni", "avx512_bf16"})
    assert zen4.tier == "avx512_vnni" and not zen4.amx_int8
    assert isa_from_flags({"avx2", "fma", "f16c"}).tier == "avx2"
    assert isa_from_flags({"avx2", "fma"}).tier == "scalar"  # no F16C: fp16 scales need it
    assert CpuIsa().tier == "scalar"
    monkeypatch.delenv("FITSERVE_CPU_TIER", raising=False)
    assert build_tier(zen4) == "avx512_vnni"
    monkeypatch.setenv("FITSERVE_CPU_TIER", "avx2")
    assert build_tier(zen4) == "avx2"
    assert "-mavx512f" not in compile_flags(zen4) and "-mavx2" in compile_flags(zen4)
    monkeypatch.setenv("FITSERVE_CPU_TIER", "avx512_vnni")  # never above what the CPU runs
    assert build_tier(isa_from_flags({"avx2", "fma", "f16c"})) == "avx2"
    monkeypatch.setenv("FITSERVE_CPU_TIER", "bogus")
    assert build_tier(zen4) == "avx512_vnni"
    assert compile_flags(zen4, "scalar") == []
    # AVX512-BF16 at the VNNI tier only: the avx512 tier is Skylake-X's, BF16-less paths and all
    assert "-mavx512bf16" in compile_flags(zen4, "avx512_vnni")
    assert "-mavx512bf16" not in compile_flags(zen4, "avx512")
    assert set(TIERS) >= {detect_isa().tier}


def test_every_loaded_extension_is_registered_for_prebuild() -> None:
    """``python -m fitserve.kernels.cpu.build`` builds EXTENSIONS: it must name every
    ``load_extension(name, source)`` call in the package (else a prebuilt cache misses one)."""
    import re

    calls: set[tuple[str, str]] = set()
    for py in (ROOT / "fitserve").rglob("*.py"):
        calls |= set(re.findall(r'load_extension\("(\w+)", "(\w+\.cpp)"\)', py.read_text()))
    assert calls == set(build.EXTENSIONS.items())
    assert all((build.SOURCE_DIR / src).is_file() for src in build.EXTENSIONS.values())
    assert "dense_gemv" not in build.extensions_for_tier("scalar")  # torch's GEMV there
    assert build.extensions_for_tier("avx2") == list(build.EXTENSIONS)


def test_prebuild_command_refuses_an_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build.main(["qlinear", "qlinaer"])
    assert exc.value.code == 2 and "unknown extension qlinaer" in capsys.readouterr().err



def test_a_killed_builds_torch_lock_is_cleared_and_builds_are_serialised(tmp_path: Path) -> None:
    """torch's build 'lock' file, left by a process killed mid-build, used to make every later
    server wait forever; held under fitserve's flock it is known stale and removed. A second
    process wanting the same directory waits for the first's flock (released when it exits)."""
    import time

    (tmp_path / "lock").write_text("")
    with build.build_dir_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        code = ("import sys; from pathlib import Path; from fitserve.kernels.cpu import build;"
                "d = Path(sys.argv[1]); ctx = build.build_dir_lock(d); ctx.__enter__();"
                "(d / 'acquired').write_text('')")
        other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
        for _ in range(10):  # the child imports, then waits on our flock
            time.sleep(0.2)
        assert other.poll() is None and not (tmp_path / "acquired").exists()
    assert other.wait(timeout=60) == 0 and (tmp_path / "acquired").exists()


def test_amx_flags_only_with_amx_at_the_vnni_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AMX tiles are compiled in only for a CPU with them at the avx512_vnni tier (AMX-INT8
    for the held panels; AMX-BF16 for the attention tile, which also needs AVX512-BF16), and
    only when the compiler accepts them (else the whole build would fail)."""
    from fitserve.kernels.cpu import isa as isa_mod

    base = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    xeon = isa_from_flags(base | {"avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"})
    monkeypatch.delenv("FITSERVE_CPU_TIER", raising=False)
    monkeypatch.setattr(isa_mod, "compiler_has_amx", lambda: True)
    assert {"-DFITSERVE_AMX_INT8", "-DFITSERVE_AMX_BF16", "-mamx-bf16"} <= set(compile_flags(xeon))
    no_bf16 = compile_flags(isa_from_flags(base | {"amx_tile", "amx_int8", "amx_bf16"}))
    assert "-DFITSERVE_AMX_INT8" in no_bf16 and "-DFITSERVE_AMX_BF16" not in no_bf16
    assert not {f for f in compile_flags(isa_from_flags(base)) if "amx" in f.lower()}
    assert not {f for f in compile_flags(xeon, "avx512") if "amx" in f.lower()}
    monkeypatch.setattr(isa_mod, "compiler_has_amx", lambda: False)
    assert not {f for f in compile_flags(xeon) if "amx" in f.lower()}


_AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
OTHER_CPUS = {
    # (its /proc/cpuinfo flags, the macros whose branches only its build compiles)
    "xeon_amx": (_AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
                 (b"FITSERVE_AMX", b"__AMX")),
    # Cascade Lake. NOTE: not Skylake-X (AVX-512 without VNNI or BF16): that is the avx512
    # tier, built (without BF16) and run by the tier-subprocess tests here.
    "vnni_without_bf16": (_AVX512 | {"avx512_vnni"}, (b"__AVX512BF16__",)),
}


@pytest.mark.slow
@pytest.mark.parametrize("cpu", OTHER_CPUS)
def test_other_cpus_branches_compile(cpu: str) -> None:
    """The kernels' branches for a CPU other than this one compile: an AMX Xeon's tiles and an
    AVX-512 VNNI CPU without AVX512-BF16 - each extension whose sources test such a macro,
    syntax-only with that CPU's flags (this CPU's own build compiles its own)."""
    flags, macros = OTHER_CPUS[cpu]
    isa = isa_from_flags(flags)
    if cpu == "xeon_amx" and not compiler_has_amx():
        pytest.skip("the compiler does not know the AMX intrinsics (the build leaves them out)")
    if build._tier_flags(isa, isa.tier) == build._all_flags():
        pytest.skip("this CPU's own build compiles these branches")
    names = [n for n, src in build.EXTENSIONS.items()
             if any(m in f.read_bytes() for f in build.source_files(build.SOURCE_DIR / src) for m in macros)]
    assert names  # the macros are still what the sources test
    with ThreadPoolExecutor(2) as pool:
        errors = dict(zip(names, pool.map(lambda n: build.compile_errors(n, isa), names), strict=True))
    assert not {n: e for n, e in errors.items() if e}, errors
