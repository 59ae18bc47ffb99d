"""The engine's decode over a quantized KV cache read in place (the fused quantized kernel,
CpuPagedDecodeKVQ) on the default model, for every codec and scale layout: at every decode step
and layer, the kernel's output on the cache the run really built equals float64 attention over
that cache's dequantized codes (an independent naive reference), and the fused path is the one
decode steps take. Then the fast path decode steps take by default (the flat decode loop and its
C++ step, fitserve.runner.decode_loop, with the fused rotation + code writer) gives the same
greedy tokens as the module path, and is the one taken.

# NOTE: not greedy tokens against the dequantize path's own run. The two runs differ by fp32
# summation order (~1e-6), and a quantized cache turns such a difference into a whole code step
# whenever a value lands on a rounding boundary: with int8 per-channel keys, at step 6 of this
# prompt a block's key scale grows and a code of 127 re-encodes at 127 * old / new = 69.49999699
# (float64) in one run and 69.49995461 in the other (their scales 4.6e-7 apart), fp32 gives 70
# and 69, and the flips compound until the greedy token changes at step 15. Both runs' writes are
# bit-equal to QuantizedKVCache.write and both kernels match float64 to ~2e-6: the reference
# below checks the kernel on the very state it reads, which such a flip cannot disturb."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.kernels.cpu.paged_attention_kvq import paged_attention_kvq_available
from fitserve.model.attention.backend import DecodeBatch
from fitserve.model.attention.cpu_paged import CpuPagedDecodeKVQ
from fitserve.quant.kv_cache import QuantizedKVCache
from fitserve.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not paged_attention_kvq_available(),
                                reason="the quantized decode kernel did not build")

PROMPT = ("The history of computing is a story of abstraction layered on abstraction. Early "
          "machines were programmed by rewiring panels; later, stored programs let one machine ")


def _greedy(engine: Engine, params: SamplingParams) -> list[int]:
    return [t for out in engine.stream(PROMPT, params) for t in out.delta_token_ids]


def _decode64(codes: torch.Tensor, fp8: torch.dtype | None) -> torch.Tensor:
    """Codes -> float64 values (int8 as integers; fp8 bits through torch's float8 dtype)."""
    return (codes.view(fp8) if fp8 is not None else codes).to(torch.float64)


def attention64(q: torch.Tensor, kv: QuantizedKVCache, d: DecodeBatch, scale: float
                ) -> torch.Tensor:
    """Naive float64 decode attention of q [B, Hq, D] over the sequences' quantized blocks."""
    assert d.seq_lens is not None and d.window is None
    bs, outs = kv.block_size, []
    for b, length in enumerate(d.seq_lens.tolist()):
        blocks = d.block_tables[b, : -(-length // bs)].long()
        ks = kv.k_scales.index_select(1, blocks).double()
        k = _decode64(kv.k_codes.index_select(1, blocks), kv.codec.fp8) * (
            ks.unsqueeze(2) if kv.key_layout == "channel-key" else ks.unsqueeze(-1))
        v = (_decode64(kv.v_codes.index_select(1, blocks), kv.codec.fp8)
             * kv.v_scales.index_select(1, blocks).double().unsqueeze(-1))
        hkv, _, _, dim = k.shape
        k, v = k.reshape(hkv, -1, dim)[:, :length], v.reshape(hkv, -1, dim)[:, :length]
        qh = q[b].double().view(hkv, -1, dim)
        p = torch.softmax(torch.einsum("hgd,htd->hgt", qh, k) * scale, -1)
        outs.append(torch.einsum("hgt,htd->hgd", p, v).reshape(-1, dim))
    return torch.stack(outs)


@pytest.mark.parametrize(("kv_dtype", "scales"), [("int8", "auto"), ("int8", "token"),
                                                  ("fp8_e4m3", "auto"),
                                                  ("fp8_e5m2", "channel-key")])
def test_fused_quantized_decode_equals_float64(smollm2_gguf: Path, kv_dtype: str, scales: str,
                                               monkeypatch: Any) -> None:
    engine = Engine(EngineConfig(model=str(smollm2_gguf), dtype="float32", weights="as-stored",
                                 device="cpu", max_model_len=512, enforce_eager=True,
                                 kv_cache_dtype=kv_dtype,  # type: ignore[arg-type]
                                 kv_cache_scales=scales))  # type: ignore[arg-type]
    runner = engine.runner
    assert isinstance(runner.kv_caches[0], QuantizedKVCache) and runner.use_kvq
    calls = {"fused": 0, "dequantize": 0}
    errors: list[float] = []
    fused, dequantize = CpuPagedDecodeKVQ.decode_quantized, QuantizedKVCache.dequantize

    def checked_fused(self: CpuPagedDecodeKVQ, q: torch.Tensor, kv: QuantizedKVCache,
                      d: DecodeBatch, scale: float) -> torch.Tensor:
        calls["fused"] += 1
        out = fused(self, q, kv, d, scale)
        errors.append((out.double() - attention64(q, kv, d, scale)).abs().max().item())
        return out

    def count_dequantize(*a: Any, **k: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls["dequantize"] += 1
        return dequantize(*a, **k)

    monkeypatch.setattr(CpuPagedDecodeKVQ, "decode_quantized", checked_fused)
    monkeypatch.setattr(QuantizedKVCache, "dequantize", count_dequantize)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    layers = len(runner.kv_caches)
    loop, runner.decode_loop = runner.decode_loop, None  # the module path first
    assert loop is not None, "a quantized cache read in place takes the flat decode loop"

    new = _greedy(engine, params)
    # prefill once (dequantize path), then 39 decode steps on the fused kernel in every layer
    assert calls == {"fused": 39 * layers, "dequantize": layers}
    # outputs are O(1); a stale scale or a wrong code row moves them by ~1e-2
    assert max(errors) < 2e-5, f"fused kernel vs float64: max |diff| {max(errors):.3g}"

    engine.reset_prefix_cache()
    monkeypatch.setattr(CpuPagedDecodeKVQ, "decode_quantized", fused)
    runner.decode_loop = loop
    fast = _greedy(engine, params)
    assert loop.native_calls == loop.calls == 39  # every decode step in decode_layers (C++)
    assert fast == new
