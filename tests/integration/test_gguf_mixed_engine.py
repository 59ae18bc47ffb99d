"""A GGUF file mixing block types (Q4_0/Q4_1/Q8_0 packed, Q4_K/Q6_K raw ggml blocks) run by a real
engine as stored against the same file run dense (the file is made by tests.unit.quant.test_quant_gguf)."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as Q

from tests.unit.quant.test_quant_gguf import write_model


def test_mixed_file_engine_as_stored_equals_dense(tmp_path: Path) -> None:
    """q/k/v in three formats (a ConcatLinear of packed parts), gate/up Q6_K + Q4_K (a
    ConcatLinear of GgmlLinears),
    Q4_0 embedding: the packed engine computes what the dense fp32 engine computes."""
    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.model.ggml_linear import GgmlLinear
    from fitserve.model.linear import ConcatLinear, PackedLinear
    from fitserve.sampling import SamplingParams

    path = tmp_path / "mixed.gguf"
    write_model(path, {"attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "ffn_up": Q.Q4_K,
                       "ffn_gate": Q.Q6_K, "ffn_down": Q.Q4_1, "token_embd": Q.Q4_0})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = []
    for weights in ("as-stored", "float32"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                     weights=weights, max_model_len=64, num_kv_blocks=16))
        layer = engine.runner.model.layers[0]
        if weights == "as-stored":
            assert isinstance(layer.self_attn.qkv_proj, ConcatLinear)
            assert isinstance(layer.mlp.down_proj, PackedLinear)
            gate_up = layer.mlp.gate_up_proj
            assert isinstance(gate_up, ConcatLinear)
            assert [p.ggml_type for p in gate_up.parts if isinstance(p, GgmlLinear)] == [
                "Q6_K", "Q4_K"]
        outs.append(list(engine.stream([5, 9, 77, 3], params))[-1])
    packed, dense = outs
    assert packed.token_ids == dense.token_ids
    for a, b in zip(packed.logprobs or [], dense.logprobs or [], strict=True):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)) < 1e-4
