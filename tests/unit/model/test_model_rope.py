"""The engine's RotaryEmbedding vs the float64 complex-multiplication reference, both pairings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fitserve.config import ModelSpec
from fitserve.model.layers import RotaryEmbedding
from fitserve.tools.labs.rope import apply_rope_reference

SPEC = ModelSpec(architecture="llama", vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1,
                 num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_matches_reference_at_ragged_and_long_positions(interleaved: bool) -> None:
    spec = dataclasses.replace(SPEC, rope_interleaved=interleaved)
    rope = RotaryEmbedding(spec, max_positions=100_001)
    positions = torch.tensor([0, 1, 7, 3, 4095, 100_000])  # ragged, unsorted, long
    x = torch.randn(len(positions), 6, 16, dtype=torch.float32)
    ours = rope(x, rope.tables(positions, torch.float32))
    ref = apply_rope_reference(x, positions, base=10000.0, pairing="interleaved" if interleaved else "half")
    # fp32 angles at position 1e5 carry ~2^-24 * 1e5 ~ 6e-3 rad of rounding: that bounds the error
    torch.testing.assert_close(ours.double(), ref, atol=2e-2, rtol=0)
    torch.testing.assert_close(ours[:4].double(), ref[:4], atol=1e-5, rtol=0)
    other = apply_rope_reference(x, positions, base=10000.0, pairing="half" if interleaved else "interleaved")
    assert (ours[1:].double() - other[1:]).abs().max() > 0.1, "pairings must differ (test not vacuous)"
