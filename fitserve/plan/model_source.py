"""Where a ModelSpec comes from: the catalog, a local config.json, or a GGUF file's metadata.

Independent of ``fitserve.loading`` on purpose: the planner reads only the fields it needs and
never touches tensor data (for GGUF, tensor names, types and byte sizes come from the header).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fitserve.config import ModelSpec, RopeScaling
from fitserve.plan.errors import PlanError

_TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")
# Per-architecture facts that config.json does not spell out (HF modeling code does).
_EXTRAS: dict[str, dict[str, float | int | str]] = {
    "gemma2": {"norms_per_layer": 4}, "gemma3_text": {"norms_per_layer": 4},
    "gemma3": {"norms_per_layer": 4},
    "gpt_oss": {"o_proj_bias": 1, "attention_sinks": 1, "router_bias": 1, "moe_bias": 1},
    "deepseek_v3": {"router_bias": 1},  # e_score_correction_bias (noaux_tc routing)
}


@dataclass(frozen=True)
class ModelEntry:
    """A model to plan: its spec plus what the catalog or file says about it."""

    spec: ModelSpec
    native_weights: str  # the format the published checkpoint ships in
    dtype: str  # activation dtype
    source: str
    published_params: float | None = None
    published_active_params: float | None = None
    file_weight_bytes: int | None = None  # GGUF: the file's own tensor bytes
    engine_file_format: str | None = None  # the file `fitserve pull` fetches for the engine


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...] | None:
    if isinstance(cfg.get("layer_types"), list):
        kinds = tuple("sliding" if "sliding" in str(t) else "full" for t in cfg["layer_types"])
        return kinds if "sliding" in kinds else None
    pattern = cfg.get("sliding_window_pattern")
    if pattern and cfg.get("sliding_window"):
        return tuple("full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(n))
    return None


def _rope(cfg: dict[str, Any]) -> RopeScaling | None:
    rs = cfg.get("rope_scaling")
    if not isinstance(rs, dict):
        return None
    return RopeScaling(
        kind=str(rs.get("rope_type", rs.get("type", "linear"))),
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


def _window(cfg: dict[str, Any], model_type: str) -> int | None:
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        return None  # Qwen2 configs carry sliding_window but do not use it
    w = cfg.get("sliding_window")
    return int(w) if w else None


def spec_from_hf_config(cfg: dict[str, Any], name: str = "") -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config.json dict (text config of multimodal ones)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", "")}
    mt = str(cfg.get("model_type", "llama"))
    try:
        n, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
        vocab, inter = cfg["vocab_size"], cfg["intermediate_size"]
    except KeyError as e:
        raise PlanError(f"config.json lacks {e.args[0]!r}, which the planner needs") from e
    mla = int(cfg.get("kv_lora_rank") or 0)
    head_dim = (int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])) if mla else int(
        cfg.get("head_dim") or hidden // heads)
    experts = int(cfg.get("num_local_experts") or cfg.get("n_routed_experts")
                  or cfg.get("num_experts") or 0)
    eos = cfg.get("eos_token_id")
    return ModelSpec(
        architecture=mt, vocab_size=int(vocab), hidden_size=int(hidden),
        intermediate_size=int(inter), num_layers=int(n), num_heads=int(heads),
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=_rope(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", mt in _TIED_BY_DEFAULT)),
        attention_bias=bool(cfg.get("attention_bias", mt == "qwen2")),
        qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
        sliding_window=_window(cfg, mt), layer_types=_layer_types(cfg, int(n)),
        hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        name=name, num_experts=experts,
        num_experts_per_token=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        extra=dict(_EXTRAS.get(mt, {})),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=mla,
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
    )


def _dtype(cfg: dict[str, Any]) -> str:
    raw = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(raw, "bf16")


def load_catalog() -> list[dict[str, Any]]:
    text = resources.files("fitserve.plan").joinpath("catalog/models.json").read_text()
    models: list[dict[str, Any]] = json.loads(text)["models"]
    return models


def catalog_entry(name: str) -> ModelEntry:
    """A catalog model by name, alias or hf_id (case-insensitive); close matches on a miss."""
    models = load_catalog()
    keys: dict[str, dict[str, Any]] = {}
    for m in models:
        for k in (m["name"], m["hf_id"], *m.get("aliases", [])):
            keys[k.lower()] = m
    found = keys.get(name.lower())
    if found is None:
        close = difflib.get_close_matches(name.lower(), keys, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(keys[c]['name'] for c in close)}?" if close else ""
        raise PlanError(f"unknown model {name!r}{hint} Known: "
                        f"{', '.join(x['name'] for x in models)}; or pass a config.json / .gguf path")
    cfg = found["config"]
    return ModelEntry(spec_from_hf_config(cfg, found["name"]), found["native_weights"],
                      _dtype(cfg), found["source"], found.get("published_params"),
                      found.get("published_active_params"),
                      engine_file_format=found.get("engine_file_format"))


def config_entry(path: Path) -> ModelEntry:
    """A local config.json (or a folder holding one)."""
    p = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read {p}: {e}") from e
    return ModelEntry(spec_from_hf_config(cfg, p.parent.name or p.stem), _dtype(cfg), _dtype(cfg),
                      str(p))


def resolve_model(name_or_path: str) -> ModelEntry:
    """A catalog name, a config.json (or its folder), or a .gguf file."""
    p = Path(name_or_path)
    if p.suffix == ".gguf":
        from fitserve.plan.gguf_source import gguf_entry

        return gguf_entry(p)
    if p.exists() and (p.is_dir() or p.suffix == ".json"):
        return config_entry(p)
    return catalog_entry(name_or_path)
