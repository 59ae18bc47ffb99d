"""The flat decode loop (fitserve.runner.decode_loop) against the module path it replaces: the same
decode step through ``CausalLM.forward`` and through ``DecodeLoop`` must give bit-identical
hidden states (same ops, same order), on ragged batches of every shape class, for the default
model as stored (Q4_1 + Q8_0, bf16 activations), for tiny models with a qkv bias (packed and
fp8), fp8 weights, a sliding window, and a Q4_K_M-like GGUF mix whose qkv is a ConcatLinear of
two ggml types; and an engine with the loop must generate the same greedy tokens as one with
FITSERVE_DECODE_LOOP=0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.kernels.cpu.paged_attention import paged_attention_available
from fitserve.model.fp8_linear import Fp8Linear
from fitserve.model.ggml_linear import GgmlLinear
from fitserve.model.linear import ConcatLinear
from fitserve.runner.model_runner import decode_rows_first
from fitserve.sampling import SamplingParams
from fitserve.types import ScheduledChunk
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

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
    ("qwen2", "int4", "bfloat16"),  # qkv bias: the packed op, then the module's `y + bias`
    ("qwen2", "fp8", "bfloat16"),  # fp8 weights, the qkv bias inside the fp8 op
    ("llama", "int8", "float32"),
    ("llama", "bf16", "bfloat16"),  # dense bf16: DenseLinear (the bf16 GEMV at batch 1 on AVX2)
])
def test_tiny_models_bit_identical(tiny_hf_model_dir: Callable[..., Any], arch: str,
                                   weights: str, dtype: str) -> None:
    folder: Path = tiny_hf_model_dir(arch)
    engine = Engine(EngineConfig(model=str(folder), dtype=dtype, device="cpu", weights=weights,
                                 max_model_len=128, num_kv_blocks=1 + 20 * BLOCKS_PER_SEQ,
                                 block_size=BLOCK))
    if weights == "fp8":
        assert any(isinstance(m, Fp8Linear) for m in engine.runner.model.modules())
    for n in (1, 5, 20):
        used = assert_step_identical(engine, n)
        if n == 1:  # every kind at batch 1 (fp8 past 64 rows dequantizes: the module there)
            assert_native_used(used)


def test_ggml_mix_with_concat_qkv_and_bias_bit_identical(tmp_path: Path) -> None:
    """A Q4_K_M-like file (attn_v Q6_K beside Q4_K q/k: a ConcatLinear qkv of two ggml types;
    Q5_K up beside Q4_K gate; IQ4_XS o_proj, Q5_0 down) with Qwen2's qkv bias, bf16: every
    linear a ggml kernel inside decode_layers at batch 1."""
    case = TinyGGUF(arch="qwen2", qkv_bias=True, hidden=256, ff=512, heads=4, kv_heads=2,
                    vocab=320, std=0.15, qtype=Q.Q4_K, embd_qtype=Q.Q6_K, tied=True,
                    types={"attn_v": Q.Q6_K, "attn_output": Q.IQ4_XS, "ffn_up": Q.Q5_K,
                           "ffn_down": Q.Q5_0})
    path = write_tiny_gguf(tmp_path / "m.gguf", case)
    engine = Engine(EngineConfig(model=str(path), dtype="bfloat16", device="cpu",
                                 max_model_len=128, num_kv_blocks=1 + 20 * BLOCKS_PER_SEQ,
                                 block_size=BLOCK))
    layer = engine.runner.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, ConcatLinear)
    assert [p.ggml_type for p in qkv.parts if isinstance(p, GgmlLinear)][-1] == "Q6_K"
    assert all(p.bias is not None for p in qkv.parts)
    assert isinstance(layer.mlp.gate_up_proj, ConcatLinear)
    assert {m.ggml_type for m in engine.runner.model.modules() if isinstance(m, GgmlLinear)} \
        >= {"Q4_K", "Q6_K", "Q5_K", "IQ4_XS", "Q5_0"}
    for n in (1, 3, 20):
        used = assert_step_identical(engine, n)
        assert_native_used(used)  # the ggml kernels run for every row count of bf16 x


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


def test_decode_plan_rejects_malformed_linear_lists() -> None:
    """decode_plan's flat linear lists (decode_step.cpp's layout) are checked, with errors that
    say what is wrong: a part cut short, tensors left over, the wrong number of linears."""
    from fitserve.kernels.cpu.decode_step import decode_step_available
    from fitserve.runner.decode_loop import native_linear

    if not decode_step_available():
        pytest.skip("decode_step.cpp is not built here")
    lin = torch.nn.Linear(8, 8)
    tensors, meta = native_linear(lin, 1, torch.float32) or ([], [])
    w, cache = torch.ones(8), torch.zeros(2, 16, 1, 8)
    plan = torch.ops.fitserve_step.decode_plan

    def make(ts: list[torch.Tensor], ms: list[int]) -> int:
        return int(plan([w, w], [1e-5, 1e-5], ts, ms, [cache], [cache], 1, 1, 8, 1.0, 16, False,
                        [], [], -1, False))

    with pytest.raises(RuntimeError, match="meta ends inside a linear"):
        make(tensors * 4, (meta * 4)[:-1])
    with pytest.raises(RuntimeError, match="tensors left unused"):
        make(tensors * 5, meta * 4)
    with pytest.raises(RuntimeError, match="4 linears per layer, got 3"):
        make(tensors * 3, meta * 3)
    torch.ops.fitserve_step.drop_decode_plan(make(tensors * 4, meta * 4))  # well formed
