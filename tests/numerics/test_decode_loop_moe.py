"""The flat decode loop and decode_layers (C++) on q/k norms and sparse MoE blocks, against the
module path (``CausalLM.forward``): bit-identical hidden states at batch 1 and 3.

- Qwen3 (dense, q/k RMSNorm per head), bf16: decode_layers runs the norms.
- Qwen3-MoE, Mixtral, OLMoE (q/k norm over the whole projection) and Qwen2-MoE (shared expert
  with its sigmoid gate), written as GGUF with Q5_0 experts as llama.cpp stores them (3-D
  ``ffn_*_exps``): in bf16 the experts run on the grouped ggml kernel, and decode_layers runs
  routing, the grouped expert call and the combine itself.
- Experts off the grouped kernel (an HF folder's dense experts, fp32; Qwen2-MoE with a dense
  first layer): the Python loop calls the block as its module, decode_layers does not run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.kernels.cpu.decode_step import decode_step_available
from fitserve.kernels.cpu.moe_experts import moe_kernel_available
from fitserve.model.moe import SparseMoeBlock

from .moe_to_gguf import write_moe_gguf
from .test_decode_loop import BLOCK, BLOCKS_PER_SEQ, assert_step_identical
from .test_moe_vs_transformers import build_moe

pytestmark = pytest.mark.skipif(not decode_step_available(),
                                reason="decode_layers (decode_step.cpp) is not built here")


def engine_for(model: Path, dtype: str, **kw: Any) -> Engine:
    return Engine(EngineConfig(model=str(model), dtype=dtype, device="cpu", max_model_len=128,
                               num_kv_blocks=1 + 3 * BLOCKS_PER_SEQ, block_size=BLOCK, **kw))


def steps_native(engine: Engine) -> None:
    """Batch 1 and batch 3: every step bit-identical (module path, Python loop, decode_layers),
    and decode_layers ran at both."""
    for n in (1, 3):
        assert True in assert_step_identical(engine, n), n


def test_qwen3_qk_norm_per_head(tiny_hf_model_dir: Callable[..., Any]) -> None:
    engine = engine_for(tiny_hf_model_dir("qwen3"), "bfloat16", weights="bf16")
    assert engine.runner.model.layers[0].self_attn.q_norm is not None
    steps_native(engine)


@pytest.mark.skipif(not moe_kernel_available("Q5_0", "Q5_0"), reason="no moe_experts C++ build")
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_moe_grouped_experts_native(arch: str, tmp_path: Path) -> None:
    # llama.cpp's Qwen2-MoE graph has no dense layers: every layer sparse in the file
    extra = {"mlp_only_layers": []} if arch == "qwen2_moe" else {}
    path = write_moe_gguf(build_moe(arch, tmp_path / "hf", None, **extra),
                          tmp_path / f"{arch}.gguf", Q.Q5_0)
    engine = engine_for(path, "bfloat16")
    model = engine.runner.model
    blocks = [layer.mlp for layer in model.layers]
    assert all(type(b) is SparseMoeBlock for b in blocks)
    assert (blocks[0].shared_expert is not None) == (arch == "qwen2_moe")
    assert (model.layers[0].self_attn.q_norm is not None) == (arch in ("qwen3_moe", "olmoe"))
    # stacked at start-up (prepare_grouped), not in the first request's step, and never again
    grouped = [b._grouped for b in blocks]
    assert all(g is not None and g.active for g in grouped)
    steps_native(engine)
    assert all(b._grouped is g for b, g in zip(blocks, grouped, strict=True))


def test_moe_experts_off_the_grouped_kernel(tmp_path: Path, smollm2_tokenizer_dir: Path) -> None:
    """Qwen2-MoE from its HF folder in fp32 (dense experts, a dense first layer, q/k/v bias):
    the Python loop runs the block as its module, bit-identical; decode_layers does not bind."""
    folder = tmp_path / "hf"
    build_moe("qwen2_moe", folder, smollm2_tokenizer_dir)
    engine = engine_for(folder, "float32")
    assert type(engine.runner.model.layers[1].mlp) is SparseMoeBlock
    for n in (1, 3):
        assert assert_step_identical(engine, n) == {False}, n
