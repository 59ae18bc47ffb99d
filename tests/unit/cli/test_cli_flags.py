"""The flags vLLM and llama.cpp users type, at parse level: each sets what it says; no
abbreviation is taken; an unknown flag exits 2 naming the nearest known one."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fitserve.cli.main import build_parser
from fitserve.cli.serve import resolve_model_tag
from fitserve.engine.args import engine_config_from_args


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_serve_takes_the_model_positionally_or_as_a_flag() -> None:
    for argv in (["serve", "my.gguf"], ["serve", "--model", "my.gguf"], ["serve", "-m", "my.gguf"],
                 ["serve", "--port", "9000", "my.gguf", "-t", "1"], ["serve", "my.gguf", "-m", "my.gguf"]):
        args = parse(*argv)
        resolve_model_tag(args)
        assert args.model == "my.gguf" and engine_config_from_args(args).model == "my.gguf", argv
    args = parse("serve", "a.gguf", "--model", "b.gguf")
    with pytest.raises(ValueError, match="given twice"):
        resolve_model_tag(args)


def test_llama_cpp_short_flags() -> None:
    args = parse("serve", "m.gguf", "-t", "2", "-c", "512", "--alias", "foo", "--host", "0.0.0.0", "--port", "8123")
    assert (args.threads, args.max_model_len, args.served_model_name, args.host, args.port) == \
        (2, 512, "foo", "0.0.0.0", 8123)
    assert args.tensor_parallel_size == 1  # -t is threads, not a prefix of -tp
    assert engine_config_from_args(args).max_model_len == 512
    assert parse("serve", "--ctx-size", "256").max_model_len == 256
    assert parse("generate", "hi", "--threads", "3").threads == 3
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        engine_config_from_args(parse("serve", "-t", "2", "-tp", "2"))


def test_vllm_flags() -> None:
    args = parse("serve", "--gpu-memory-utilization", "0.5", "--max-logprobs", "5", "--dtype", "half")
    cfg = engine_config_from_args(args)
    assert cfg.cache.gpu_memory_utilization == 0.5 and cfg.cache.host_memory_utilization == 0.5
    assert args.max_logprobs == 5 and cfg.dtype == "float16"
    assert parse("serve", "--dtype", "float").dtype == "float32"
    plain = engine_config_from_args(parse("serve"))
    assert plain.cache.host_memory_utilization is None and plain.cache.gpu_memory_utilization == 0.9


def test_generation_config_modes_and_folder(tmp_path: Path) -> None:
    assert parse("serve", "--generation-config", "vllm").generation_config == "vllm"
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3}')
    assert parse("serve", "--generation-config", str(tmp_path)).generation_config == str(tmp_path)
    from fitserve.cli.serve import _folder_defaults

    folder = _folder_defaults(str(tmp_path))
    assert folder.values() == {"temperature": 0.3}
    from fitserve.loading.generation_defaults import GenerationDefaults
    from fitserve.server.settings import ServerSettings

    model = GenerationDefaults(temperature=0.9, source="model")
    assert ServerSettings(generation_defaults=folder).resolve_sampling(model).values["temperature"] == 0.3
    assert ServerSettings().resolve_sampling(model).values["temperature"] == 0.9


@pytest.mark.parametrize(("argv", "needle"), [
    (["serve", "--tread", "2"], "--tread (did you mean --threads?)"),
    (["serve", "--max-model-length", "9"], "did you mean --max-model-len?"),
    (["serve", "--port", "1", "--hots", "x"], "did you mean --host?"),
    (["serve", "--tensor-parallel", "2"], "--tensor-parallel"),  # no abbreviation of --tensor-parallel-size
    (["serve", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
    (["serve", "--dtype", "fp64"], "invalid choice"),
    (["serve", "-t", "0"], "must be >= 1"),
    (["serve", "--max-logprobs", "21"], "must be in 0..20"),
    (["serve", "--generation-config", "/nonexistent"], "generation_config.json"),
    (["generate", "hi", "--max-tok", "3"], "did you mean --max-tokens?"),
])
def test_bad_flags_exit_2_naming_the_problem(argv: list[str], needle: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err
