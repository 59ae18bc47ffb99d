"""The Hugging Face weight names (and shapes) the engine holds for a spec, and their check.

Torch-free: the planner's weight ledger (``fitserve.ledger.weights``) counts the same tensors.
"""

from __future__ import annotations

import re
from typing import Any

from fitserve.config import ModelSpec
from fitserve.loading.errors import MissingTensorError, ModelLoadError


def expected_weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face parameter name (and shape) the engine holds for ``spec``.

    ``lm_head.weight`` appears only when embeddings are untied; biases only with
    ``attention_bias``; ``q_norm``/``k_norm`` only with ``qk_norm``.
    """
    h, q, kv, dim = spec.hidden_size, spec.q_size, spec.kv_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, h)
            if spec.attention_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (dim,)
            shapes[p + "self_attn.k_norm.weight"] = (dim,)
        shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
    return shapes


# Tensors some checkpoints carry that the engine does not need (recomputed or redundant).
_HARMLESS_EXTRA = re.compile(r".*rotary_emb\.inv_freq$")


def check_weights(weights: dict[str, Any], spec: ModelSpec, source: object) -> None:
    """Check ``weights`` has exactly the tensors ``spec`` needs, with the right shapes.

    Drops harmless extras in place (``rotary_emb.inv_freq``; ``lm_head.weight`` when tied);
    raises :class:`MissingTensorError` for absent tensors and :class:`ModelLoadError` for a
    wrong shape or an unexpected tensor (which would otherwise be silently ignored).
    """
    expected = expected_weight_shapes(spec)
    for name in list(weights):
        if name not in expected and (
            _HARMLESS_EXTRA.fullmatch(name)
            or (name == "lm_head.weight" and spec.tie_word_embeddings)
        ):
            del weights[name]
    missing = [n for n in expected if n not in weights]
    if missing:
        raise MissingTensorError(missing, source)
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ModelLoadError(
            f"{source}: unexpected tensors for {spec.architecture}: {', '.join(unexpected[:8])}"
        )
    for name, shape in expected.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {got}, expected {shape}")
