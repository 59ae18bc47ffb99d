"""`fitserve generate` as a user runs it: a real process on the default model."""

from __future__ import annotations

import subprocess
import sys

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.sampling import SamplingParams


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fitserve.cli", "generate", *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_streams_the_same_text_as_the_engine(smollm2_path) -> None:  # type: ignore[no-untyped-def]
    proc = _cli("--model", str(smollm2_path), "--dtype", "float32", "--max-tokens", "12",
                "--max-model-len", "512", "--chat", "Name a fruit.")
    assert proc.returncode == 0, proc.stderr
    engine = Engine(EngineConfig(model=str(smollm2_path), dtype="float32", device="cpu", max_model_len=512))
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a fruit."}]),
                     add_special_tokens=False)
    expected = list(engine.stream(ids, SamplingParams(temperature=0.0, max_tokens=12)))[-1].text
    assert proc.stdout == expected + "\n"


def test_generate_bad_input_exits_nonzero_with_a_message(smollm2_path) -> None:  # type: ignore[no-untyped-def]
    proc = _cli("--model", str(smollm2_path), "--max-tokens", "0", "hello")
    assert proc.returncode == 2 and "max_tokens" in proc.stderr
    proc = _cli("--model", "/no/such/model.gguf", "hello")
    assert proc.returncode == 2 and "model.gguf" in proc.stderr
