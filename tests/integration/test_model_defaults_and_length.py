"""The loaded model carries its sampling defaults (GGUF, HF folder, neither); LLM exposes them;
the engine refuses a max_model_len past the trained context unless explicitly allowed."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fitserve.config import EngineConfig, RopeScaling
from fitserve.engine.core import Engine, check_max_model_len
from fitserve.engine.llm import LLM
from fitserve.loading import load_model
from fitserve.loading.hf_config import spec_from_hf_config
from fitserve.sampling import SamplingParams
from tests.gguf_meta import copy_gguf_with_sampling
from tests.unit.loading.test_loading_gguf import write_gguf

ENV = "FITSERVE_ALLOW_LONG_MAX_MODEL_LEN"
TINY_CONTEXT = 512  # write_gguf's context_length


@pytest.fixture()
def tiny_gguf(tmp_path: Path) -> Path:
    write_gguf(tmp_path / "tiny.gguf")
    return tmp_path / "tiny.gguf"


def engine_config(model: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", device="cpu", num_kv_blocks=80, **kw)


def test_gguf_with_and_without_sampling_keys(tiny_gguf: Path, tmp_path: Path) -> None:
    assert load_model(tiny_gguf).generation_defaults.is_empty
    with_keys = copy_gguf_with_sampling(tiny_gguf, tmp_path / "keys.gguf", temp=0.25, top_k=9,
                                        min_p=0.125)
    loaded = load_model(with_keys)
    assert loaded.generation_defaults.values() == {"temperature": 0.25, "top_k": 9, "min_p": 0.125}
    assert loaded.generation_defaults.source == "GGUF general.sampling.*"
    # the copy is the same model otherwise
    assert loaded.spec == load_model(tiny_gguf).spec


def test_hf_folder_generation_config(tiny_hf_model_dir: Callable[..., Any]) -> None:
    folder = tiny_hf_model_dir("llama")
    gen_path = folder / "generation_config.json"
    written = json.loads(gen_path.read_text())  # what save_pretrained wrote: ids, no sampling
    assert load_model(folder).generation_defaults.is_empty
    gen_path.write_text(json.dumps({**written, "do_sample": True, "temperature": 0.3, "top_p": 0.8}))
    d = load_model(folder).generation_defaults
    assert d.values() == {"temperature": 0.3, "top_p": 0.8} and d.source == "generation_config.json"


def test_llm_get_default_sampling_params(tiny_gguf: Path, tmp_path: Path) -> None:
    keys = copy_gguf_with_sampling(tiny_gguf, tmp_path / "keys.gguf", temp=0.5, top_p=0.75)
    llm = LLM(str(keys), dtype="float32", device="cpu", num_kv_blocks=80)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.5, top_p=0.75)
    plain = LLM(str(tiny_gguf), dtype="float32", device="cpu", num_kv_blocks=80)
    assert plain.get_default_sampling_params() == SamplingParams()


def test_max_model_len_past_the_trained_context_is_refused(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert Engine(engine_config(tiny_gguf)).max_model_len == TINY_CONTEXT  # default: the model's
    assert Engine(engine_config(tiny_gguf, max_model_len=TINY_CONTEXT)).max_model_len == TINY_CONTEXT
    with pytest.raises(ValueError, match=rf"max_model_len=1024 is longer than the model's trained "
                                         rf"context \({TINY_CONTEXT} tokens.*{ENV}=1"):
        Engine(engine_config(tiny_gguf, max_model_len=1024))
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level(logging.WARNING, logger="fitserve.engine"):
        engine = Engine(engine_config(tiny_gguf, max_model_len=1024))
    assert engine.max_model_len == 1024
    assert any("max_model_len=1024" in r.getMessage() and ENV in r.getMessage() for r in caplog.records)
    monkeypatch.setenv(ENV, "0")
    with pytest.raises(ValueError, match="trained context"):
        Engine(engine_config(tiny_gguf, max_model_len=TINY_CONTEXT + 1))


def test_trained_length_counts_linear_rope_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    base = spec_from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256,
    })
    assert check_max_model_len(None, base) == 256 and check_max_model_len(256, base) == 256
    with pytest.raises(ValueError, match="257"):
        check_max_model_len(257, base)
    linear = dataclasses.replace(base, rope_scaling=RopeScaling("linear", 4.0))
    assert check_max_model_len(1024, linear) == 1024  # 256 x 4, as vLLM derives it
    with pytest.raises(ValueError, match=r"1024 tokens, max_position_embeddings 256 x linear RoPE factor 4"):
        check_max_model_len(1025, linear)
    assert check_max_model_len(None, linear) == 256  # the default stays max_position_embeddings
    llama3 = dataclasses.replace(base, rope_scaling=RopeScaling("llama3", 8.0))
    with pytest.raises(ValueError):  # llama3 configs already state the extended length
        check_max_model_len(257, llama3)
