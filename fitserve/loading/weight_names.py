"""A model file's weights against the tensors the engine holds for its spec
(``fitserve.ledger.weight_names.expected_weight_shapes``, which the weight ledger counts too)."""

from __future__ import annotations

import re
from typing import Any

from fitserve.config import ModelSpec
from fitserve.ledger.weight_names import expected_weight_shapes
from fitserve.loading.errors import MissingTensorError, ModelLoadError

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
