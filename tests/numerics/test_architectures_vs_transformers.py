"""Random-weight tiny Llama-3 (llama3 rope scaling), Mistral (sliding window), Qwen2 (qkv bias,
tied embeddings) and Qwen3 (q/k norm) models: fitserve vs transformers on the same safetensors."""

from __future__ import annotations

import random

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import load_model
from fitserve.sampling import SamplingParams
from tests.gguf_vocab_files import default_hf_tokenizer

from .conftest import hf_greedy
from .tiny_models import build_tiny

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# NOTE: 40 new tokens after prompts of up to 40 pass Mistral's window (12) and Llama-3's
# original context (32) many times over; more tokens only cost time
NUM_TOKENS = 40


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    return default_hf_tokenizer(smollm2_gguf)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match(arch: str, tmp_path, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    ref_model = build_tiny(arch, tmp_path, hf_tokenizer)
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert loaded.spec.architecture == arch
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=256,
                                 num_kv_blocks=128, block_size=8, long_prefill_token_threshold=7),
                    loaded=loaded)
    rng = random.Random(arch)
    prompts = [[rng.randrange(loaded.spec.vocab_size) for _ in range(n)] for n in (1, 5, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = out
    for i, p in enumerate(prompts):
        ref_tokens, ref_lps = hf_greedy(ref_model, p, NUM_TOKENS)
        assert results[i].token_ids == ref_tokens, f"{arch} prompt {i}"
        for ours, ref in zip(results[i].logprobs, ref_lps, strict=True):
            for tok, lp in ours.top:
                assert abs(lp - float(ref[tok])) < 1e-3
