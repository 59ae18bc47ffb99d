"""``build_model(..., consume=True)`` (what the engine builder does with a model it loaded):
each q/k/v and gate/up part is freed as soon as its fused copy exists, so the load's peak RSS
holds one copy of the weights (issue 37: a 1.7B Q8_0 file peaked 13% over the ledger's bound),
and the model equals the one built from weights the caller keeps."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from fitserve.loading import load_model
from fitserve.model.loader import build_model
from tests.unit.loading.test_loading_gguf import write_gguf

PARTS = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"] + [
    f"model.layers.0.mlp.{x}_proj.weight" for x in ("gate", "up")]


def test_consumed_build_frees_fused_parts_and_equals_plain_build(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, qtype=Q.Q8_0)
    kept = load_model(path, torch.bfloat16, "as-stored")
    plain = build_model(kept.spec, kept.weights, dtype=torch.bfloat16, device="cpu",
                        max_positions=64)
    assert all(n in kept.weights for n in PARTS)  # not consumed: the caller's dict is whole
    weights = load_model(path, torch.bfloat16, "as-stored").weights
    codes = [weakref.ref(weights[n].qweight) for n in PARTS]  # type: ignore[union-attr]
    model = build_model(kept.spec, weights, dtype=torch.bfloat16, device="cpu",
                        max_positions=64, consume=True)
    gc.collect()
    assert weights == {}
    assert [r() is None for r in codes] == [True] * len(PARTS)  # only the fused copies remain
    want = dict(plain.state_dict())
    got = dict(model.state_dict())
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
