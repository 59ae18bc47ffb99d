"""The engine on a quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2).

- Plumbing against the plain algorithm: with per-token scales, the engine's logits equal those
  of the dense cache whose writes are quantized and dequantized on the way in (the same values
  through a path with no compact cache, no remapped block tables, no codes), for one-shot
  prefill, chunked prefill and one-token (decode) chunks.
- Prefix caching and copy-on-write (n > 1) change no output on a quantized cache.
- The pool: for a fixed KV memory budget the engine's block count is the ledger's
  (budget // kv_block_bytes), the runner holds exactly blocks x block bytes, and it is more
  blocks than bf16 by the ratio of the formats' block bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.ledger.kv import kv_block_bytes
from fitserve.loading import LoadedModel, load_model
from fitserve.model import llama as llama_mod
from fitserve.model.loader import build_model
from fitserve.quant.kv_cache import CODECS
from fitserve.runner.teacher_forcing import score_logits
from fitserve.sampling import SamplingParams
from tests.gguf_vocab_files import default_hf_tokenizer

from .test_prefix_caching import check_on_equals_off
from .tiny_models import build_tiny


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> LoadedModel:
    pytest.importorskip("transformers")
    tok = default_hf_tokenizer(smollm2_gguf)
    folder = tmp_path_factory.mktemp("tiny-llama-kvq")
    build_tiny("llama", folder, tok)
    return load_model(folder, dtype=torch.float32)


def _fake_quant_per_token(x: torch.Tensor, codec: str) -> torch.Tensor:
    c = CODECS[codec]
    scale = x.float().abs().amax(-1, keepdim=True) / c.qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (c.decode(c.encode(x.float() / safe)) * scale).to(x.dtype)


# one-shot prefill (64), chunked prefill over cached blocks (7), one-token decode chunks (1)
@pytest.mark.parametrize(("codec", "chunk"), [("int8", 64), ("int8", 1), ("fp8_e4m3", 7),
                                              ("fp8_e5m2", 7)])
def test_per_token_cache_equals_quantize_on_write(tiny_llama: LoadedModel, codec: str,
                                                  chunk: int, monkeypatch: Any) -> None:
    spec = tiny_llama.spec
    model = build_model(spec, tiny_llama.weights, dtype=torch.float32, device="cpu",
                        max_positions=128)
    ids = [int(t) for t in torch.randint(3, spec.vocab_size, (40,),
                                         generator=torch.Generator().manual_seed(3))]
    got = score_logits(model, spec, ids, chunk_size=chunk, kv_cache_dtype=codec,
                       kv_cache_scales="token")
    dense = score_logits(model, spec, ids, chunk_size=chunk)
    real_write = llama_mod.write_kv

    def write_quantized(k: torch.Tensor, v: torch.Tensor, *rest: Any) -> None:
        real_write(_fake_quant_per_token(k, codec), _fake_quant_per_token(v, codec), *rest)

    monkeypatch.setattr(llama_mod, "write_kv", write_quantized)
    monkeypatch.setattr(llama_mod.fused, "rope_write_kv_", lambda *a, **k: False)
    # the patched write is the module path's: single-token chunks must not take the decode loop
    monkeypatch.setenv("FITSERVE_DECODE_LOOP", "0")
    want = score_logits(model, spec, ids, chunk_size=chunk)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - dense).abs().max() > 1e-4, "vacuous: quantization changed nothing"


@pytest.mark.parametrize("kv", [("int8", "token"), ("fp8_e4m3", "token"), ("int8", "channel-key")])
def test_prefix_caching_and_fork_on_a_quantized_cache(tiny_llama: LoadedModel,
                                                      kv: tuple[str, str]) -> None:
    """Caching on = off (the workload of test_prefix_caching), and n=2 greedy children equal
    the n=1 output. With per-channel key scales a block's scale depends on how its tokens were
    chunked, so the cached block can differ from a recomputed one by a rounding: there only
    the run itself is checked (no divergence from its own n=1)."""
    kw = {"kv_cache_dtype": kv[0], "kv_cache_scales": kv[1]}
    if kv[1] == "token":
        check_on_equals_off(tiny_llama, **kw)
    eng = Engine(EngineConfig(model=str(tiny_llama.path), dtype="float32", device="cpu",
                              max_model_len=160, num_kv_blocks=64, block_size=8, **kw),
                 loaded=tiny_llama)
    prompt = list(range(5, 26))  # 21 tokens: the children copy the partial block on write
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    one = _run(eng, prompt, [greedy])
    two = _run(eng, prompt, [greedy, greedy])
    assert two == one * 2
    assert eng.kv.stats().used_blocks == 0


def _run(eng: Engine, prompt: list[int], params: list[SamplingParams]) -> list[list[int]]:
    rids = eng.add_requests(prompt, params)
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.error is None
            if out.finished:
                outs[out.request_id] = list(out.token_ids or [])
    return [outs[r] for r in rids]


@pytest.mark.parametrize("kv", [("auto", "auto"), ("int8", "token"), ("int8", "channel-key"),
                                ("fp8_e5m2", "token"), ("fp8", "channel-key")])
def test_blocks_for_a_budget_are_the_ledgers(tiny_llama: LoadedModel, kv: tuple[str, str]) -> None:
    budget = 3 << 20
    eng = Engine(EngineConfig(model=str(tiny_llama.path), dtype="bfloat16", device="cpu",
                              max_model_len=160, kv_cache_memory_bytes=budget, block_size=16,
                              kv_cache_dtype=kv[0], kv_cache_scales=kv[1]), loaded=tiny_llama)
    fmt = eng.runner.kv_format
    block = kv_block_bytes(eng.spec, 16, fmt)
    assert eng.pool.num_blocks == budget // block
    assert eng.runner.kv_cache_bytes == eng.pool.num_blocks * block
    bf16_blocks = budget // kv_block_bytes(eng.spec, 16, "bf16")
    if kv[0] != "auto":
        # head_dim 16: 2 B/elt -> 1 B + scales; per-token: 2x16x2 / (2x16 + 8) = 1.6x
        assert eng.pool.num_blocks > 1.3 * bf16_blocks
    assert len(_run(eng, list(range(5, 30)), [SamplingParams(temperature=0.0, max_tokens=4)])[0]) == 4


@pytest.mark.parametrize("kv", [("int8", "channel-key"), ("fp8_e4m3", "token")])
def test_preemption_on_a_quantized_cache_returns_every_block(tiny_llama: LoadedModel,
                                                             kv: tuple[str, str]) -> None:
    """A pool too small for the batch: requests are preempted and recomputed while the decode
    steps run on the flat loop's fused writer + quantized kernel; every one finishes with its
    tokens and every block comes back."""
    eng = Engine(EngineConfig(model=str(tiny_llama.path), dtype="float32", device="cpu",
                              max_model_len=64, num_kv_blocks=10, block_size=8,
                              kv_cache_dtype=kv[0], kv_cache_scales=kv[1]),  # type: ignore[arg-type]
                 loaded=tiny_llama)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = [_run(eng, list(range(5 + i, 25 + i)), [greedy])[0] for i in range(2)]  # alone
    batch = [list(range(5 + i, 25 + i)) for i in range(4)]
    rids = [eng.add_request(p, greedy) for p in batch]
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.error is None
            if out.finished:
                got[out.request_id] = list(out.token_ids or [])
    assert eng.scheduler.total_preemptions > 0, "vacuous: nothing was preempted"
    assert eng.runner.decode_loop is not None and eng.runner.decode_loop.calls > 0
    assert all(len(got[r]) == 16 for r in rids)
    if kv[1] == "token":  # per-token codes do not depend on how a block was chunked
        assert [got[r] for r in rids[:2]] == outs
    assert eng.kv.stats().used_blocks == 0
