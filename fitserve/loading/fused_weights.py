"""Checkpoint tensors that hold several of the engine's weights in one: Phi-3's ``qkv_proj``
(q, k, v rows stacked) and ``gate_up_proj`` (gate rows, then up rows; Phi3MLP's ``chunk(2)``).

They are split into the Hugging Face names the rest of the engine holds (q/k/v_proj,
gate/up_proj; fitserve.ledger.weight_names) as they are read, before any quantization, so
every later step (weight checks, the ledger, RTN packing, tensor-parallel sharding, re-fusing
in fitserve.model.loader) sees a Llama-shaped state dict. Row slices: exact.
"""

from __future__ import annotations

from typing import TypeVar

from fitserve.config import ModelSpec
from fitserve.loading.moe_names import split_expert_tensor

T = TypeVar("T")  # a torch tensor or a numpy array: anything sliced by rows


def fused_parts(spec: ModelSpec, name: str) -> list[tuple[str, int]] | None:
    """(name, rows) of each part of the fused tensor ``name`` in row order, or None if ``name``
    is not one (every tensor of a model other than Phi-3)."""
    if spec.architecture != "phi3":
        return None
    stem, _, suffix = name.rpartition(".")
    if stem.endswith("self_attn.qkv_proj"):
        base = stem[: -len("qkv_proj")]
        return [(f"{base}q_proj.{suffix}", spec.q_size), (f"{base}k_proj.{suffix}", spec.kv_size),
                (f"{base}v_proj.{suffix}", spec.kv_size)]
    if stem.endswith("mlp.gate_up_proj"):
        base = stem[: -len("gate_up_proj")]
        n = spec.intermediate_size
        return [(f"{base}gate_proj.{suffix}", n), (f"{base}up_proj.{suffix}", n)]
    return None


def split_fused(spec: ModelSpec, name: str, tensor: T) -> list[tuple[str, T]]:
    """``[(name, tensor)]``, or the parts of a fused tensor as row slices (a ValueError when
    its rows do not add up to the spec's)."""
    experts = split_expert_tensor(spec, name, tensor)
    if experts is not None:
        return experts
    parts = fused_parts(spec, name)
    if parts is None:
        return [(name, tensor)]
    rows = int(tensor.shape[0])  # type: ignore[attr-defined]
    if rows != sum(r for _, r in parts):
        raise ValueError(f"tensor {name!r} has {rows} rows, expected "
                         f"{' + '.join(str(r) for _, r in parts)} ({', '.join(n for n, _ in parts)})")
    out: list[tuple[str, T]] = []
    start = 0
    for part, r in parts:
        out.append((part, tensor[start : start + r]))  # type: ignore[index]
        start += r
    return out


def checkpoint_names(spec: ModelSpec, expected: list[str]) -> list[str]:
    """The names a checkpoint stores ``expected`` (the engine's HF names) under: each fused
    tensor's name once in place of its parts (Phi-3), the others as they are."""
    out: dict[str, None] = {}
    for name in expected:
        stem, _, suffix = name.rpartition(".")
        for fused, part in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj",
                                                    "self_attn.v_proj")),
                            ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
            base = next((stem[: -len(p)] for p in part if stem.endswith(p)), None)
            if base is not None and fused_parts(spec, f"{base}{fused}.{suffix}") is not None:
                name = f"{base}{fused}.{suffix}"
                break
        out[name] = None
    return list(out)
