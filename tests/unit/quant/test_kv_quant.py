"""The quantized paged KV cache (fitserve.quant.kv_cache) against float64 references.

Per-token scales: the dequantized cache equals a float64 quantize-dequantize of each token
(int8 exactly up to float32 rounding of the scale; fp8 within the format's half ulp).
Per-channel key scales: a float64 model of the running-absmax bookkeeping (scale grows, the
block's earlier codes requantized) gives the same values, and every value stays within one
final scale of the truth; a write at offset 0 starts a block afresh; CoW copies scales.
The bytes held equal the ledger's block bytes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fitserve.config import ModelSpec
from fitserve.ledger.formats import KV_FORMATS, resolve_engine_kv_format
from fitserve.ledger.kv import kv_block_bytes
from fitserve.quant.kv_cache import CODECS, QuantizedKVCache

H, D, BS, NB = 2, 8, 4, 6


def _cache(codec: str, layout: str) -> QuantizedKVCache:
    return QuantizedKVCache(codec, layout, num_kv_heads=H, num_blocks=NB, block_size=BS,
                            head_dim=D)


def _fake_quant(x: torch.Tensor, scale: torch.Tensor, codec: str) -> torch.Tensor:
    """float64 reference: the value the cache holds for ``x`` under ``scale``."""
    c = CODECS[codec]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (x.double() / safe).clamp(-c.qmax, c.qmax)
    q = torch.round(y) if c.fp8 is None else y.float().to(c.fp8).double()
    return q * scale


@pytest.mark.parametrize("codec", list(CODECS))
def test_per_token_matches_float64_reference(codec: str) -> None:
    torch.manual_seed(0)
    cache = _cache(codec, "token")
    k = torch.randn(7, H, D) * torch.linspace(0.1, 30, D)  # channels of very different size
    v = torch.randn(7, H, D)
    slots = torch.tensor([0, 1, 2, 5, 9, 10, 23])
    cache.write(k, v, slots)
    kd, vd = cache.dequantize(torch.arange(NB), torch.float32)
    for x, got in ((k, kd), (v, vd)):
        scale = (x.double().abs().amax(-1, keepdim=True) / CODECS[codec].qmax).float().double()
        want = _fake_quant(x, scale, codec)  # [N, H, D]
        flat = got.reshape(H, NB * BS, D)[:, slots].transpose(0, 1).double()
        torch.testing.assert_close(flat, want, rtol=1e-6, atol=1e-7)
        if codec == "int8":  # the RTN bound, element by element
            assert bool(((flat - x.double()).abs() <= scale / 2 + 1e-6).all())


def _channel_key_reference(tokens: list[tuple[int, torch.Tensor]], qmax: float,
                           codec: str) -> dict[int, torch.Tensor]:
    """float64 model of one block's per-channel key scales under token-by-token writes:
    offset -> dequantized key [H, D] after all writes."""
    scale = torch.zeros(H, D, dtype=torch.float64)
    held: dict[int, torch.Tensor] = {}
    for off, x in tokens:
        if off == 0:
            scale = torch.zeros(H, D, dtype=torch.float64)
            held = {}
        new = torch.maximum(scale, (x.abs().float() / qmax).double())
        if bool((new > scale).any()):
            held = {o: _fake_quant(val, new, codec) for o, val in held.items()}
        scale = new
        held[off] = _fake_quant(x, scale, codec)
    return held


@pytest.mark.parametrize("codec", list(CODECS))
def test_channel_keys_running_scale_one_token_at_a_time(codec: str) -> None:
    torch.manual_seed(1)
    cache = _cache(codec, "channel-key")
    qmax = CODECS[codec].qmax
    block = 3
    keys = [torch.randn(H, D) * (1 + 3 * i) for i in range(BS)]  # growing: every write rescales
    writes = []
    for off, key in enumerate(keys):
        cache.write(key[None], torch.zeros(1, H, D), torch.tensor([block * BS + off]))
        writes.append((off, key))
    kd, _ = cache.dequantize(torch.tensor([block]), torch.float32)
    want = _channel_key_reference(writes, qmax, codec)
    final_scale = cache.k_scales[:, block].double()
    torch.testing.assert_close(final_scale, torch.stack(keys).abs().amax(0).double() / qmax,
                               rtol=1e-6, atol=0)
    for off, key in enumerate(keys):
        torch.testing.assert_close(kd[:, 0, off].double(), want[off], rtol=1e-5, atol=1e-6)
        if codec == "int8":  # requantized codes: within one final scale of the truth
            assert bool(((kd[:, 0, off].double() - key.double()).abs()
                         <= final_scale + 1e-6).all())


def test_offset_zero_starts_a_block_afresh_and_copy_keeps_scales() -> None:
    cache = _cache("int8", "channel-key")
    cache.write(torch.full((BS, H, D), 100.0), torch.ones(BS, H, D), torch.arange(BS))
    small = torch.full((1, H, D), 0.5)
    cache.write(small, torch.ones(1, H, D), torch.tensor([0]))  # block 0 reallocated
    assert torch.allclose(cache.k_scales[:, 0], torch.full((H, D), 0.5 / 127))
    cache.copy_blocks(torch.tensor([0]), torch.tensor([4]))
    k0, v0 = cache.dequantize(torch.tensor([0]), torch.float32)
    k4, v4 = cache.dequantize(torch.tensor([4]), torch.float32)
    assert torch.equal(k0, k4) and torch.equal(v0, v4)
    assert torch.allclose(k4[:, 0, 0], small[0], rtol=1e-3)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.sampled_from(list(CODECS)),
       st.integers(0, 2**16))
def test_chunked_writes_equal_the_reference(chunks: list[int], codec: str, seed: int) -> None:
    """Chunks of any length over one sequence's blocks 5, 2, 0 ... give the reference values."""
    gen = torch.Generator().manual_seed(seed)
    cache = _cache(codec, "channel-key")
    table = [5, 2, 0, 3, 1, 4]
    pos, per_block = 0, {}
    writes: dict[int, int] = {}  # block -> chunks that wrote into it
    for n in chunks:
        if pos + n > len(table) * BS:
            break
        k = torch.randn(n, H, D, generator=gen) * 4
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(pos, pos + n)])
        cache.write(k, torch.zeros_like(k), slots)
        # the reference sees a chunk's tokens at once: one scale update per block per chunk
        for p in range(pos, pos + n):
            per_block.setdefault(p // BS, []).append((p % BS, k[p - pos]))
        for b in {p // BS for p in range(pos, pos + n)}:
            writes[b] = writes.get(b, 0) + 1
        pos += n
    qmax = CODECS[codec].qmax
    kd, _ = cache.dequantize(torch.tensor(table), torch.float32)
    for b, toks in per_block.items():
        scale = torch.stack([x for _, x in toks]).abs().amax(0).double() / qmax
        torch.testing.assert_close(cache.k_scales[:, table[b]].double(), scale, rtol=1e-6,
                                   atol=0)
        for off, x in toks:  # within one final scale (fp8: its relative half ulp, plus that)
            err = (kd[:, b, off].double() - x.double()).abs()
            # NOTE: each chunk into the block may have grown its scale and requantized the
            # codes already there: one more rounding each (hypothesis found 4 chunks exceeding
            # a single rounding's bound for fp8_e5m2)
            tol = (scale + x.double().abs() * 2**-2) * writes[b]
            assert bool((err <= tol + 1e-6).all())


SPEC = ModelSpec(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                 num_layers=3, num_heads=4, num_kv_heads=H, head_dim=D)


@pytest.mark.parametrize("fmt", ["int8", "int8-kc", "fp8_e4m3", "fp8_e4m3-kc", "fp8_e5m2-kc"])
def test_bytes_held_equal_the_ledger(fmt: str) -> None:
    f = KV_FORMATS[fmt]
    layers = [QuantizedKVCache(f.codec, "channel-key" if f.key_scales == "channel" else "token",
                               num_kv_heads=H, num_blocks=NB, block_size=BS, head_dim=D)
              for _ in range(SPEC.num_layers)]
    assert sum(c.nbytes for c in layers) == NB * kv_block_bytes(SPEC, BS, fmt)
    # by hand, per layer per head per block: K and V codes + V token scales + K scales
    key = D * 4 if f.key_scales == "channel" else BS * 4
    assert kv_block_bytes(SPEC, BS, fmt) == SPEC.num_layers * H * (2 * BS * D + BS * 4 + key)


def test_engine_kv_format_resolution() -> None:
    assert resolve_engine_kv_format("auto", "auto", "bf16") == "bf16"
    assert resolve_engine_kv_format("int8", "auto", "bf16") == "int8-kc"
    assert resolve_engine_kv_format("fp8", "auto", "bf16") == "fp8_e4m3"
    assert resolve_engine_kv_format("fp8_e5m2", "auto", "bf16") == "fp8_e5m2"
    assert resolve_engine_kv_format("fp8", "token", "f32") == "fp8_e4m3"
    assert resolve_engine_kv_format("fp8_e5m2", "channel-key", "f32") == "fp8_e5m2-kc"
    from fitserve.ledger.errors import PlanError

    with pytest.raises(PlanError, match="applies to a quantized KV cache"):
        resolve_engine_kv_format("auto", "token", "bf16")
    with pytest.raises(PlanError, match="unknown --kv-cache-dtype"):
        resolve_engine_kv_format("int4", "auto", "bf16")


def test_the_ledger_counts_the_dequant_scratch_of_a_quantized_cache() -> None:
    """One layer's dense K and V (model dtype) plus their f32 decode, for the blocks a step can
    read: min(pool blocks, max_num_seqs x blocks of max_model_len); none for a dense cache."""
    from fitserve.ledger.memory import cpu_engine_memory_plan

    def plan(kv: str, seqs: int) -> dict[str, int]:
        p = cpu_engine_memory_plan(SPEC, weight_bytes=0, max_num_batched_tokens=64,
                                   max_num_seqs=seqs, block_size=BS, kv_dtype=kv,
                                   act_dtype_bytes=2, kv_blocks=NB * 10, max_model_len=32)
        return {line.name: line.bytes for line in p.lines}

    assert "KV dequant scratch" not in plan("bf16", 2)
    per_block = BS * H * D * (2 * 2 + 8)
    assert plan("int8-kc", 2)["KV dequant scratch"] == 2 * (32 // BS) * per_block  # seqs bound
    assert plan("fp8_e4m3", 100)["KV dequant scratch"] == NB * 10 * per_block  # pool bound


def test_the_dequant_scratch_is_in_the_step_peak_and_the_touched_bound() -> None:
    """The dequantized K/V live in a layer's attention phase: part of the step peak, so
    ``peak_with_kv`` (the bound for the blocks a run touched, what ``plan.fit`` checks) counts
    them as ``peak_bytes`` does (it left them out before)."""
    from fitserve.ledger.formats import kv_format
    from fitserve.ledger.memory import (
        EngineMemoryPlan,
        cpu_engine_memory_plan,
        cpu_step_bytes,
        cpu_step_phases,
        heap_retention_bytes,
    )
    from fitserve.ledger.scratch import (
        cpp_kernels_disabled,
        cpu_attention_scratch,
        cpu_threads,
        sampler_bytes,
    )

    def plan(kv: str) -> EngineMemoryPlan:
        return cpu_engine_memory_plan(SPEC, weight_bytes=0, max_num_batched_tokens=64,
                                      max_num_seqs=2, block_size=BS, kv_dtype=kv,
                                      act_dtype_bytes=2, kv_blocks=4096, max_model_len=4096)

    q = plan("fp8_e4m3")
    dequant = q.line("KV dequant scratch").bytes
    assert dequant == 2 * (4096 // BS) * BS * H * D * (2 * 2 + 8)  # 2 sequences' blocks
    assert q.step_phase == "attention"
    assert q.peak_with_kv(q.kv_allocated_bytes) == q.peak_bytes
    assert q.peak_with_kv(0) == q.resident_bytes + max(q.load_bytes, q.step_bytes)
    assert q.step_bytes >= dequant
    # exactly the attention phase plus the scratch (that phase sets the peak here)

    sc = cpu_attention_scratch(SPEC, max_num_batched_tokens=64, max_model_len=4096,
                               max_num_seqs=2, block_size=BS, act_bytes=2,
                               kv_bytes=kv_format("fp8_e4m3").element_bytes,
                               threads=cpu_threads(), fused_decode=not cpp_kernels_disabled(),
                               paged_prefill=False)  # chunks over a quantized cache: SDPA
    rest = q.line("logits").bytes + sampler_bytes(SPEC, 2)
    without, _ = cpu_step_bytes(SPEC, 64, 2, sc, rest)
    live, phase = cpu_step_bytes(SPEC, 64, 2, sc, rest, dequant)
    # + the other phases glibc's heap keeps until the trim after the step
    retained = heap_retention_bytes(cpu_step_phases(SPEC, 64, 2, sc, rest, dequant))
    assert (live + retained, phase) == (q.step_bytes, "attention")
    assert q.line("allocator retention").bytes == retained
    assert without < live <= without + dequant

