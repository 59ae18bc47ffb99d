"""A `fitserve quantize` checkpoint in the engine and the planner: `fitserve plan OUT --gpu cpu`
counts exactly the bytes an Engine on OUT holds (as stored, and re-held by another --weights
choice), and RTN int4-g32-asym written to a folder generates the very greedy tokens of
``--weights int4`` (RTN at load) on the default model: same format, same RTN, same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from fitserve.cli import main as fitserve_main
from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import load_model
from fitserve.loading.checkpoint import prepare_output, write_checkpoint
from fitserve.sampling import SamplingParams
from fitserve.tools.quantize.methods import quantize_loaded
from tests.numerics.test_plan_engine_agree import held_by_model
from tests.numerics.test_plan_engine_packed import check, packed_formats
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf


def write(source: Path, out: Path, **how: Any) -> Path:
    loaded = load_model(source, dtype=torch.float32, weights="as-stored")
    result = quantize_loaded(loaded, **{"method": "rtn", **how})
    prepare_output(out, force=False)
    return write_checkpoint(out, spec=result.spec, weights=result.weights,
                            quantization_config=result.metadata, tokenizer=loaded.tokenizer,
                            source=loaded.path, generation_defaults=loaded.generation_defaults)


@pytest.mark.parametrize("choice", ["as-stored", "int4", "int8", "float32"])
@pytest.mark.parametrize(("case", "how", "fmt"), [
    (TinyGGUF(tied=True), dict(bits=4, group_size=128, symmetric=True), "int4-g128-sym"),
    (TinyGGUF(vocab=301, qtype=Q.Q4_1), dict(bits=4, group_size=32), "int4-g32-asym"),
    (TinyGGUF(head_dim=24, kv_heads=1), dict(bits=8, group_size=64), "int8-g64"),
], ids=["int4-g128-sym-tied", "int4-g32-asym-from-q4_1", "int8-g64-hd24"])
def test_checkpoint_plan_equals_engine(tmp_path: Path, case: TinyGGUF, how: dict[str, Any],
                                       fmt: str, choice: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = write(write_tiny_gguf(tmp_path / "m.gguf", case), tmp_path / "ckpt", **how)
    engine = check(out, choice, capsys)  # plan weight bytes == the model's own storages
    want = {"as-stored": {fmt, "int8-ch"}, "int4": {"int4-g32-asym", "int8-ch"},
            "int8": {"int8-ch"}, "float32": set()}[choice]
    assert packed_formats(engine) == want


PLAN_ARGS = ["--block-size", "16", "--kv-cache-memory", "16M", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "256", "--context", "256"]
ENGINE = dict(device="cpu", dtype="float32", block_size=16, kv_cache_memory_bytes=16 << 20,
              max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256)


@pytest.fixture(scope="module")
def smollm2_rtn4(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "int4", bits=4,
                 group_size=32)


def greedy(engine: Engine, prompts: list[str], n: int = 8) -> list[list[int]]:
    """Greedy tokens of every prompt, decoded together (one batch per step)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids or [])
    return [done[i] for i in ids]


def test_default_model_checkpoint_equals_rtn_at_load(smollm2_rtn4: Path, smollm2_gguf: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert fitserve_main(["plan", str(smollm2_rtn4), "--gpu", "cpu", "--json", "--dtype",
                          "float32", *PLAN_ARGS]) == 0
    plan = json.loads(capsys.readouterr().out)["engine"]
    folder = Engine(EngineConfig(model=str(smollm2_rtn4), **ENGINE))  # type: ignore[arg-type]
    held, _ = held_by_model(folder)
    assert plan["weight_bytes"] == plan["lines"]["weights"] == held
    assert plan["num_kv_blocks"] == folder.pool.num_blocks
    assert folder.weights_choice == "as-stored"
    assert packed_formats(folder) == {"int4-g32-asym", "int8-ch"}
    at_load = Engine(EngineConfig(model=str(smollm2_gguf), weights="int4",
                                  **ENGINE))  # type: ignore[arg-type]
    assert held_by_model(at_load)[0] == held
    prompts = ["The capital of France is", "def fibonacci(n):"]
    assert greedy(folder, prompts) == greedy(at_load, prompts)
