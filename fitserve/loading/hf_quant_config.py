"""Pre-quantized Hugging Face checkpoints: what a config.json's ``quantization_config`` says,
torch-free (the loader, the planner and the support check read it).

Three writers, each read as stored (``fitserve.quant.hf_checkpoint_formats`` converts the
tensors into the engine's packed layouts):

    quant_method          tensors per quantized Linear                        config read
    compressed-tensors    weight_packed int32 [N, K*b/32], weight_scale       config_groups (targets,
    (format               [N, K/G] | [N, 1], weight_zero_point int32          weights: num_bits, type,
     pack-quantized)      [N*b/32, K/G] (asymmetric), weight_shape [2]        strategy, group_size,
                                                                              symmetric), ignore
    gptq                  qweight int32 [K*b/32, N], qzeros int32             bits, group_size,
                          [K/G, N*b/32], scales f16 [K/G, N], g_idx [K]       sym, desc_act,
                                                                              checkpoint_format
    awq (version gemm)    qweight int32 [K, N/8], qzeros int32 [K/G, N/8],    bits, group_size,
                          scales f16 [K/G, N]                                 zero_point, version

Each quantized weight is held in one engine format (``held_format``): 4-bit symmetric (zero
point = 8) as ``int4-g<G>-sym``, 4-bit asymmetric as ``int4-g<G>-asym`` (Q4_1-style f16 scale
and f16 min = -scale * zero), 8-bit symmetric as ``int8-g<G>`` / ``int8-ch``, each with a
``-perm`` suffix where act-order (``g_idx``) keeps the input columns permuted; what the engine
has no layout for (8-bit asymmetric, a group that is not a multiple of 32) is dequantized to the
model dtype. Anything else (3-bit, fp8 / nvfp4 schemes, Marlin / exllama / GEMV packings) is
refused by ``quant_problems``, naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fitserve.ledger.prequant import QuantScheme as QuantScheme
from fitserve.ledger.prequant import held_format as held_format

CT_METHOD = "compressed-tensors"
PREQUANT_METHODS = (CT_METHOD, "gptq", "awq")
# gpt-oss's experts as MXFP4 *_blocks / *_scales (fitserve.loading.mxfp4), any other method aside
MXFP4_METHOD = "mxfp4"
# The engine's Linear layers of a decoder (the names ``targets``/``ignore`` are matched against).
_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "qkv_proj", "gate_up_proj")
_CT_LINEAR_CLASSES = ("Linear", "LinearBase")


@dataclass(frozen=True, slots=True)
class PrequantConfig:
    """A checkpoint's quantization_config: which Linear holds which scheme."""

    method: str
    groups: tuple[tuple[tuple[str, ...], QuantScheme], ...]  # (targets, scheme), in order
    ignore: tuple[str, ...] = ()

    def scheme_for(self, module: str) -> QuantScheme | None:
        """The scheme of the Linear named ``module`` (``model.layers.0.mlp.up_proj``), or None
        for one left in float (ignored, or matched by no target)."""
        if not module.endswith(_LINEAR_SUFFIXES) and module != "lm_head":
            return None
        if any(_matches(module, t) for t in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(module, t) for t in targets):
                return scheme
        return None

    @property
    def tag(self) -> str:
        """The schemes in words, for `fitserve plan` (``gptq int4 g128 sym act-order``)."""
        return ", ".join(dict.fromkeys(s.tag for _, s in self.groups))


def _matches(module: str, target: str) -> bool:
    """compressed-tensors' rule: ``re:`` a regex matched at the start, else the exact module
    name or a Linear class name; GPTQ/AWQ lists name modules by (a suffix of) their name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or target in _CT_LINEAR_CLASSES or module.endswith("." + target)


def quant_method(config: Mapping[str, Any]) -> str | None:
    """``quantization_config.quant_method`` of a config.json (None: not quantized)."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    return str(quant.get("quant_method", "?")) if isinstance(quant, Mapping) else "?"


def read_prequant(config: Mapping[str, Any]) -> PrequantConfig | None:
    """The pre-quantized checkpoint a config.json describes (None when its quant_method is none
    of ``PREQUANT_METHODS``). Raises ValueError naming what the engine cannot hold."""
    method = quant_method(config)
    if method not in PREQUANT_METHODS:
        return None
    problems = quant_problems(config)
    if problems:
        raise ValueError("; ".join(problems))
    quant: Mapping[str, Any] = config["quantization_config"]
    if method == CT_METHOD:
        groups = tuple((tuple(g.get("targets") or ()), _ct_scheme(g["weights"]))
                       for g in quant["config_groups"].values())
        return PrequantConfig(method, groups, tuple(quant.get("ignore") or ()))
    bits, group = int(quant.get("bits", 4)), int(quant.get("group_size", 128))
    if method == "gptq":
        scheme = QuantScheme("gptq", bits, max(group, 0), bool(quant.get("sym", True)),
                             act_order=bool(quant.get("desc_act", False)) and not quant.get(
                                 "static_groups", False),
                             zero_offset=0 if quant.get("checkpoint_format") == "gptq_v2" else 1)
    else:
        scheme = QuantScheme("awq", bits, max(group, 0), not quant.get("zero_point", True))
    skip = tuple(quant.get("modules_to_not_convert") or ())
    return PrequantConfig(method, ((("re:model\\.layers\\.",), scheme),), (*skip, "lm_head"))


def _ct_scheme(weights: Mapping[str, Any]) -> QuantScheme:
    strategy = weights.get("strategy") or ("group" if weights.get("group_size") else "channel")
    group = int(weights.get("group_size") or 0) if strategy == "group" else 0
    return QuantScheme(CT_METHOD, int(weights["num_bits"]), group,
                       bool(weights.get("symmetric", True)),
                       act_order=weights.get("actorder") == "group")


def quant_problems(config: Mapping[str, Any]) -> list[str]:
    """What the engine cannot hold of a pre-quantized checkpoint, each in words naming it
    ([] for a checkpoint it holds, or one that is not of ``PREQUANT_METHODS``)."""
    method = quant_method(config)
    if method not in PREQUANT_METHODS:
        return []
    quant: Mapping[str, Any] = config["quantization_config"]
    if method == CT_METHOD:
        return _ct_problems(quant)
    out = []
    bits = quant.get("bits", 4)
    if bits not in (4, 8):
        out.append(f"{method} {bits}-bit weights (the engine holds 4- and 8-bit ones)")
    if method == "gptq":
        fmt = quant.get("checkpoint_format", "gptq")
        if quant.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
            out.append(f"gptq checkpoint_format {'marlin' if quant.get('is_marlin_format') else fmt!r}"
                       " (the engine reads the 'gptq' and 'gptq_v2' packings)")
    else:
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            out.append(f"awq version {version!r} (the engine reads the 'gemm' packing)")
        if bits == 8:
            out.append("awq 8-bit weights (the GEMM packing is 4-bit)")
    return out


def _ct_problems(quant: Mapping[str, Any]) -> list[str]:
    out = []
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        return ["compressed-tensors quantization_config has no config_groups"]
    for name, g in groups.items():
        fmt = g.get("format") or quant.get("format")
        w = g.get("weights") or {}
        if fmt != "pack-quantized":
            out.append(f"compressed-tensors format {fmt!r} in {name} (the engine reads "
                       "'pack-quantized': W4A16 / W8A16)")
        elif w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
            out.append(f"compressed-tensors {w.get('type')} {w.get('num_bits')}-bit weights in "
                       f"{name} (the engine holds int4 / int8)")
        elif w.get("strategy") not in (None, "group", "channel"):
            out.append(f"compressed-tensors strategy {w.get('strategy')!r} in {name} (group or "
                       "channel)")
        elif g.get("input_activations"):
            out.append(f"compressed-tensors activation quantization in {name} (the engine runs "
                       "weight-only schemes: W4A16, W8A16)")
    return out


def prequant_formats(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                     dense: str) -> dict[str, str] | None:
    """The engine packed format of each quantized weight ``shapes`` names (HF weight name ->
    ``held_format``; those dequantized to ``dense`` are left out: they are held in the model
    dtype), or None for a config that is not a pre-quantized checkpoint. Raises ValueError as
    ``read_prequant``."""
    pre = read_prequant(config)
    if pre is None:
        return None
    out: dict[str, str] = {}
    for name, shape in shapes.items():
        scheme = pre.scheme_for(name.removesuffix(".weight")) if len(shape) == 2 else None
        fmt = held_format(scheme, shape[1], dense) if scheme is not None else dense
        if fmt != dense:
            out[name] = fmt
    return out
