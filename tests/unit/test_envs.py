"""fitserve.envs is the one reader of the FITSERVE_* environment variables."""

from __future__ import annotations

import re
from pathlib import Path

import platformdirs
import pytest

from fitserve import envs

PKG = Path(__file__).resolve().parents[2] / "fitserve"


def test_home_is_the_variable_expanded_else_the_platform_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FITSERVE_HOME", "~/fs-home")
    assert envs.fitserve_home() == Path.home() / "fs-home"
    for unset in ("", "  "):
        monkeypatch.setenv("FITSERVE_HOME", unset)
        assert envs.fitserve_home() == Path(platformdirs.user_cache_dir("fitserve"))


def test_values_parse_and_blank_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FITSERVE_DISABLE_CPP", "0")
    assert envs.FITSERVE_DISABLE_CPP() is False
    monkeypatch.setenv("FITSERVE_DISABLE_CPP", "1")
    assert envs.FITSERVE_DISABLE_CPP() is True
    monkeypatch.setenv("FITSERVE_TP_WATCHDOG_S", "2")
    assert envs.FITSERVE_TP_WATCHDOG_S() == 2.0
    monkeypatch.setenv("FITSERVE_TP_WATCHDOG_S", "")
    assert envs.FITSERVE_TP_WATCHDOG_S() == 60.0
    monkeypatch.setenv("FITSERVE_ALLOW_LONG_MAX_MODEL_LEN", "True")
    assert envs.FITSERVE_ALLOW_LONG_MAX_MODEL_LEN() is True


def test_no_other_module_reads_a_fitserve_variable() -> None:
    direct = re.compile(r"""(environ|getenv)\b[^\n]*["']FITSERVE_""")
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                 if p.name != "envs.py" and direct.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
