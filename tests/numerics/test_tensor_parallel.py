"""Tensor parallelism in real processes (torch.distributed, gloo): the same tokens as TP=1.

fp32 everywhere. The all-reduces sum partial products in another order than one matmul does,
so logits differ in the last bits; greedy tokens (and seeded samples) must still be identical.
Each test also checks the split really happened (ranks, heads per rank, KV replication) and
that the counters equal the planner's ledger.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fitserve.config import EngineConfig
from fitserve.dist.engine_tp import TPModelRunner
from fitserve.dist.layout import rank_spec
from fitserve.engine.core import Engine
from fitserve.ledger.kv import kv_block_bytes
from fitserve.sampling import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# n=2 on one prompt: the children fork the prompt's blocks (copy-on-write on the workers too)
SEEDED = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7 + j, ignore_eos=True)
          for j in range(2)]


def _drain(engine: Engine, ids: list[str]) -> list[list[int]]:
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def run(engine: Engine, prompts: list[str | list[int]], params: SamplingParams) -> list[list[int]]:
    return _drain(engine, [engine.add_request(p, params) for p in prompts])


def run_n(engine: Engine, prompt: str) -> list[list[int]]:
    return _drain(engine, engine.add_requests(prompt, SEEDED))


def _children(pid: int) -> list[int]:
    """This process's tensor-parallel worker children (other tests may leave other children,
    e.g. compiler pools, so only ``fitserve.dist.worker`` processes count)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if ppid == pid and b"fitserve.dist.worker" in cmd:
                out.append(int(entry))
    return out


def _engine(model: Path | str, tp: int, **kw: object) -> Engine:
    fields: dict[str, object] = dict(model=str(model), dtype="float32", device="cpu",
                                     num_kv_blocks=64, max_model_len=256,
                                     tensor_parallel_size=tp)
    fields.update(kw)
    return Engine(EngineConfig(**fields))  # type: ignore[arg-type]


def test_smollm2_tp3_as_stored_matches_tp1(smollm2_gguf: Path) -> None:
    prompts: list[str | list[int]] = ["In a distant galaxy, a small robot learned how to",
                                      "def fibonacci(n):"]
    one = _engine(smollm2_gguf, 1)
    want, want_n = run(one, prompts, GREEDY), run_n(one, "Once upon a time")
    del one
    tp = _engine(smollm2_gguf, 3)  # the Q4_1 file held packed, as stored, on 3 ranks
    try:
        assert isinstance(tp.runner, TPModelRunner)
        assert len(_children(os.getpid())) >= 2, "vacuous: no worker processes"
        # 9 query heads / 3 KV heads: one KV head per rank; the pool per rank from the ledger
        shard = rank_spec(tp.spec, 3, 0)
        assert (shard.num_heads, shard.num_kv_heads) == (3, 1)
        assert tp.pool.block_bytes == kv_block_bytes(tp.spec, 16, "f32", tp=3)
        assert run(tp, prompts, GREEDY) == want
        assert run_n(tp, "Once upon a time") == want_n
        # every collective the ledger predicts, counted in the running engine
        measured = tp.tp_group.comm.counts  # type: ignore[union-attr]
        for kind, led in tp.runner.ledger.items():
            assert (measured[kind].calls, measured[kind].bytes) == (led.calls, led.bytes), kind
        steps = measured["embedding all_reduce"].calls
        assert measured["layer all_reduce"].calls == 60 * steps  # 2 per layer per step
    finally:
        tp.shutdown()
    assert not _children(os.getpid())


@pytest.mark.parametrize(("arch", "tp", "overrides"), [
    # 4 query / 2 KV heads over 4 ranks: each KV head replicated twice; uneven vocabulary
    ("qwen3", 4, {"vocab_size": 386}),
    ("mistral", 2, {}),  # sliding window 12 < the prompt
    ("qwen2", 2, {}),  # q/k/v bias, tied embeddings
    # Gemma 3 (the conftest's: 2 layers, both sliding): the local RoPE table, (1 + w) q/k norms
    ("gemma3", 2, {}),
    ("phi3", 2, {}),  # fused checkpoint tensors split before sharding
])
def test_tiny_models_match_tp1(tiny_hf_model_dir, arch: str, tp: int,  # type: ignore[no-untyped-def]
                               overrides: dict[str, int]) -> None:
    folder = tiny_hf_model_dir(arch, **overrides)
    prompts: list[str | list[int]] = [[(7 * i + 3) % 380 for i in range(20)], [5, 9, 200, 31]]
    one = _engine(folder, 1)
    want = run(one, prompts, GREEDY)
    del one
    eng = _engine(folder, tp)
    try:
        assert run(eng, prompts, GREEDY) == want
    finally:
        eng.shutdown()


def test_layout_that_does_not_divide_fails_before_any_process(tiny_hf_model_dir) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_hf_model_dir("llama")  # 4 query heads
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by tensor_parallel_size=3"):
        _engine(folder, 3)
    assert not _children(os.getpid())


@pytest.mark.slow
def test_ggml_blocks_tp2_matches_tp1(tmp_path: Path) -> None:
    """A Q4_K_M-like file held as raw ggml blocks on 2 ranks: rows split anywhere, the
    row-parallel o_proj / down_proj columns on whole 256-weight super-blocks (Q4_K, Q5_0)."""
    from gguf import GGMLQuantizationType as Q

    from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

    case = TinyGGUF(hidden=512, ff=512, heads=4, kv_heads=2, vocab=320, std=0.1, qtype=Q.Q4_K,
                    embd_qtype=Q.Q6_K, types={"attn_v": Q.Q6_K, "ffn_down": Q.Q5_0})
    path = write_tiny_gguf(tmp_path / "k.gguf", case)
    prompts: list[str | list[int]] = [[5, 9, 200, 31], [(7 * i + 3) % 300 for i in range(20)]]
    one = _engine(path, 1)
    want = run(one, prompts, GREEDY)
    del one
    eng = _engine(path, 2)
    try:
        assert run(eng, prompts, GREEDY) == want
    finally:
        eng.shutdown()
