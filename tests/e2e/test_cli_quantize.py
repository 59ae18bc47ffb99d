"""`fitserve quantize` as a user runs it: a real process writes the folder, `fitserve generate`
runs it; bad arguments exit 2 with a message naming the problem, before any model is read."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fitserve.cli import main as fitserve_main
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

FITSERVE = str(Path(sys.executable).with_name("fitserve"))
GENERATE = ["--dtype", "float32", "--max-tokens", "8", "--max-model-len", "256", "--chat",
            "Name a fruit."]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FITSERVE, *args], capture_output=True, text=True, timeout=900)


def _calib(path: Path, words: int = 2000) -> Path:
    rng = random.Random(0)
    vocab = ["the", "sea", "wind", "ship", "harbour", "letter", "morning", "garden", "house",
             "friend", "evening", "road"]
    path.write_text(" ".join(rng.choice(vocab) for _ in range(words)) + "\n", encoding="utf-8")
    return path


def test_quantize_then_generate_equals_rtn_at_load(tmp_path: Path, smollm2_path: Path) -> None:
    out = tmp_path / "int4"
    proc = _run("quantize", "smollm2-135m", "--method", "rtn", "--bits", "4", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out) and "210 x int4-g32-asym, 1 x int8-ch" in proc.stderr
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (quant["quant_method"], quant["method"], quant["bits"], quant["group_size"],
            quant["symmetric"]) == ("fitserve", "rtn", 4, 32, False)
    folder = _run("generate", "--model", str(out), *GENERATE)
    at_load = _run("generate", "--model", str(smollm2_path), "--weights", "int4", *GENERATE)
    assert folder.returncode == 0 and at_load.returncode == 0, folder.stderr + at_load.stderr
    assert folder.stdout.strip() and folder.stdout == at_load.stdout


def _quantize(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`fitserve quantize ...` in-process: (exit status, stderr)."""
    capsys.readouterr()
    try:
        code = fitserve_main(["quantize", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def test_bad_arguments_exit_2_naming_the_problem(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = str(write_tiny_gguf(tmp_path / "m.gguf", TinyGGUF()))
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    out = ["-o", str(tmp_path / "out")]
    cases = [
        ([model, "--method", "hqq", *out], "invalid choice: 'hqq'"),
        ([model, "--bits", "3", *out], "invalid choice: 3"),
        ([model, "--group-size", "48", *out], "32, 64 or 128, got 48"),
        ([model, "--bits", "8", "--group-size", "16", *out], "got 16"),
        ([model, "--method", "gptq", *out], "--calib FILE"),
        ([model, "--method", "awq", "--calib", str(tmp_path / "none.txt"), *out],
         "none.txt: cannot read"),
        ([str(tmp_path / "no-such.gguf"), *out], "no-such.gguf"),
        ([model, "-o", str(full)], "not empty (pass --force"),
        ([model, "-o", str(tmp_path)], "holds the model being quantized"),
        ([model], "-o/--output"),
    ]
    for argv, message in cases:
        code, err = _quantize(argv, capsys)
        assert code == 2 and message in err, (argv, err)
    assert not (tmp_path / "out").exists()


def test_rtn_ignores_calib_with_a_warning_and_force_rewrites(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(write_tiny_gguf(tmp_path / "m.gguf", TinyGGUF()))
    out = tmp_path / "out"
    calib = str(_calib(tmp_path / "calib.txt", 50))
    code, err = _quantize([model, "--calib", calib, "--sym", "-o", str(out)], capsys)
    assert code == 0 and "--calib is ignored by --method rtn" in err
    code, err = _quantize([model, "--bits", "8", "-o", str(out), "--force"], capsys)
    assert code == 0, err
    formats = json.loads((out / "config.json").read_text())["quantization_config"]["formats"]
    assert set(formats.values()) == {"int8-ch"}


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_write_a_folder_the_engine_runs(
        tmp_path: Path, method: str, capsys: pytest.CaptureFixture[str]) -> None:
    """On a tiny model, in-process (quick); the default model's run is the slow test below."""
    model = str(write_tiny_gguf(tmp_path / "m.gguf", TinyGGUF(vocab=301)))
    out = tmp_path / method
    calib = str(_calib(tmp_path / "calib.txt", 400))
    code, err = _quantize([model, "--method", method, "--group-size", "64", "--calib", calib,
                           "--calib-seq-len", "64", "--calib-max-seqs", "2", "-o", str(out)],
                          capsys)
    assert code == 0, err
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["method"] == method and quant["calibration"]["sequences"] == 2
    assert quant["calibration"]["file"] == "calib.txt"
    assert set(quant["formats"].values()) == {"int4-g64-asym", "int8-ch"}
    assert fitserve_main(["generate", "--model", str(out), "--dtype", "float32",
                          "--max-tokens", "4", "--ignore-eos", "the"]) == 0


# NOTE: awq / gptq on the default model end to end take 4-5 minutes each here: benchmarks/
# bench_quant.py runs them (`fitserve quantize` of each, then the engine on the folder); the
# tiny-model test above runs the same CLI paths.
