"""One ledger with packed weights: `fitserve plan PATH --gpu cpu --weights W --json` reports the
bytes an Engine built on PATH with ``weights=W`` holds, for W = as-stored (GGUF Q4_0/Q4_1/Q8_0
packed as stored, the rest dequantized), int4 and int8 (RTN at load), on GGUF files and HF
folders; the engine's bytes are counted from the model's own storages (tied ones once).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from fitserve.cli import main as fitserve_main
from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.model.linear import PackedEmbedding, PackedLinear
from tests.numerics.test_plan_engine_agree import COMMON, COMMON_ARGS, held_by_model
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

CHOICES = ["as-stored", "int4", "int8"]


def plan_weights(capsys: pytest.CaptureFixture[str], model: Path, weights: str) -> dict[str, Any]:
    capsys.readouterr()
    assert fitserve_main(["plan", str(model), "--gpu", "cpu", "--json", "--dtype", "float32",
                          "--weights", weights, *COMMON_ARGS]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not any("HYPOTHETICAL" in w for w in out["warnings"])
    summary: dict[str, Any] = out["engine"]
    return summary


def check(path: Path, weights: str, capsys: pytest.CaptureFixture[str]) -> Engine:
    plan = plan_weights(capsys, path, weights)
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                 weights=weights, **COMMON))
    held, _ = held_by_model(engine)
    assert plan["weight_bytes"] == plan["lines"]["weights"] == held, weights
    assert plan["num_kv_blocks"] == engine.pool.num_blocks
    return engine


def packed_formats(engine: Engine) -> set[str]:
    return {m.packed.format for m in engine.runner.model.modules()
            if isinstance(m, PackedLinear | PackedEmbedding)}


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize(("case", "as_stored"), [
    (TinyGGUF(qtype=Q.Q4_1, embd_qtype=Q.Q8_0, tied=True), {"int4-g32-asym", "int8-g32"}),
    (TinyGGUF(qtype=Q.Q4_0, embd_qtype=Q.Q4_0, vocab=301), {"int4-g32-sym"}),
    (TinyGGUF(qtype=Q.Q8_0, head_dim=24, kv_heads=1), {"int8-g32"}),
    (TinyGGUF(qtype=Q.F16), set()),
], ids=["q4_1-tied", "q4_0-untied", "q8_0-hd24", "f16"])
def test_gguf_packed_plan_equals_engine(tmp_path: Path, case: TinyGGUF, as_stored: set[str],
                                        choice: str, capsys: pytest.CaptureFixture[str]) -> None:
    engine = check(write_tiny_gguf(tmp_path / "m.gguf", case), choice, capsys)
    want = {"as-stored": as_stored, "int4": {"int4-g32-asym", "int8-ch"},
            "int8": {"int8-ch"}}[choice]
    assert packed_formats(engine) == want


@pytest.mark.parametrize("choice", ["int4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_rtn_plan_equals_engine(tiny_hf_model_dir: Callable[..., Any], arch: str, choice: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    engine = check(tiny_hf_model_dir(arch), choice, capsys)
    assert packed_formats(engine) == ({"int4-g32-asym", "int8-ch"} if choice == "int4"
                                      else {"int8-ch"})
    # qwen2's q/k/v biases stay dense in the model dtype, on the packed fused projection
    if arch == "qwen2":
        qkv = engine.runner.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, PackedLinear) and qkv.bias is not None


def test_quantization_flag_is_weights_rtn(tiny_hf_model_dir: Callable[..., Any]) -> None:
    folder = tiny_hf_model_dir("llama")
    engine = Engine(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                 quantization="int8", **COMMON))
    assert engine.weights_choice == "int8" and packed_formats(engine) == {"int8-ch"}
    with pytest.raises(ValueError, match="conflicts"):
        Engine(EngineConfig(model=str(folder), device="cpu", weights="int4",
                            quantization="int8", **COMMON))
    with pytest.raises(ValueError, match="--dtype"):
        Engine(EngineConfig(model=str(folder), device="cpu", weights="float32",
                            dtype="bfloat16", **COMMON))


def test_hf_fp8_plan_equals_engine(tiny_hf_model_dir: Callable[..., Any],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--weights fp8: e4m3 per-channel projections (Fp8Linear), int8-ch embedding / lm_head;
    the planner's bytes are what the model holds, and its logits are those of the dense model
    holding the dequantized fp8 weights (the plain algorithm)."""
    from fitserve.model.fp8_linear import Fp8Linear
    from fitserve.runner.teacher_forcing import score_logits

    folder = tiny_hf_model_dir("llama")
    engine = check(folder, "fp8", capsys)
    fp8 = [m for m in engine.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 4 * engine.spec.num_layers and all(m.fmt == "e4m3" for m in fp8)
    assert packed_formats(engine) == {"int8-ch"}
    model = engine.runner.model
    ids = list(range(3, 40))
    got = score_logits(model, engine.spec, ids)
    for name, m in list(model.named_modules()):
        if isinstance(m, Fp8Linear):
            dense = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            dense.weight.data = m.fp8.dequantize(torch.float32)
            if m.bias is not None:
                dense.bias.data = m.bias.data.float()
            model.set_submodule(name, dense)
    torch.testing.assert_close(got, score_logits(model, engine.spec, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("kv", "scales", "fmt"), [("int8", "auto", "int8-kc"),
                                                   ("fp8_e5m2", "token", "fp8_e5m2")])
def test_quantized_kv_plan_blocks_equal_engine(tiny_hf_model_dir: Callable[..., Any], kv: str,
                                               scales: str, fmt: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny_hf_model_dir("llama")
    capsys.readouterr()
    args = ["plan", str(folder), "--gpu", "cpu", "--json", "--dtype", "float32", "--kv", fmt,
            *COMMON_ARGS]
    assert fitserve_main(args) == 0
    plan = json.loads(capsys.readouterr().out)["engine"]
    engine = Engine(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                 kv_cache_dtype=kv, kv_cache_scales=scales, **COMMON))
    assert engine.runner.kv_format == fmt
    assert plan["num_kv_blocks"] == engine.pool.num_blocks > 0
