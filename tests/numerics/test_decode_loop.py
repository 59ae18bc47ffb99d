"""The flat decode loop (fitserve.runner.decode_loop) against the module path it replaces: the same
decode step through ``CausalLM.forward`` and through ``DecodeLoop`` must give bit-identical
hidden states (same ops, same order), on ragged batches of every shape class, for the default
model as stored (Q4_1 + Q8_0, bf16 activations) and for tiny models whose linears it does not
bind (qkv bias: called as modules) or whose attention has a sliding window; and an engine with
the loop must generate the same greedy tokens as one with FITSERVE_DECODE_LOOP=0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.kernels.cpu.paged_attention import paged_attention_available
from fitserve.runner.model_runner import decode_rows_first
from fitserve.sampling import SamplingParams
from fitserve.types import ScheduledChunk

pytestmark = pytest.mark.skipif(not paged_attention_available(),
                                reason="the decode loop runs on the C++ kernels")

BLOCK = 16
BLOCKS_PER_SEQ = 8  # max_model_len 128


def prompts(n: int, vocab: int) -> list[list[int]]:
    """n prompts of ragged lengths 3 .. 40 (some past one block, one past two)."""
    return [[(7 + 31 * i + 13 * j) % (vocab - 1) + 1 for j in range(3 + (i * 11) % 38)]
            for i in range(n)]


@torch.inference_mode()
def assert_step_identical(engine: Engine, num_seqs: int) -> set[bool]:
    """Module path == Python loop == decode_layers, bit for bit; returns whether decode_layers
    ran ({True}), did not ({False}) or both across the steps."""
    used: set[bool] = set()
    runner = engine.runner
    assert runner.decode_loop is not None
    vocab = engine.spec.vocab_size
    ps = prompts(num_seqs, vocab)
    tables = [list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ)) for i in range(num_seqs)]
    runner.forward_chunks([ScheduledChunk(f"r{i}", p, 0, t, sample=False)
                           for i, (p, t) in enumerate(zip(ps, tables, strict=True))])
    for step in range(3):  # a few decode steps: each writes one more key per sequence
        chunks = decode_rows_first([ScheduledChunk(f"r{i}", [(5 + i * 17 + step) % vocab],
                                                   len(p) + step, t, sample=False)
                                    for i, (p, t) in enumerate(zip(ps, tables, strict=True))])
        ids, pos, batch = runner._prepare(chunks)
        assert runner.decode_loop.applies(batch, runner.kv_caches, len(ids))
        want = runner.model(ids, pos, batch, runner.kv_caches)
        loop = runner.decode_loop
        for native in (False, True):  # the Python loop, then decode_layers (C++) where it binds
            loop.native, before = native, loop.native_calls
            got = loop(ids, pos, batch, runner.kv_caches)
            assert got.dtype == want.dtype and torch.equal(got, want), (num_seqs, step, native)
            used.add(loop.native_calls > before)
    return used


def assert_native_used(used: set[bool]) -> None:
    """decode_layers ran (every linear bound to a C++ packed kernel or nn.Linear)."""
    from fitserve.kernels.cpu.decode_step import decode_step_available

    if decode_step_available():
        assert True in used


@pytest.mark.parametrize("num_threads", [1, 2], indirect=True)  # the kernels' thread splits too
def test_default_model_as_stored_bit_identical(smollm2_gguf: Path, num_threads: int) -> None:
    engine = Engine(EngineConfig(model=str(smollm2_gguf), dtype="bfloat16", device="cpu",
                                 max_model_len=128, num_kv_blocks=1 + 20 * BLOCKS_PER_SEQ,
                                 block_size=BLOCK))
    for n in (1, 3, 20):  # shape classes "m1", "m<=16", "m<=256": each binds its own kernels
        used = assert_step_identical(engine, n)
        if n == 1:
            assert_native_used(used)  # batch 1 runs cpp-aq on every ISA table


@pytest.mark.parametrize(("arch", "weights", "dtype"), [
    ("mistral", "float32", "float32"),  # sliding window 16 < the longer prompts
    ("qwen2", "int4", "bfloat16"),  # qkv bias: a biased PackedLinear runs as its module
    ("llama", "int8", "float32"),
    ("llama", "bf16", "bfloat16"),  # dense bf16: DenseLinear (the bf16 GEMV at batch 1 on AVX2)
])
def test_tiny_models_bit_identical(tiny_hf_model_dir: Callable[..., Any], arch: str,
                                   weights: str, dtype: str) -> None:
    folder: Path = tiny_hf_model_dir(arch)
    engine = Engine(EngineConfig(model=str(folder), dtype=dtype, device="cpu", weights=weights,
                                 max_model_len=128, num_kv_blocks=1 + 20 * BLOCKS_PER_SEQ,
                                 block_size=BLOCK))
    used = set().union(*(assert_step_identical(engine, n) for n in (1, 5, 20)))
    if arch == "qwen2":
        assert used == {False}  # a biased packed qkv: decode_layers does not bind it
    else:
        assert_native_used(used)  # dense nn.Linear / exact cpp kernels


@pytest.mark.parametrize(("kv_dtype", "scales"), [("int8", "channel-key"), ("fp8_e4m3", "token")])
def test_quantized_cache_bit_identical(tiny_hf_model_dir: Callable[..., Any], kv_dtype: str,
                                       scales: str) -> None:
    """A quantized KV cache read in place: the loops call the fused rotation + code writer and
    the quantized kernel where the module path calls them through llama.Attention."""
    folder: Path = tiny_hf_model_dir("llama")
    engine = Engine(EngineConfig(model=str(folder), dtype="bfloat16", device="cpu",
                                 weights="int4", max_model_len=128, block_size=BLOCK,
                                 num_kv_blocks=1 + 20 * BLOCKS_PER_SEQ,
                                 kv_cache_dtype=kv_dtype,  # type: ignore[arg-type]
                                 kv_cache_scales=scales))  # type: ignore[arg-type]
    assert engine.runner.use_kvq
    assert_native_used(set().union(*(assert_step_identical(engine, n) for n in (1, 5))))


def test_engine_greedy_tokens_identical_without_loop(tiny_hf_model_dir: Callable[..., Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    folder: Path = tiny_hf_model_dir("llama")
    cfg = dict(model=str(folder), dtype="float32", device="cpu", weights="int4",
               max_model_len=128, max_num_seqs=4)
    fast = Engine(EngineConfig(**cfg))  # type: ignore[arg-type]
    monkeypatch.setenv("FITSERVE_DECODE_LOOP", "0")
    plain = Engine(EngineConfig(**cfg))  # type: ignore[arg-type]
    assert fast.runner.decode_loop is not None and plain.runner.decode_loop is None
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(engine: Engine) -> list[list[int]]:
        ids = [engine.add_request(p, params) for p in prompts(3, engine.spec.vocab_size)]
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id].extend(o.delta_token_ids)
        return [out[rid] for rid in ids]

    want = run(plain)
    got = run(fast)
    assert fast.runner.decode_loop.calls >= 20  # the decode steps took the loop
    assert got == want


def test_decode_plans_follow_the_caches_and_are_released(tiny_hf_model_dir: Callable[..., Any]
                                                          ) -> None:
    """decode_layers reads weights and caches from a plan (an integer handle): a new cache list
    gets new plans (the K/V it writes must be the caches the step passes) and the old handles
    are gone; dropping the loop releases its plans."""
    from fitserve.kernels.cpu.decode_step import decode_step_available

    if not decode_step_available():
        pytest.skip("decode_step.cpp is not built here")
    folder: Path = tiny_hf_model_dir("llama")
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                 weights="int8", max_model_len=128,
                                 num_kv_blocks=1 + 20 * BLOCKS_PER_SEQ, block_size=BLOCK))
    assert_native_used(assert_step_identical(engine, 1))
    loop = engine.runner.decode_loop
    assert loop is not None
    old = list(loop._handles)
    assert old, "the step made no plan"
    engine.runner.kv_caches = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
    assert_native_used(assert_step_identical(engine, 1))  # same tokens, the new caches written
    assert loop._handles and not set(old) & set(loop._handles)
    x = torch.zeros(1, engine.spec.hidden_size)
    with pytest.raises(RuntimeError, match="no decode plan"):
        torch.ops.fitserve_step.decode_layers(x, x, x, x, x, x, x, old[0], 0)
    live = list(loop._handles)
    engine.runner.decode_loop = None
    del loop
    import gc

    gc.collect()
    with pytest.raises(RuntimeError, match="no decode plan"):
        torch.ops.fitserve_step.decode_layers(x, x, x, x, x, x, x, live[0], 0)
