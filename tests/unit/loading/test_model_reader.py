"""The one model reader per file kind, field by field: config.json and GGUF headers.

References: transformers' own config classes (``AutoConfig.for_model``, ``LlamaConfig(**d)``)
say what a config.json means, fields left out included; GGUF files are written here with the
gguf package's GGUFWriter. Both modes are checked: the engine's (``require_supported=True``,
ModelLoadError) and the planner's (describes more; PlanError through fitserve.tools.planner).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q

from fitserve.config import ModelSpec, RopeScaling
from fitserve.ledger.errors import PlanError
from fitserve.loading.errors import ModelLoadError, UnsupportedArchitectureError
from fitserve.loading.gguf_spec import (
    llama3_factors,
    read_gguf_header,
    spec_from_gguf_header,
    stored_types,
)
from fitserve.loading.hf_config import check_engine_spec, spec_from_hf_config, spec_from_hf_folder
from fitserve.loading.hf_defaults import DEFAULTS, WINDOW_EVERY_LAYER
from fitserve.tools.planner.model_source import catalog_entry, resolve_model
from fitserve.tools.planner.model_source import spec_from_hf_config as plan_spec_from_hf_config
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

transformers = pytest.importorskip("transformers")

BASE: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, vocab_size=320)


def describe(cfg: dict[str, Any]) -> ModelSpec:
    """The planner's mode of the reader (every architecture)."""
    return spec_from_hf_config(cfg, require_supported=False)


def hf_config(cfg: dict[str, Any]) -> Any:
    """transformers' reading of the same dict (the reference)."""
    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(cfg["model_type"], **rest)


def hf_rope(c: Any) -> dict[str, Any]:
    rp = dict(c.rope_parameters or {})
    return dict(rp["full_attention"]) if "full_attention" in rp else rp


def hf_window(c: Any, model_type: str, n: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, per-layer kinds) as transformers' modeling code applies them."""
    window = getattr(c, "sliding_window", None) or None
    if window is None:
        return None, None
    if model_type in WINDOW_EVERY_LAYER or getattr(c, "layer_types", None) is None:
        kinds = ["sliding"] * n
    else:
        kinds = ["sliding" if t == "sliding_attention" else "full" for t in c.layer_types]
    if "sliding" not in kinds:
        return None, None
    return window, None if "full" not in kinds else tuple(kinds)


VARIANTS: list[tuple[str, dict[str, Any]]] = [(mt, {}) for mt in DEFAULTS] + [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32}),  # max_window_layers 28
    ("mistral", {"sliding_window": None}),
    ("gemma2", {"sliding_window": 512}),
    ("gemma3_text", {"num_hidden_layers": 12, "sliding_window_pattern": 3}),
    ("gemma", {"tie_word_embeddings": False}),
    ("llama", {"num_key_value_heads": 1, "head_dim": 24, "tie_word_embeddings": True,
               "rope_theta": 500000.0, "max_position_embeddings": 4096}),
]


@pytest.mark.parametrize(("model_type", "extra"), VARIANTS,
                         ids=[f"{mt}-{i}" for i, (mt, _) in enumerate(VARIANTS)])
def test_defaults_and_windows_match_transformers(model_type: str, extra: dict[str, Any]) -> None:
    cfg = {**BASE, "model_type": model_type, **extra}
    ours, theirs = describe(cfg), hf_config(cfg)
    assert ours.architecture == model_type
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.rope_theta == hf_rope(theirs)["rope_theta"]
    assert ours.hidden_act == (getattr(theirs, "hidden_activation", None) or theirs.hidden_act)
    if not ours.kv_lora_rank:  # MLA: our head_dim is nope + rope (transformers: rope only)
        assert ours.head_dim == (getattr(theirs, "head_dim", None)
                                 or theirs.hidden_size // theirs.num_attention_heads)
    layers = cfg["num_hidden_layers"]
    assert (ours.sliding_window, ours.layer_types) == hf_window(theirs, model_type, layers)
    experts = (getattr(theirs, "num_local_experts", None) or getattr(theirs, "n_routed_experts",
               None) or getattr(theirs, "num_experts", None) or 0)
    assert ours.num_experts == experts
    assert ours.num_experts_per_token == (getattr(theirs, "num_experts_per_tok", None) or 0)


def test_transformers5_rope_parameters_llama3() -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = {**BASE, "model_type": "llama", "max_position_embeddings": 512, "rope_parameters": rope}
    spec = spec_from_hf_config(cfg)
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    ref = hf_rope(transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    assert ref["rope_type"] == "llama3" and ref["rope_theta"] == spec.rope_theta
    assert ref["factor"] == spec.rope_scaling.factor


def test_llama3_original_max_defaults_to_max_position_embeddings() -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0}
    cfg = {**BASE, "model_type": "llama", "max_position_embeddings": 1024, "rope_parameters": rope}
    spec = spec_from_hf_config(cfg)
    assert spec.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)
    assert hf_rope(hf_config(cfg))["original_max_position_embeddings"] == 1024


def test_legacy_rope_scaling_and_top_level_theta() -> None:
    cfg = {**BASE, "model_type": "llama", "rope_theta": 12345.0,
           "rope_scaling": {"type": "linear", "factor": 2.0}}
    spec = spec_from_hf_config(cfg)
    assert spec.rope_theta == 12345.0 and spec.rope_scaling == RopeScaling("linear", 2.0)
    ref = hf_rope(hf_config(cfg))
    assert (ref["rope_type"], ref["factor"], ref["rope_theta"]) == ("linear", 2.0, 12345.0)


def test_rope_scaling_wins_over_rope_parameters_like_transformers() -> None:
    cfg = {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 4.0},
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    spec = spec_from_hf_config(cfg)
    ref = hf_rope(hf_config(cfg))
    assert spec.rope_scaling == RopeScaling("linear", 4.0) and ref["rope_type"] == "linear"
    assert spec.rope_theta == ref["rope_theta"] == 10000.0  # the llama3 dict is dropped whole


def test_gemma3_nested_rope_parameters_take_full_attention() -> None:
    cfg = {**BASE, "model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    spec = describe(cfg)
    assert spec.rope_theta == 1e6 and spec.rope_scaling == RopeScaling("linear", 8.0)
    assert spec.rope_theta == hf_rope(hf_config(cfg))["rope_theta"]


def test_rope_errors() -> None:
    cfg = {**BASE, "model_type": "llama", "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    with pytest.raises(ModelLoadError, match="rope scaling 'llama3' lacks 'factor'"):
        spec_from_hf_config(cfg)
    with pytest.raises(PlanError, match="lacks 'factor'"):  # the planner says the same
        plan_spec_from_hf_config(cfg, "x")
    with pytest.raises(KeyError, match="factor"):  # and transformers refuses it too
        hf_config(cfg)
    dynamic = {**BASE, "model_type": "qwen2", "rope_scaling": {"type": "dynamic", "factor": 4.0}}
    with pytest.raises(ModelLoadError, match="unsupported rope scaling type 'dynamic'"):
        spec_from_hf_config(dynamic)
    # YaRN runs (fitserve.model.layers.yarn_inv_freq): transformers' defaults filled in
    yarn = {**BASE, "model_type": "qwen2", "rope_scaling": {"type": "yarn", "factor": 4.0}}
    want = RopeScaling("yarn", 4.0, original_max_position_embeddings=32768,
                       attention_factor=0.1 * math.log(4.0) + 1.0)
    assert spec_from_hf_config(yarn).rope_scaling == describe(yarn).rope_scaling == want


def test_qwen3_use_sliding_window_and_max_window_layers() -> None:
    cfg = {**BASE, "model_type": "qwen3", "num_hidden_layers": 4, "sliding_window": 32,
           "max_window_layers": 1, "use_sliding_window": True}
    spec = spec_from_hf_config(cfg)
    assert (spec.sliding_window, spec.layer_types) == (32, ("full", "sliding", "sliding",
                                                            "sliding"))
    assert hf_config(cfg).layer_types == ["full_attention"] + ["sliding_attention"] * 3
    assert spec_from_hf_config({**cfg, "use_sliding_window": False}).sliding_window is None
    assert spec_from_hf_config({**cfg, "max_window_layers": 0}).layer_types is None  # all slide
    check_engine_spec(spec, "qwen3 config")  # hybrid: one KV layer group per attention kind
    # Qwen3's own defaults: head_dim 128 and 32 KV heads when config.json says nothing
    bare = spec_from_hf_config({**BASE, "model_type": "qwen3"})
    assert (bare.head_dim, bare.num_kv_heads, bare.qk_norm) == (128, 32, True)


def test_tie_word_embeddings_defaults() -> None:
    for mt, tied in (("gemma", True), ("gemma2", True), ("gemma3_text", True), ("llama", False),
                     ("qwen2", False), ("mistral", False)):
        cfg = {**BASE, "model_type": mt}
        assert describe(cfg).tie_word_embeddings is tied is hf_config(cfg).tie_word_embeddings
    assert not describe({**BASE, "model_type": "gemma2", "tie_word_embeddings": False}
                        ).tie_word_embeddings


def test_biases_as_each_attention_module_builds_them() -> None:
    q2 = spec_from_hf_config({**BASE, "model_type": "qwen2", "attention_bias": False})
    assert q2.attention_bias  # Qwen2Attention: q/k/v bias=True, attention_bias is no field
    mistral = spec_from_hf_config({**BASE, "model_type": "mistral", "attention_bias": True})
    assert not mistral.attention_bias  # MistralAttention: bias=False whatever the config says
    with pytest.raises(ModelLoadError, match="llama with attention_bias/mlp_bias"):
        spec_from_hf_config({**BASE, "model_type": "llama", "attention_bias": True})
    with pytest.raises(ModelLoadError, match="qwen3 with attention_bias"):
        spec_from_hf_config({**BASE, "model_type": "qwen3", "attention_bias": True})
    planned = describe({**BASE, "model_type": "qwen3", "attention_bias": True})
    assert planned.attention_bias and planned.extra["o_proj_bias"] == 1


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "num_hidden_layers",
                                 "vocab_size", "intermediate_size"])
def test_missing_fields_are_clear_errors(key: str) -> None:
    cfg = {k: v for k, v in {**BASE, "model_type": "llama"}.items() if k != key}
    with pytest.raises(ModelLoadError, match=f"src.json: missing field '{key}'"):
        spec_from_hf_config(cfg, source="src.json")
    with pytest.raises(PlanError, match=f"missing field '{key}'"):
        plan_spec_from_hf_config(cfg, "m")
    with pytest.raises(ModelLoadError, match=f"field '{key}' is not an integer"):
        spec_from_hf_config({**cfg, key: "many"})


def test_architecture_from_model_type_or_class_name() -> None:
    spec = spec_from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert spec.architecture == "qwen2" and spec.attention_bias
    with pytest.raises(UnsupportedArchitectureError, match="deepseek_v3"):
        spec_from_hf_config({**BASE, "model_type": "deepseek_v3"})
    assert spec_from_hf_config({**BASE, "architectures": ["Gemma2ForCausalLM"]}).architecture == "gemma2"
    assert spec_from_hf_config({**BASE, "architectures": ["Phi3ForCausalLM"]}).architecture == "phi3"
    with pytest.raises(UnsupportedArchitectureError, match="none: config has no model_type"):
        spec_from_hf_config(BASE)
    assert describe(BASE).architecture == "llama"  # planner: a bare config is read as Llama


def test_multimodal_text_config() -> None:
    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
           "text_config": {**BASE, "model_type": "gemma3_text", "sliding_window": 64},
           "vision_config": {"hidden_size": 1152}}
    spec = describe(cfg)
    assert (spec.architecture, spec.hidden_size, spec.tie_word_embeddings, spec.qk_norm) == (
        "gemma3_text", 64, True, True)
    assert spec.extra["norms_per_layer"] == 4
    with pytest.raises(ModelLoadError, match="Gemma3ForConditionalGeneration"):
        spec_from_hf_config(cfg)  # the engine runs the text checkpoint only


def test_eos_from_config_and_generation_config(tmp_path: Path) -> None:
    cfg = {**BASE, "model_type": "llama", "eos_token_id": [7, 8], "bos_token_id": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 9]}))
    spec = spec_from_hf_folder(tmp_path)
    assert (spec.eos_token_ids, spec.bos_token_id, spec.name) == ((7, 8, 9), 1, tmp_path.name)
    assert resolve_model(str(tmp_path)).spec == spec  # the planner reads the folder the same way
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ModelLoadError, match=r"quantized checkpoints \(bitsandbytes\)"):
        spec_from_hf_folder(tmp_path)
    assert spec_from_hf_folder(tmp_path, require_supported=False) == spec  # planner describes


def test_catalog_suggestions_name_each_model_once() -> None:
    # "llama-3.1-8" is close to three keys of Llama-3.1-8B (name, alias, hf_id ...)
    with pytest.raises(PlanError) as info:
        catalog_entry("llama-3.1-8")
    msg = str(info.value)
    suggested = msg.split("did you mean ")[1].split("?")[0].split(", ")
    assert suggested[0] == "Llama-3.1-8B"
    assert len(suggested) == len(set(suggested)) >= 2


# ---------------------------------------------------------------- GGUF headers


def test_gguf_inventory_and_stored_types(tmp_path: Path) -> None:
    c = TinyGGUF(qtype=Q.Q8_0, embd_qtype=Q.F16, head_dim=24, kv_heads=1, vocab=301)
    header = read_gguf_header(write_tiny_gguf(tmp_path / "m.gguf", c))
    inv = {t.name: t for t in header.tensors}
    q = inv["blk.1.attn_q.weight"]
    assert (q.type_name, q.shape, q.n_bytes) == ("Q8_0", (96, 64), 96 * 64 // 32 * 34)
    e = inv["token_embd.weight"]
    assert (e.type_name, e.shape, e.n_bytes) == ("F16", (301, 64), 301 * 64 * 2)
    assert inv["output_norm.weight"].n_bytes == 64 * 4
    assert header.file_weight_bytes == sum(t.n_bytes for t in header.tensors)
    types = stored_types(header)
    assert types["model.layers.1.self_attn.q_proj.weight"] == "Q8_0"
    assert types["lm_head.weight"] == "F16" and types["model.norm.weight"] == "F32"
    spec = spec_from_gguf_header(header)
    assert (spec.head_dim, spec.num_kv_heads, spec.vocab_size, spec.num_layers) == (24, 1, 301, 2)


@pytest.mark.parametrize("kv", [[2, 2, 1, 2], [2, 2, 2, 2]])
def test_gguf_per_layer_head_count_kv(tmp_path: Path, kv: list[int]) -> None:
    path = write_tiny_gguf(tmp_path / "per_layer.gguf", TinyGGUF(layers=4, kv_heads=kv))
    header = read_gguf_header(path)
    assert header.fields["llama.attention.head_count_kv"] == kv
    planned = spec_from_gguf_header(header, require_supported=False)
    assert planned.num_kv_heads == max(kv)  # the planner's upper bound
    if len(set(kv)) > 1:
        with pytest.raises(ModelLoadError, match=r"head_count_kv differs per layer \(1, 2 across 4"):
            spec_from_gguf_header(header)
        assert "per-layer attention.head_count_kv planned at their maximum" in (
            resolve_model(str(path)).source)
    else:
        assert spec_from_gguf_header(header).num_kv_heads == 2


def test_gguf_names_rope_and_eos(tmp_path: Path) -> None:
    def eot(w: Any) -> None:
        w.add_eot_token_id(5)

    c = TinyGGUF(name="Mistral 7B tiny", sliding_window=64, edit=eot)
    spec = spec_from_gguf_header(read_gguf_header(write_tiny_gguf(tmp_path / "m.gguf", c)))
    assert (spec.architecture, spec.sliding_window, spec.eos_token_ids) == ("mistral", 64, (2, 5))
    rs = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    c3 = TinyGGUF(theta=500000.0, head_dim=32, heads=2, rope_freqs=llama3_factors(5e5, 32, rs))
    spec3 = spec_from_gguf_header(read_gguf_header(write_tiny_gguf(tmp_path / "l3.gguf", c3)))
    assert spec3.rope_scaling == rs and spec3.rope_theta == 500000.0
    lin = TinyGGUF(meta={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0})
    spec_l = spec_from_gguf_header(read_gguf_header(write_tiny_gguf(tmp_path / "lin.gguf", lin)))
    assert spec_l.rope_scaling == RopeScaling("linear", 4.0)
    yarn = TinyGGUF(meta={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                          "rope.scaling.original_context_length": 4096})
    header = read_gguf_header(write_tiny_gguf(tmp_path / "yarn.gguf", yarn))
    # YaRN as llama.cpp runs it: its ramp's ends always truncated (ggml_rope_yarn_corr_dims)
    assert spec_from_gguf_header(header).rope_scaling == RopeScaling(
        "yarn", 4.0, original_max_position_embeddings=4096,
        attention_factor=0.1 * math.log(4.0) + 1.0, truncate=True)
    other = TinyGGUF(meta={"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0})
    header = read_gguf_header(write_tiny_gguf(tmp_path / "other.gguf", other))
    with pytest.raises(ModelLoadError, match="unsupported rope scaling type 'longrope'"):
        spec_from_gguf_header(header)


def test_gguf_bias_norms_tying_and_unsupported(tmp_path: Path) -> None:
    c = TinyGGUF(arch="qwen2", tied=True, qkv_bias=True)
    s = spec_from_gguf_header(read_gguf_header(write_tiny_gguf(tmp_path / "q2.gguf", c)))
    assert s.tie_word_embeddings and s.attention_bias and not s.qk_norm
    c3 = TinyGGUF(arch="qwen3", qk_norm=True, head_dim=24)
    s3 = spec_from_gguf_header(read_gguf_header(write_tiny_gguf(tmp_path / "q3.gguf", c3)))
    assert s3.qk_norm and not s3.attention_bias and s3.head_dim == 24
    g = read_gguf_header(write_tiny_gguf(tmp_path / "g.gguf", TinyGGUF(
        arch="gemma2", sliding_window=32, layers=4)))
    planned = spec_from_gguf_header(g, require_supported=False)
    assert planned.layer_types == ("sliding", "full", "sliding", "full")  # llama.cpp's pattern
    assert planned.hidden_act == "gelu_pytorch_tanh" and planned.extra["norms_per_layer"] == 4
    assert spec_from_gguf_header(g) == planned  # the engine runs it (mixed kinds: Gemma 2/3)
    # llama.cpp's scale rule: head_dim, except the 27B's (46 layers) hidden / heads
    assert planned.query_pre_attn_scalar == 16.0
    big = spec_from_gguf_header(read_gguf_header(write_tiny_gguf(tmp_path / "g27.gguf", TinyGGUF(
        arch="gemma2", sliding_window=32, layers=46, head_dim=32, tokenizer=False))))
    assert big.query_pre_attn_scalar == 16.0 and big.head_dim == 32
    w = read_gguf_header(write_tiny_gguf(tmp_path / "w.gguf", TinyGGUF(sliding_window=8,
        layers=2, meta={"attention.sliding_window_pattern": [True, False]})))
    with pytest.raises(ModelLoadError, match="mixed layer kinds for Gemma 2/3 and gpt-oss only"):
        spec_from_gguf_header(w)


def test_gguf_moe_in_llama_arch(tmp_path: Path) -> None:
    """llama.cpp writes Mixtral as "llama" with expert_count: the engine reads it as Mixtral
    (top-k renormalised, as llama.cpp's graph for it), the planner describes it the same."""
    c = TinyGGUF(meta={"expert_count": 8, "expert_used_count": 2,
                       "expert_feed_forward_length": 48})
    header = read_gguf_header(write_tiny_gguf(tmp_path / "moe.gguf", c))
    spec = spec_from_gguf_header(header)
    assert (spec.architecture, spec.norm_topk_prob, spec.num_experts) == ("mixtral", True, 8)
    planned = spec_from_gguf_header(header, require_supported=False)
    assert (planned.num_experts, planned.num_experts_per_token,
            planned.moe_intermediate_size) == (8, 2, 48)
