"""The ledger follows a GGUF file's real per-tensor mix: `fitserve plan PATH --gpu cpu --json`
reports the very bytes an Engine on PATH holds (counted from the model's own storages) for
K-quant files held as their raw ggml blocks, a Q4_K_M-like mix (Q4_K + Q6_K + Q5_0 rows),
Q3_K held as Q6_K blocks and TQ1_0 as packed Q4_0, types dequantized at load, and the explicit --weights choices re-quantizing them; a Q4_K
file is held at 4.5 bits per weight, not bf16's 16."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.ledger.weights import engine_held_tensors, stored_format_rule, tensor_mix_bytes
from fitserve.loading.gguf_spec import read_gguf_header, spec_from_gguf_header, stored_types
from fitserve.model.ggml_linear import GgmlEmbedding, GgmlLinear
from tests.numerics.test_plan_engine_agree import COMMON, held_by_model
from tests.numerics.test_plan_engine_packed import check, packed_formats
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

# K-quant rows need K in multiples of 256: hidden 256, ff 512.
K_SHAPE = dict(hidden=256, ff=512, heads=4, kv_heads=2, vocab=320)
Q4_K_M_LIKE = TinyGGUF(**K_SHAPE, qtype=Q.Q4_K, embd_qtype=Q.Q6_K,  # type: ignore[arg-type]
                       types={"attn_v": Q.Q6_K, "ffn_down": Q.Q5_0}, tied=True)
DEQUANT_MIX = TinyGGUF(**K_SHAPE, qtype=Q.Q5_K, embd_qtype=Q.IQ4_XS,  # type: ignore[arg-type]
                       types={"attn_k": Q.Q3_K, "ffn_up": Q.Q2_K, "attn_output": Q.Q5_1,
                              "ffn_gate": Q.TQ1_0})


def ggml_formats(engine: Engine) -> set[str]:
    return {m.ggml_type for m in engine.runner.model.modules()
            if isinstance(m, GgmlLinear | GgmlEmbedding)}


@pytest.mark.parametrize("choice", ["as-stored", "int4", "int8", "bfloat16"])
@pytest.mark.parametrize(("case", "held"), [
    (Q4_K_M_LIKE, {"Q4_K", "Q6_K", "Q5_0"}),
    (DEQUANT_MIX, {"Q5_K", "Q5_1", "IQ4_XS", "Q6_K"}),  # Q3_K held as Q6_K blocks
], ids=["q4_k_m-like-tied", "q5_k-with-q3_k-q2_k"])
def test_ggml_plan_equals_engine(tmp_path: Path, case: TinyGGUF, held: set[str], choice: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", case)
    if choice == "bfloat16":  # check() runs float32: a dense choice is the model dtype
        choice = "float32"
    engine = check(path, choice, capsys)  # plan weight bytes == the model's own storages
    assert ggml_formats(engine) == (held if choice == "as-stored" else set())
    want_packed = {"as-stored": set() if case is Q4_K_M_LIKE else {"int4-g32-sym"},  # TQ1_0
                   "int4": {"int4-g32-asym", "int8-ch"}, "int8": {"int8-ch"},
                   "float32": set()}[choice]
    assert packed_formats(engine) == want_packed


def test_q4_k_file_held_at_4_5_bits_per_weight(tmp_path: Path) -> None:
    """Every matrix Q4_K (the embedding too, tied): the engine holds the file's bytes, 4.5 bits
    per matrix weight (+ the f32 norms), equal to the ledger's per-tensor mix of the file."""
    path = write_tiny_gguf(tmp_path / "m.gguf", TinyGGUF(**K_SHAPE, qtype=Q.Q4_K,  # type: ignore[arg-type]
                                                         tied=True))
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="bfloat16", **COMMON))
    held, _ = held_by_model(engine)
    header = read_gguf_header(path)
    spec = spec_from_gguf_header(header)
    matrices = sum(t.n_elements for t in header.tensors if len(t.shape) == 2)
    vectors = sum(t.n_elements for t in header.tensors if len(t.shape) == 1)
    assert held == matrices * 4.5 / 8 + vectors * 2  # norms in the model dtype (bf16)
    assert held == header.file_weight_bytes - vectors * 2  # the file holds them in f32
    mix = tensor_mix_bytes("Q4_K", engine_held_tensors(
        spec, "f32", stored=stored_types(header), rule=stored_format_rule("f32")))
    assert mix.total == header.file_weight_bytes
    assert {line.fmt: line.bytes for line in mix.lines} == {"Q4_K": matrices * 9 // 16,
                                                           "f32": vectors * 4}


def test_one_log_line_per_dequantized_type(tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", DEQUANT_MIX)
    with caplog.at_level(logging.INFO, logger="fitserve.loading"):
        Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", **COMMON))
    lines = [r.getMessage() for r in caplog.records if " at load" in r.getMessage()]
    assert sorted(lines) == ["m.gguf: 2 Q2_K tensor(s) dequantized at load, held as f32",
                             "m.gguf: 2 Q3_K tensor(s) held as Q6_K blocks (converted exactly "
                             "at load)",
                             "m.gguf: 2 TQ1_0 tensor(s) held as Q4_0 blocks (converted exactly "
                             "at load)"]
