"""Model and hardware sources, and the CLI end to end (bad input included)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fitserve.ledger import cpu_measure, hardware
from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import cpu_hardware, get_hardware
from fitserve.ledger.params import count_params
from fitserve.ledger.units import parse_tokens
from fitserve.tools.planner.cli import main
from fitserve.tools.planner.model_source import catalog_entry, resolve_model


def test_parse_tokens() -> None:
    assert parse_tokens("128k") == 131072
    assert parse_tokens("1m") == 1048576
    assert parse_tokens("4096") == 4096
    with pytest.raises(PlanError):
        parse_tokens("12q")


def test_unknown_model_and_gpu_suggest() -> None:
    with pytest.raises(PlanError, match="did you mean Llama-3.1-8B"):
        catalog_entry("llama-3.1-8")
    with pytest.raises(PlanError, match="did you mean h100"):
        get_hardware("h1000")


def test_gpu_catalog() -> None:
    for name in hardware.gpu_names()[:-1]:
        hw = get_hardware(name)
        assert hw.memory_bytes > 0 and hw.mem_bytes_per_s > 0 and hw.power_w
        assert "datasheet" in hw.source
    assert get_hardware("a100").fp8_flops is None
    assert get_hardware("H100-SXM").bf16_flops == 989.4e12


def test_cpu_measured_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FITSERVE_HOME", str(tmp_path))
    # NOTE: the engine's rates (a subprocess that would build the C++ kernels in this empty
    # home) as fixed figures: tests/unit/ledger/test_cpu_measure.py covers their caching
    engine = cpu_measure.EngineRates((32, 512), {"bf16": [1e11, 2e11]}, 5e10, 1e-4, 1e-5)
    monkeypatch.setattr(cpu_measure, "measure_engine_rates", lambda threads: engine)
    hw = cpu_hardware()
    assert hw.measured and hw.mem_bytes_per_s > 1e8 and hw.bf16_flops == 2e11
    assert (tmp_path / "hardware-cpu.json").is_file()

    def boom(threads: int | None = None) -> None:
        raise AssertionError("measured again")

    # the cached figures come back while a quick probe agrees with them
    monkeypatch.setattr(cpu_measure, "measure_figures", boom)
    copy = json.loads((tmp_path / "hardware-cpu.json").read_text())["mem_bytes_per_s"]
    monkeypatch.setattr(cpu_measure, "probe_copy_bandwidth", lambda t=None: copy)
    assert cpu_hardware() == hw


def test_local_config_json(tmp_path: Path) -> None:
    cfg = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 512, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    e = resolve_model(str(tmp_path))
    assert e.spec.head_dim == 16 and e.dtype == "f16" and not e.spec.tie_word_embeddings
    # per layer 2 x 64^2 + 2 x 64 x 32 + 3 x 64 x 128 + 2 x 64 = 36,992; x 2 + 2 x 64,000 + 64
    assert count_params(e.spec).total == 2 * 36_992 + 2 * 64_000 + 64


def test_gguf_header(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_token_list([f"t{i}" for i in range(100)])
    w.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    e = resolve_model(str(path))
    assert (e.spec.vocab_size, e.spec.num_layers, e.spec.num_kv_heads) == (100, 2, 2)
    assert e.spec.tie_word_embeddings  # no output.weight tensor
    assert e.file_weight_bytes == 100 * 64 * 4


def test_gguf_types_the_engine_cannot_load_are_named(tmp_path: Path) -> None:
    """The planner reads the loader's own list (SUPPORTED_GGUF_TYPES): a Q8_K tensor (no
    gguf-py dequantization) is named in the source note; K-quants and IQ types are not."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    path = tmp_path / "mixed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 256), ("embedding_length", 256),
                       ("feed_forward_length", 256), ("block_count", 1), ("head_count", 4),
                       ("head_count_kv", 2)):
        getattr(w, f"add_{key}")(value)
    w.add_token_list([f"t{i}" for i in range(100)])
    for name, qtype in (("token_embd.weight", Q.Q6_K), ("blk.0.ffn_up.weight", Q.Q8_K),
                        ("blk.0.ffn_gate.weight", Q.IQ2_XXS)):
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor(name, np.zeros((100, 256 // block * nbytes), np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    source = resolve_model(str(path)).source
    assert source.endswith("fitserve's engine cannot load tensors of type Q8_K"), source


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    args = ["Llama-3.3-70B", "--gpu", "h100", "--gpus", "8", "--tp", "8", "--context", "128k",
            "--weights", "fp8", "--kv", "fp8", "--concurrency", "16"]  # 22 fit (64 do not)
    assert main(args + ["--explain"]) == 0
    out = capsys.readouterr().out
    assert "131,072 tokens (k = x1024)" in out and "kv_bytes_per_token" in out
    assert main(args + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    kv = next(s for s in plan["sections"] if s["title"] == "KV cache")
    per_tok = next(line for line in kv["lines"] if line["formula"] == "kv_bytes_per_token")
    assert per_tok["value"] == 80 * 2 * 1 * 128 * 1  # fp8, one KV head per rank


@pytest.mark.parametrize("args, message", [
    (["Llama-3.1-8", "--gpu", "h100"], "did you mean"),
    (["Llama-3.1-8B", "--gpu", "h1000"], "did you mean h100"),
    (["SmolLM2-135M", "--tp", "2", "--gpus", "2"], "does not divide the 9 attention heads"),
    (["Llama-3.1-8B", "--gpu-bandwidth", "0"], "--gpu-bandwidth must be > 0"),
    (["Llama-3.1-8B", "--weights", "int3"], "unknown weight format"),
    (["Llama-3.1-8B", "--gpu-memory=-24G"], "--gpu-memory must be > 0"),
])
def test_cli_bad_input(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_cli_hypothetical_context(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["SmolLM2-135M", "--gpu", "h100", "--context", "1m",
                 "--allow-longer-context"]) == 0
    assert "HYPOTHETICAL" in capsys.readouterr().out


def test_add_plan_parser_wires_into_a_cli(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from fitserve.tools.planner.cli import add_plan_parser, run_plan

    parser = argparse.ArgumentParser(prog="fitserve")
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "DeepSeek-V3", "--gpu", "h200", "--gpus", "8", "--tp", "8",
                              "--context", "32k", "--kv", "fp8", "--json"])
    assert args.func is run_plan and run_plan(args) == 0
    assert '"recommended_layout"' in capsys.readouterr().out
