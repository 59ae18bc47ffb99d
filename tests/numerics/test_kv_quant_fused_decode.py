"""The engine's decode over a quantized KV cache read in place (the fused quantized kernel,
CpuPagedDecodeKVQ) against the old path on the same engine (each layer dequantizes the step's
blocks into a compact cache, then the dense kernel): greedy tokens equal on the default model,
for every codec and scale layout, and the fused path is the one decode steps really take.
float32 activations, so both paths see the same codes and scales and differ only in fp32
rounding (the old path's compact cache is float32 too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.kernels.cpu.paged_attention_kvq import paged_attention_kvq_available
from fitserve.model.attention.cpu_paged import CpuPagedDecodeKVQ
from fitserve.quant.kv_cache import QuantizedKVCache
from fitserve.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not paged_attention_kvq_available(),
                                reason="the quantized decode kernel did not build")

PROMPT = ("The history of computing is a story of abstraction layered on abstraction. Early "
          "machines were programmed by rewiring panels; later, stored programs let one machine ")


def _greedy(engine: Engine, params: SamplingParams) -> list[int]:
    return [t for out in engine.stream(PROMPT, params) for t in out.delta_token_ids]


@pytest.mark.parametrize(("kv_dtype", "scales"), [("int8", "auto"), ("int8", "token"),
                                                  ("fp8_e4m3", "auto"),
                                                  ("fp8_e5m2", "channel-key")])
def test_fused_quantized_decode_equals_dequantize_path(smollm2_gguf: Path, kv_dtype: str,
                                                       scales: str, monkeypatch: Any) -> None:
    engine = Engine(EngineConfig(model=str(smollm2_gguf), dtype="float32", weights="as-stored",
                                 device="cpu", max_model_len=512, enforce_eager=True,
                                 kv_cache_dtype=kv_dtype,  # type: ignore[arg-type]
                                 kv_cache_scales=scales))  # type: ignore[arg-type]
    runner = engine.runner
    assert isinstance(runner.kv_caches[0], QuantizedKVCache) and runner.use_kvq
    calls = {"fused": 0, "dequantize": 0}
    fused, dequantize = CpuPagedDecodeKVQ.decode_quantized, QuantizedKVCache.dequantize

    def count_fused(*a: Any, **k: Any) -> torch.Tensor:
        calls["fused"] += 1
        return fused(*a, **k)

    def count_dequantize(*a: Any, **k: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls["dequantize"] += 1
        return dequantize(*a, **k)

    monkeypatch.setattr(CpuPagedDecodeKVQ, "decode_quantized", count_fused)
    monkeypatch.setattr(QuantizedKVCache, "dequantize", count_dequantize)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    layers = len(runner.kv_caches)

    new = _greedy(engine, params)
    # prefill once (dequantize path), then 39 decode steps on the fused kernel in every layer
    assert calls == {"fused": 39 * layers, "dequantize": layers}

    engine.reset_prefix_cache()
    runner.use_kvq = False
    calls.update(fused=0, dequantize=0)
    old = _greedy(engine, params)
    assert calls == {"fused": 0, "dequantize": 40 * layers}
    assert new == old
