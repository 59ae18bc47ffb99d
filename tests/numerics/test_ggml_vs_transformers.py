"""GGUF files of every held-as-stored type (and a Q4_K_M-like mix, Q3_K held as Q6_K blocks,
and a type dequantized at load), run by the engine with the weights as the file's raw ggml blocks, against transformers
loading the same file with its own GGUF loader (gguf.quants dequantization, its own Q/K
un-permutation): the same greedy tokens, every step's top-5 logprobs within EXACT_TOL.

The files are small random-weight llamas written with gguf's GGUFWriter; K-quant / IQ4 blocks
are random valid blocks (gguf.quants cannot quantize them; tests.ggml_random_blocks), Q5_0 /
Q5_1 are quantized by gguf.quants itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.model.ggml_linear import GgmlEmbedding, GgmlLinear
from tests.numerics.test_quantized_vs_transformers import EXACT_TOL, compare
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

# K-quant rows need K in multiples of 256; std 0.15 keeps a random model's greedy path varied
SHAPE: dict[str, Any] = dict(hidden=256, ff=512, heads=4, kv_heads=2, vocab=320, std=0.15)
PROMPTS = [[5, 6, 7, 8], [100, 30, 200, 9, 1], [3], [250, 251, 17, 42, 43, 44, 45]]
CASES = {
    **{q.name: (TinyGGUF(**SHAPE, qtype=q), {q.name})
       for q in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS)},
    "Q4_K_M-like": (TinyGGUF(**SHAPE, qtype=Q.Q4_K, embd_qtype=Q.Q6_K, tied=True,
                             types={"attn_v": Q.Q6_K, "ffn_down": Q.Q5_0}),
                    {"Q4_K", "Q6_K", "Q5_0"}),
    # Q3_K held as Q6_K blocks, TQ2_0 as packed Q4_0 (converted exactly at load), Q2_K dequantized
    "Q3_K-as-Q6_K": (TinyGGUF(**SHAPE, qtype=Q.Q3_K, embd_qtype=Q.Q6_K,
                              types={"attn_k": Q.IQ4_XS, "ffn_down": Q.Q2_K,
                                     "ffn_gate": Q.TQ2_0}), {"Q6_K", "IQ4_XS"}),
}


# NOTE: slow (~10 s a case on an idle 2-core host, transformers' load included), except the mix
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if n == "Q4_K_M-like" else pytest.mark.slow) for n in CASES])
def test_held_as_stored_matches_transformers(tmp_path: Path, name: str) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    case, held = CASES[name]
    path = write_tiny_gguf(tmp_path / "m.gguf", case)
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                 max_model_len=64, num_kv_blocks=32))
    modules = [m for m in engine.runner.model.modules()
               if isinstance(m, GgmlLinear | GgmlEmbedding)]
    assert {m.ggml_type for m in modules} == held
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    result = compare(engine, hf, PROMPTS, EXACT_TOL, min_identical=len(PROMPTS))
    print(f"{name}: {result}")
