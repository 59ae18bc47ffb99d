"""SmolLM2-135M (real Q4_1 weights, dequantized to fp32): fitserve vs transformers, token for token."""

from __future__ import annotations

import pytest

from fitserve.sampling import SamplingParams

from .conftest import hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "List three prime numbers and explain why each one is prime:",
]
CHATS = [
    [{"role": "user", "content": "What is the boiling point of water in Fahrenheit?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, and tell me a story about it."},
    ],
]
NUM_TOKENS = 64
# NOTE: tolerance for logprobs. Both sides run fp32 over the same dequantized weights but sum in
# different orders (fused qkv, paged attention vs transformers' SDPA over a dense cache). Those
# differences are ~1e-6 relative per op and grow through 30 layers; the largest gap measured on
# these prompts is ~1e-4 nats. 2e-3 nats is far below what a wrong mask, position or head
# mapping produces (>0.1 nats), so the check still has teeth.
LOGPROB_TOL = 2e-3


def _prompt_ids(tok, prompt) -> list[int]:  # type: ignore[no-untyped-def]
    if isinstance(prompt, str):
        return tok.encode(prompt)
    return tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True), add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS + CHATS, ids=lambda p: str(p)[:24])
def test_greedy_tokens_and_top5_logprobs_match(make_engine, hf_smollm2, prompt) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    ids = _prompt_ids(engine.tokenizer, prompt)
    ref_tokens, ref_logprobs = hf_greedy(hf_smollm2, ids, NUM_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    out = list(engine.stream(ids, params))[-1]
    assert out.token_ids == ref_tokens
    assert out.logprobs is not None and len(out.logprobs) == NUM_TOKENS
    for step, (ours, ref) in enumerate(zip(out.logprobs, ref_logprobs, strict=True)):
        assert ours.rank == 1, f"step {step}: greedy token should be rank 1"
        assert len(ours.top) == 5
        assert ours.top[0][0] == ref_tokens[step]
        for token_id, lp in ours.top:
            assert abs(lp - float(ref[token_id])) < LOGPROB_TOL, (step, token_id)
        # the top-5 sets agree (allowing a swap at rank 5 only for a near tie)
        ref_top = ref.topk(5).indices.tolist()
        assert ours.top[0][0] == ref_top[0]
        for token_id in set(ref_top) ^ {t for t, _ in ours.top}:
            assert abs(float(ref[token_id]) - float(ref[ref_top[4]])) < LOGPROB_TOL


def test_chat_template_prompt_is_rendered(make_engine) -> None:  # type: ignore[no-untyped-def]
    tok = make_engine().tokenizer
    text = tok.apply_chat_template(CHATS[0], add_generation_prompt=True)
    assert "boiling point" in text and text.rstrip().endswith("assistant")
