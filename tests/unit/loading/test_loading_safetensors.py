"""HF folders (config.json + safetensors + tokenizer.json) and config.json -> ModelSpec."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import RopeScaling
from fitserve.loading import (
    MissingTensorError,
    ModelLoadError,
    UnsupportedArchitectureError,
    load_model,
    spec_from_hf_config,
)

pytest.importorskip("transformers")

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_folder_spec_and_weights(tiny_hf_model_dir: Callable[..., Any], arch: str) -> None:
    folder, model = tiny_hf_model_dir(arch, return_model=True)
    loaded = load_model(folder)
    spec = loaded.spec
    assert loaded.file_format == "safetensors" and loaded.weight_format == "f32"
    assert spec.architecture == arch
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.hidden_size) == (2, 4, 2, 64)
    assert spec.head_dim == {"mistral": 32, "qwen3": 24}.get(arch, 16)
    assert spec.eos_token_ids[:1] == (2,) and spec.bos_token_id == 1
    assert spec.tie_word_embeddings == (arch == "qwen2")
    assert spec.attention_bias == (arch == "qwen2") and spec.qk_norm == (arch == "qwen3")
    assert spec.sliding_window == (16 if arch == "mistral" else None)
    if arch == "llama":
        assert spec.rope_theta == 500000.0
        assert spec.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    else:
        assert spec.rope_scaling is None
    reference = {
        k: v
        for k, v in model.state_dict().items()
        if not (k == "lm_head.weight" and spec.tie_word_embeddings)
    }
    assert set(loaded.weights) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.tokenizer.encode("Hello world") == [19556, 905]


def test_sharded_equals_single_file_and_dtype(tiny_hf_model_dir: Callable[..., Any]) -> None:
    single = tiny_hf_model_dir("qwen3")
    sharded = tiny_hf_model_dir("qwen3", shard=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 3
    a, b = load_model(single), load_model(sharded)
    assert replace(a.spec, name="") == replace(b.spec, name="") and set(a.weights) == set(b.weights)
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    bf = load_model(sharded, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf.weights.values())


def test_chat_template_from_folder(tiny_hf_model_dir: Callable[..., Any]) -> None:
    folder = tiny_hf_model_dir("llama")
    tok = load_model(folder).tokenizer
    assert tok.has_chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# ------------------------------------------------------------ config.json parsing (pure)


def test_old_style_rope_scaling_and_eos_list() -> None:
    cfg = {
        **BASE,
        "model_type": "llama",
        "rope_theta": 500000.0,
        "eos_token_id": [128001, 128009],
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    spec = spec_from_hf_config(cfg, generation_config={"eos_token_id": [128001, 128008]})
    assert spec.rope_theta == 500000.0 and spec.rope_scaling == RopeScaling(
        "llama3", 32.0, 1.0, 4.0, 8192
    )
    assert spec.eos_token_ids == (128001, 128009, 128008)


def test_qwen2_sliding_window_flag_and_layer_types() -> None:
    cfg = {
        **BASE,
        "num_hidden_layers": 4,
        "architectures": ["Qwen2ForCausalLM"],
        "sliding_window": 32,
        "max_window_layers": 2,
    }
    assert spec_from_hf_config(cfg).sliding_window is None  # use_sliding_window defaults to False
    spec = spec_from_hf_config({**cfg, "use_sliding_window": True})
    assert spec.sliding_window == 32 and spec.layer_types == ("full", "full", "sliding", "sliding")
    assert spec.attention_bias


@pytest.mark.parametrize(
    "cfg,shown",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "gpt2 (GPT2LMHeadModel)"),
        ({"model_type": "gemma"}, "gemma"),
    ],
)
def test_unsupported_architecture_in_config(
    tmp_path: Path, cfg: dict[str, Any], shown: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **cfg}))
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_model(tmp_path)
    msg = str(info.value)
    assert "config.json" in msg and shown in msg and "llama, mistral, qwen2, qwen3" in msg


def test_unsupported_rope_type() -> None:
    with pytest.raises(ModelLoadError, match="'dynamic'"):
        spec_from_hf_config(
            {**BASE, "model_type": "qwen2", "rope_scaling": {"type": "dynamic", "factor": 4.0}}
        )


# ---------------------------------------------------------------- broken folders


def test_missing_tokenizer_json(tiny_hf_model_dir: Callable[..., Any]) -> None:
    folder = tiny_hf_model_dir("llama")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: missing file"):
        load_model(folder)


def test_missing_shard_and_missing_tensor(tiny_hf_model_dir: Callable[..., Any]) -> None:
    folder = tiny_hf_model_dir("mistral", shard=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (folder / shard).unlink()
    with pytest.raises(ModelLoadError, match=f"{shard}: missing file"):
        load_model(folder)
    # the index no longer lists that shard: now the tensors in it are missing
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder)


def test_corrupt_config_and_safetensors(tiny_hf_model_dir: Callable[..., Any]) -> None:
    folder = tiny_hf_model_dir("qwen2")
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt"):
        load_model(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_model(folder)
