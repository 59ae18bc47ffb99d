"""Where a ModelSpec comes from: the catalog, a local config.json, or a GGUF file's metadata.

The readers are the engine's own, torch-free (``fitserve.loading.hf_config`` and
``fitserve.loading.gguf_spec``) in their describing mode (``require_supported=False``): the
planner also describes models the engine does not run (MoE, MLA, Gemma ...). Their
``ModelLoadError`` becomes a ``PlanError`` with the same message.
"""

from __future__ import annotations

import difflib
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.hf_config import FITSERVE_QUANT_METHOD, packed_formats, spec_from_hf_folder
from fitserve.loading.hf_config import spec_from_hf_config as read_hf_config
from fitserve.loading.hf_quant_config import MXFP4_METHOD, prequant_formats, read_prequant
from fitserve.loading.support import hf_support, spec_problems
from fitserve.tools.planner.entry import ModelEntry
from fitserve.tools.planner.gguf_source import gguf_entry

__all__ = ["ModelEntry", "catalog_entry", "config_entry", "gguf_entry", "load_catalog",
           "resolve_model", "spec_from_hf_config"]


def spec_from_hf_config(cfg: dict[str, Any], name: str = "") -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json dict (text config of multimodal ones)."""
    try:
        return read_hf_config(cfg, source=f"config of {name or 'model'}",
                              require_supported=False, name=name)
    except ModelLoadError as e:
        raise PlanError(str(e)) from e


def _dtype(cfg: dict[str, Any]) -> str:
    raw = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(raw, "bf16")


def load_catalog() -> list[dict[str, Any]]:
    text = resources.files("fitserve.ledger").joinpath("catalog/models.json").read_text()
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
        # several keys (name, hf_id, aliases) map to one model: suggest each model once
        close = difflib.get_close_matches(name.lower(), keys, n=12, cutoff=0.5)
        names = list(dict.fromkeys(keys[c]["name"] for c in close))[:3]
        hint = f"; did you mean {', '.join(names)}?" if names else ""
        raise PlanError(f"unknown model {name!r}{hint} Known: "
                        f"{', '.join(x['name'] for x in models)}; or pass a config.json / .gguf path")
    cfg = found["config"]
    spec = spec_from_hf_config(cfg, found["name"])
    # NOTE: a catalog name on --gpu cpu plans fitserve's engine on that model's checkpoint: the
    # spec's own refusals (architecture, MoE, activation) are what the engine would raise.
    return ModelEntry(spec, found["native_weights"],
                      _dtype(cfg), found["source"], found.get("published_params"),
                      found.get("published_active_params"),
                      engine_file_format=found.get("engine_file_format"),
                      stored_formats=_engine_file_types(spec, found.get("engine_file_types")),
                      engine_refusal=tuple(p if p.startswith("architecture") else f"architecture: {p}"
                                           for p in spec_problems(spec)))


def _engine_file_types(spec: ModelSpec, types: dict[str, str] | None) -> dict[str, str] | None:
    """Per-tensor ggml types of the (pinned) file `fitserve pull` fetches, from the catalog's
    ``engine_file_types``: a tensor name, else "matrix" (2-D) / "vector" (1-D)."""
    if not types:
        return None
    from fitserve.ledger.weight_names import expected_weight_shapes

    return {name: types.get(name, types["matrix" if len(shape) >= 2 else "vector"])
            for name, shape in expected_weight_shapes(spec).items()}


def config_entry(path: Path) -> ModelEntry:
    """A local config.json (or a folder holding one, with its generation_config.json); for a
    `fitserve quantize` checkpoint, each packed tensor's format too (``stored_formats``)."""
    p = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read {p}: {e}") from e
    try:
        spec = spec_from_hf_folder(p, require_supported=False)
    except ModelLoadError as e:
        raise PlanError(str(e)) from e
    packed = _checkpoint_formats(cfg, p)
    refusal = hf_support(p).missing
    prequant = _prequant_formats(cfg, spec)
    if prequant is not None:  # compressed-tensors / GPTQ / AWQ, held as stored
        formats, tag = prequant
        return ModelEntry(spec, _main_format(spec, formats, _dtype(cfg)), _dtype(cfg),
                          f"{p} ({tag} checkpoint)", stored_formats=formats,
                          engine_refusal=refusal)
    mxfp4 = _mxfp4_formats(cfg, spec)
    if mxfp4 is not None:  # gpt-oss's experts, held as the checkpoint's MXFP4 blocks
        return ModelEntry(spec, _main_format(spec, mxfp4, _dtype(cfg)), _dtype(cfg),
                          f"{p} (mxfp4 checkpoint)", stored_formats=mxfp4,
                          engine_refusal=refusal)
    if packed is None:
        return ModelEntry(spec, _dtype(cfg), _dtype(cfg), str(p), engine_refusal=refusal)
    # NOTE: a `fitserve quantize` checkpoint: the engine holds these tensors as stored, so the
    # ledger's rule reads their formats (the others are dense, held in the model dtype).
    return ModelEntry(spec, _main_format(spec, packed, _dtype(cfg)), _dtype(cfg),
                      f"{p} (fitserve {cfg['quantization_config'].get('method', '?')} checkpoint)",
                      stored_formats=packed, engine_refusal=refusal)


def _mxfp4_formats(cfg: dict[str, Any], spec: ModelSpec) -> dict[str, str] | None:
    """Each routed expert weight of a gpt-oss ``quant_method: mxfp4`` checkpoint as "MXFP4"
    (fitserve.loading.mxfp4 holds them so), None for any other folder."""
    from fitserve.ledger.weight_names import expected_weight_shapes

    quant = cfg.get("quantization_config")
    if (not isinstance(quant, dict) or quant.get("quant_method") != MXFP4_METHOD
            or spec.architecture != "gpt_oss"):
        return None
    return {n: "MXFP4" for n, shape in expected_weight_shapes(spec).items()
            if ".mlp.experts." in n and len(shape) == 2}


def _checkpoint_formats(cfg: dict[str, Any], path: Path) -> dict[str, str] | None:
    """The packed tensors' formats of a `fitserve quantize` checkpoint, None for any other
    folder (another quant_method is planned as its dtype, as before)."""
    quant = cfg.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != FITSERVE_QUANT_METHOD:
        return None
    try:
        return packed_formats(cfg, path)
    except ModelLoadError as e:
        raise PlanError(str(e)) from e


def _prequant_formats(cfg: dict[str, Any], spec: ModelSpec
                      ) -> tuple[dict[str, str], str] | None:
    """A pre-quantized checkpoint's held format per quantized weight and its schemes in words
    (None: not one, or one the engine cannot hold: planned as its dtype, the refusal shown)."""
    from fitserve.ledger.weight_names import expected_weight_shapes

    try:
        pre = read_prequant(cfg)
        formats = prequant_formats(cfg, expected_weight_shapes(spec), _dtype(cfg))
    except ValueError:
        return None
    return None if pre is None or formats is None else (formats, pre.tag)


def _main_format(spec: ModelSpec, formats: dict[str, str], dense: str) -> str:
    """The format holding most of a checkpoint's weights (packed, else ``dense``)."""
    from fitserve.ledger.weight_names import expected_weight_shapes

    counts: dict[str, int] = {}
    for name, shape in expected_weight_shapes(spec).items():
        fmt = formats.get(name, dense)
        counts[fmt] = counts.get(fmt, 0) + math.prod(shape)
    return max(counts, key=lambda f: counts[f])


def resolve_model(name_or_path: str) -> ModelEntry:
    """A catalog name, a config.json (or its folder), or a .gguf file."""
    p = Path(name_or_path)
    if p.suffix == ".gguf":
        return gguf_entry(p)
    if p.exists() and (p.is_dir() or p.suffix == ".json"):
        return config_entry(p)
    return catalog_entry(name_or_path)
