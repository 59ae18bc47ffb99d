"""One request gives the same greedy tokens whatever happens around it (fp32, real SmolLM2).

Each test also checks it is not vacuous: a different prompt gives different tokens, and the
condition under test really happened (chunks were split, blocks preempted, requests aborted).
The weights are the Q4_1 file held as stored (packed int4/int8 kernels), the engine's default.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve.engine.core import Engine
from fitserve.engine.llm import LLM
from fitserve.loading import LoadedModel, load_model
from fitserve.sampling import SamplingParams


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2_gguf: Path) -> LoadedModel:
    """Overrides conftest's dense fp32 weights: this suite runs Q4_1 held as stored."""
    return load_model(smollm2_gguf, dtype=torch.float32, weights="as-stored")

TARGET = "In a distant galaxy, a small robot learned how to"
OTHER = "Recipe for pancakes: first,"
FILLERS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "1, 2, 3, 4,",
    "Translate to French: good morning",
    "Why is the sky blue? Explain in detail, step by step, with physics.",
    "a",
    "import numpy as np\nx = np.arange(10)\n",
    "Dear diary, today",
    "Summarize: " + "The meeting covered budgets, hiring and the roadmap. " * 4,
    "Q: What is 17 times 23?\nA:",
    "Roses are red,",
    "def quicksort(xs):",
    "The three laws of robotics are",
    "Once",
    "Weather report for Tuesday:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def run_all(engine: Engine, prompts: list[str], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    ids = {engine.add_request(p, params, request_id=f"r{i}"): p for i, p in enumerate(prompts)}
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
    return done


@pytest.fixture(scope="module")
def alone_tokens(smollm2_loaded) -> list[int]:  # type: ignore[no-untyped-def]
    from fitserve.config import EngineConfig

    engine = Engine(EngineConfig(model=str(smollm2_loaded.path), dtype="float32", device="cpu",
                                 max_model_len=1024, num_kv_blocks=256), loaded=smollm2_loaded)
    tokens = run_all(engine, [TARGET])[TARGET]
    other = run_all(engine, [OTHER])[OTHER]
    assert tokens != other, "vacuous: a different prompt gives the same tokens"
    assert len(tokens) == 32
    return tokens


@pytest.mark.slow
def test_inside_a_batch_of_16(make_engine, alone_tokens) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    out = run_all(engine, FILLERS[:8] + [TARGET] + FILLERS[8:])
    assert len(out) == 16
    assert out[TARGET] == alone_tokens
    assert engine.kv.stats().used_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunk_sizes(make_engine, alone_tokens, chunk) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(long_prefill_token_threshold=chunk, max_num_batched_tokens=max(chunk, 16))
    prompts = [TARGET, FILLERS[1], FILLERS[8], "The quick brown fox jumps over the lazy dog. " * 12]
    seen_partial = False
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, request_id=f"r{i}")
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        plan_preview = engine.scheduler
        outs = engine.step()
        seen_partial |= any(r.num_computed_tokens < len(r.prompt_token_ids) for r in plan_preview.running)
        for out in outs:
            if out.finished:
                tokens[out.request_id] = out.token_ids
    assert tokens["r0"] == alone_tokens
    assert seen_partial, "vacuous: no prompt was ever split into chunks"


@pytest.mark.slow
def test_pool_small_enough_to_preempt(make_engine, alone_tokens) -> None:  # type: ignore[no-untyped-def]
    # 8 requests of ~20-70 tokens + 32 new each need ~45 blocks of 16 at once; 16 hold 256
    # tokens (one max_model_len request, as the engine requires), so some must be preempted.
    engine = make_engine(num_kv_blocks=16, max_model_len=256)
    out = run_all(engine, [TARGET] + FILLERS[:7])
    assert engine.scheduler.total_preemptions > 0, "vacuous: nothing was preempted"
    assert out[TARGET] == alone_tokens
    assert engine.kv.stats().used_blocks == 0


@pytest.mark.slow
def test_while_others_abort(make_engine, alone_tokens) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    engine.add_request(TARGET, GREEDY, request_id="target")
    for i, p in enumerate(FILLERS[:6]):
        engine.add_request(p, GREEDY, request_id=f"f{i}")
    aborted = 0
    step = 0
    result = None
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.request_id == "target" and out.finished:
                result = out.token_ids
        if step % 5 == 0 and aborted < 6:
            assert engine.abort(f"f{aborted}")
            aborted += 1
            engine.add_request(FILLERS[6 + aborted], GREEDY, request_id=f"late{aborted}")
    assert aborted == 6
    assert result == alone_tokens
    assert engine.kv.stats().used_blocks == 0


@pytest.mark.slow
def test_streamed_equals_returned(make_engine, alone_tokens) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    deltas: list[int] = []
    text = ""
    last = None
    for out in engine.stream(TARGET, GREEDY):
        deltas.extend(out.delta_token_ids)
        text += out.delta_text
        last = out
    assert last is not None and last.finished
    assert deltas == alone_tokens == last.token_ids
    assert text == last.text == engine.tokenizer.decode(alone_tokens)


@pytest.mark.slow
def test_seeded_sampling_is_batch_invariant(make_engine) -> None:  # type: ignore[no-untyped-def]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=32, seed=1234, ignore_eos=True)
    alone = run_all(make_engine(), [TARGET], seeded)[TARGET]
    batched = run_all(make_engine(), FILLERS[:5] + [TARGET] + FILLERS[5:10], seeded)[TARGET]
    assert alone == batched
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=32, seed=99, ignore_eos=True)
    assert run_all(make_engine(), [TARGET], other_seed)[TARGET] != alone, "vacuous: seed has no effect"


def test_llm_generate_api(smollm2_loaded) -> None:  # type: ignore[no-untyped-def]
    llm = LLM.__new__(LLM)
    from fitserve.config import EngineConfig

    llm.engine = Engine(EngineConfig(model=str(smollm2_loaded.path), dtype="float32", device="cpu",
                                     max_model_len=512, num_kv_blocks=64), loaded=smollm2_loaded)
    llm.tokenizer = llm.engine.tokenizer
    res = llm.generate(["Hi there", "The sun"], SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, n=2))
    assert [len(r.outputs) for r in res] == [2, 2]
    for r in res:
        assert r.outputs[0].token_ids == r.outputs[1].token_ids  # greedy: n copies agree
        assert r.outputs[0].finish_reason in ("length", "stop")
        assert r.outputs[0].logprobs is not None and len(r.outputs[0].logprobs[0].top) == 2
        assert r.text == llm.tokenizer.decode(r.token_ids)


# -- the default model as it ships: bf16 activations, Q4_1 as stored (int8-quantized activations)
# the second prompt spans full KV blocks, so the batch below reuses its cached prefix
BF16_PROMPTS = [TARGET, FILLERS[8] + "In short,"]


def test_bf16_default_path_is_batch_invariant(smollm2_gguf: Path) -> None:
    """Each prompt alone == inside a batch of 16 over a warm prefix cache == chunked prefill
    (7-token chunks) with n-gram speculative decoding, token for token. Before the canonical
    integer order and the per-row prefill attention, 3 of 4 prompts diverged within 48 tokens
    in a batch of 16, and chunked / speculative runs diverged from the prompt alone."""
    from fitserve.config import EngineConfig

    loaded = load_model(smollm2_gguf, dtype=torch.bfloat16, weights="as-stored")

    def make(**kwargs: object) -> Engine:
        fields: dict[str, object] = {"model": str(loaded.path), "dtype": "bfloat16",
                                     "device": "cpu", "max_model_len": 512, "num_kv_blocks": 96}
        return Engine(EngineConfig(**{**fields, **kwargs}), loaded=loaded)  # type: ignore[arg-type]

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    cached = make(enable_prefix_caching=True)
    alone = {p: run_all(cached, [p], params)[p] for p in BF16_PROMPTS}  # cold cache
    assert alone[BF16_PROMPTS[0]] != alone[BF16_PROMPTS[1]], "vacuous: equal outputs"
    hits_before = cached.kv.prefix_cache_hits
    batch = run_all(cached, FILLERS[:7] + BF16_PROMPTS + FILLERS[7:14], params)
    assert len(batch) == 16
    assert cached.kv.prefix_cache_hits > hits_before, "vacuous: no prefix-cache hit"
    spec = make(enable_prefix_caching=False, long_prefill_token_threshold=7,
                max_num_batched_tokens=16, speculative_config={
                    "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1})
    chunked_spec = run_all(spec, BF16_PROMPTS, params)
    for name, got in (("batch of 16, prefix-cached", batch),
                      ("chunked + ngram speculative", chunked_spec)):
        diverged = [p[:20] for p in BF16_PROMPTS if got[p] != alone[p]]
        assert not diverged, f"{name}: {diverged} differ from the prompt run alone"
