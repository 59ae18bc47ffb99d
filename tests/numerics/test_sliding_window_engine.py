"""Windowed layers free their blocks in a real engine, and greedy tokens still equal
transformers: Mistral (every layer on a 12-token window) and a hybrid Qwen2 (layer 0 full,
layers 1-2 windowed: two KV layer groups), prompts longer than the window, chunk 7, block 4."""

from __future__ import annotations

import random

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.kv.group import NULL_BLOCK
from fitserve.ledger.kv import window_blocks_held
from fitserve.loading import load_model
from fitserve.sampling import SamplingParams
from tests.gguf_vocab_files import default_hf_tokenizer

from .conftest import hf_greedy
from .tiny_models import build_tiny

NUM_TOKENS = 32
WINDOW = 12
BS = 4
HYBRID = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
              layer_types=["full_attention", "sliding_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    return default_hf_tokenizer(smollm2_gguf)


def _engine(folder, num_kv_blocks: int = 96, max_model_len: int = 256):  # type: ignore[no-untyped-def]
    loaded = load_model(folder, dtype=torch.float32)
    cfg = EngineConfig(model=str(folder), dtype="float32", device="cpu", max_model_len=max_model_len,
                       num_kv_blocks=num_kv_blocks, block_size=BS, long_prefill_token_threshold=7)
    return Engine(cfg, loaded=loaded), loaded.spec


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "qwen2-hybrid"])
def test_windowed_engine_frees_blocks_and_matches_transformers(arch: str, tmp_path, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    overrides = HYBRID if arch == "qwen2-hybrid" else {}
    ref = build_tiny(arch.split("-")[0], tmp_path, hf_tokenizer, **overrides)
    engine, spec = _engine(tmp_path)
    kinds = [g.group.kind for g in engine.kv.groups]
    assert kinds == (["full", "sliding"] if overrides else ["sliding"])
    windowed = len(kinds) - 1
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    # one request alone: after every step its windowed table holds exactly the ledger's blocks
    prompt = [random.Random(arch).randrange(spec.vocab_size) for _ in range(30)]
    engine.add_request(prompt, params, request_id="solo")
    done, tokens, freed_seen = 0, [], False
    while engine.has_unfinished_requests():
        outs = engine.step()
        req = engine.scheduler.get("solo")
        if req is not None:
            computed = req.num_computed_tokens
            held = engine.kv.stats().group_used_blocks or (engine.kv.stats().used_blocks,)
            assert held[windowed] == window_blocks_held(BS, done, computed, WINDOW)
            if windowed:
                assert held[0] == -(-computed // BS)  # the full group keeps every block
            table = engine.kv.block_tables("solo")[windowed]
            freed_seen |= NULL_BLOCK in table
            done = computed
        for o in outs:
            if o.finished:
                tokens = o.token_ids
    assert freed_seen
    assert tokens == hf_greedy(ref, prompt, NUM_TOKENS)[0]
    assert engine.kv.stats().used_blocks == 0

    # a batch, with prefix sharing, in a pool small enough to preempt
    engine, spec = _engine(tmp_path, num_kv_blocks=24, max_model_len=80)
    rng = random.Random(arch + "batch")
    head = [rng.randrange(spec.vocab_size) for _ in range(20)]
    prompts = [head + [rng.randrange(spec.vocab_size) for _ in range(n)] for n in (3, 9, 17, 25)]
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    results = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                results[int(o.request_id)] = o.token_ids
    for i, p in enumerate(prompts):
        assert results[i] == hf_greedy(ref, p, NUM_TOKENS)[0], f"{arch} prompt {i}"
    st = engine.kv.stats()
    assert st.used_blocks == 0 and st.prefix_cache_hits > 0
    assert engine.scheduler.total_preemptions > 0
