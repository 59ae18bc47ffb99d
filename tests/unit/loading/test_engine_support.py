"""One check says what the engine cannot run in a GGUF file, naming every missing part; the
loader (generate / serve) and the planner (`fitserve plan FILE --gpu cpu`) both call it.

Files are written with gguf-py's GGUFWriter. The unsupported architecture, tensor type and
tokenizer model are picked as the first of a few candidates the engine's own lists do not
hold, so the tests keep testing a refusal as those lists widen.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from fitserve.cli.main import main as fitserve_main
from fitserve.config import SUPPORTED_ARCHITECTURES
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.gguf import read_gguf, read_gguf_tokenizer
from fitserve.loading.gguf_spec import read_gguf_header
from fitserve.loading.support import (
    SUPPORTED_GGUF_TOKENIZER_MODELS,
    SUPPORTED_GGUF_TYPES,
    EngineCannotRunError,
    gguf_support,
)
from fitserve.tools.planner.cli import main as plan_main
from tests.tiny_gguf import TinyGGUF, add_tiny_vocab, tensor_shapes, write_tiny_gguf


def first_unsupported(candidates: tuple[str, ...], supported: tuple[str, ...]) -> str:
    left = [c for c in candidates if c not in supported]
    if not left:
        pytest.skip(f"the engine now supports all of {candidates}")
    return left[0]


ARCH = first_unsupported(("mamba", "rwkv6", "bloom"), SUPPORTED_ARCHITECTURES)
TYPE = first_unsupported(("Q8_1", "IQ4_NL", "Q5_1"), SUPPORTED_GGUF_TYPES)  # 32-weight blocks
TOKENIZER = first_unsupported(("rwkv", "t5", "plamo2"), SUPPORTED_GGUF_TOKENIZER_MODELS)


def write(path: Path, *, arch: str = "llama", qtype: str | None = None,
          tokenizer: str = "gpt2") -> Path:
    """A 2-layer llama-shaped file; ``qtype``: the type of the two ffn_down tensors (their
    bytes are zeros of the right size: nothing reads them)."""
    c = TinyGGUF(arch=arch)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.layers)
    w.add_context_length(c.context)
    w.add_embedding_length(c.hidden)
    w.add_feed_forward_length(c.ff)
    w.add_head_count(c.heads)
    w.add_head_count_kv(c.kv_heads)
    w.add_rope_freq_base(c.theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(c.vocab)
    add_tiny_vocab(w, c.vocab, tokenizer)
    rng = np.random.default_rng(0)
    for name, shape in tensor_shapes(c).items():
        if qtype is not None and name.endswith("ffn_down.weight"):
            block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
            w.add_tensor(name, np.zeros((shape[0], shape[1] // block * size), np.uint8),
                         raw_dtype=Q[qtype])
        else:
            w.add_tensor(name, (rng.standard_normal(shape) * 0.1 + 1.0).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


CASES = {
    "architecture": (dict(arch=ARCH), (f"architecture {ARCH!r}",)),
    "tensor type": (dict(qtype=TYPE), (f"tensor type {TYPE} (2 tensors",)),
    "tokenizer": (dict(tokenizer=TOKENIZER), (f"tokenizer model {TOKENIZER!r}",)),
    "all three": (dict(arch=ARCH, qtype=TYPE, tokenizer=TOKENIZER),
                  (f"architecture {ARCH!r}", f"tensor type {TYPE} (2 tensors",
                   f"tokenizer model {TOKENIZER!r}")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_check_names_every_missing_part(case: str, tmp_path: Path) -> None:
    kwargs, parts = CASES[case]
    support = gguf_support(read_gguf_header(write(tmp_path / "m.gguf", **kwargs)))
    assert not support.runnable
    assert len(support.missing) == len(parts)
    for part, missing in zip(parts, support.missing, strict=True):
        assert missing.startswith(part), (part, missing)


@pytest.mark.parametrize("case", list(CASES))
def test_the_loader_refuses_naming_every_part(case: str, tmp_path: Path) -> None:
    kwargs, parts = CASES[case]
    path = write(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(EngineCannotRunError) as err:
        read_gguf(path)
    assert all(p in str(err.value) for p in parts), str(err.value)
    assert str(path) in str(err.value)
    # the tokenizer alone reads whatever the architecture and tensor types; it refuses only
    # a tokenizer it cannot build, naming it
    tokenizer_parts = [p for p in parts if p.startswith("tokenizer")]
    if not tokenizer_parts:
        read_gguf_tokenizer(path)
        return
    with pytest.raises(EngineCannotRunError) as err:
        read_gguf_tokenizer(path)
    assert all(p in str(err.value) for p in tokenizer_parts), str(err.value)


@pytest.mark.parametrize("case", list(CASES))
def test_plan_on_cpu_says_cannot_run_and_exits_1(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kwargs, parts = CASES[case]
    path = write(tmp_path / "m.gguf", **kwargs)
    assert plan_main([str(path), "--gpu", "cpu"]) == 1
    out, err = capsys.readouterr()
    for text in (out.replace("\n", " "), err):
        assert "engine: cannot run (" in text
    line = err.strip().splitlines()[-1]
    assert all(p in line for p in parts), line
    # on a GPU the plan is about that GPU, not fitserve's engine: no refusal
    assert "cannot run" not in capsys.readouterr().out


def test_generate_refuses_naming_all_three(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    kwargs, parts = CASES["all three"]
    path = write(tmp_path / "m.gguf", **kwargs)
    assert fitserve_main(["generate", "--model", str(path), "hello", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot run" in err and all(p in err for p in parts), err


def test_a_supported_file_plans_and_loads_as_before(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_tiny_gguf(tmp_path / "ok.gguf", TinyGGUF())
    assert gguf_support(read_gguf_header(path)).missing == ()
    assert plan_main([str(path), "--gpu", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "cannot run" not in out + err
    read_gguf(path)  # loads
    # a refusal is still a ModelLoadError (the CLI's ValueError path)
    assert issubclass(EngineCannotRunError, ModelLoadError)


def test_serve_refuses_naming_all_three(tmp_path: Path) -> None:
    """A real `fitserve serve` process: it exits non-zero before serving, naming all three."""
    import os
    import socket
    import subprocess
    import sys

    kwargs, parts = CASES["all three"]
    path = write(tmp_path / "m.gguf", **kwargs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from fitserve.cli.main import main; "
         "sys.exit(main(sys.argv[1:]))", "serve", "--model", str(path), "--port", str(port)],
        capture_output=True, text=True, timeout=300, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode != 0
    assert "cannot run" in proc.stderr and all(p in proc.stderr for p in parts), proc.stderr
