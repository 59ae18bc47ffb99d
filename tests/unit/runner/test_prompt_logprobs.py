"""The runner's prompt logprobs (fitserve.runner.prompt_logprobs): which packed rows score which
prompt tokens, the values vs a float64 log-softmax of the whole [T, V] logits, and the bytes a
chunk allocates vs the ledger (fitserve.ledger.sampler_memory.prompt_logprobs_bytes)."""

from __future__ import annotations

import pytest
import torch

from fitserve.ledger.sampler_memory import (
    prompt_logprob_chunk_rows,
    prompt_logprobs_bytes,
    sampler_bytes,
)
from fitserve.runner.prompt_logprobs import PromptSpan, compute_prompt_logprobs, prompt_spans
from fitserve.sampling import RequestSamplingState, SamplingParams
from fitserve.types import ScheduledChunk
from tests.memory_events import peak_extra

PROMPT = [10, 11, 12, 13, 14, 15, 16]


def state(prompt_logprobs: int | None, prompt: list[int] = PROMPT) -> RequestSamplingState:
    return RequestSamplingState(SamplingParams(prompt_logprobs=prompt_logprobs), prompt, [])


def chunk(rid: str, tokens: list[int], start: int) -> ScheduledChunk:
    return ScheduledChunk(request_id=rid, token_ids=tokens, start_pos=start, block_table=[0], sample=False)


def test_spans_follow_the_packed_rows() -> None:
    # packed: d (1 decode row), a positions 0..4, b positions 5..6 (+ its first output token's
    # row at 7 after a preemption recompute), p (no prompt logprobs)
    chunks = [chunk("d", [16], 9), chunk("a", PROMPT[:5], 0), chunk("b", PROMPT[5:] + [99], 5),
              chunk("p", PROMPT[:3], 0)]
    states = {"d": state(2), "a": state(2), "b": state(1), "p": state(None)}
    assert prompt_spans(chunks, states) == [
        PromptSpan("a", 1, 1, PROMPT[1:6], 2),  # positions 0..4 score tokens 1..5
        PromptSpan("b", 6, 6, PROMPT[6:], 1),  # position 5 scores token 6; 6 and 7 score outputs
    ]
    assert prompt_spans([chunk("a", [10], 0)], {"a": state(2, [10])}) == []  # a 1-token prompt


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_values_equal_a_float64_log_softmax(rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=g)
    head = torch.randn(50, 16, generator=g)
    spans = [PromptSpan("a", 1, 1, [3, 7, 7, 0], 3), PromptSpan("b", 6, 4, [49, 1], 0)]
    got = compute_prompt_logprobs(lambda h: (h @ head.T).float(), hidden, spans, rows)
    ref = torch.log_softmax((hidden.double() @ head.double().T), dim=-1)
    for s in spans:
        first, entries = got[s.request_id]
        assert first == s.first_index and len(entries) == len(s.targets)
        for i, (tok, e) in enumerate(zip(s.targets, entries, strict=True)):
            row = ref[s.first_row + i]
            assert e.token_id == tok and abs(e.logprob - row[tok].item()) < 1e-5
            assert e.rank == int((row > row[tok]).sum()) + 1
            assert [t for t, _ in e.top] == row.topk(s.num_top).indices.tolist()


def test_a_chunk_allocates_what_the_ledger_counts() -> None:
    vocab, hidden_size, rows = 8192, 64, 6
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, hidden_size, generator=g)
    head = torch.randn(vocab, hidden_size, generator=g)
    spans = [PromptSpan("a", 0, 1, list(range(39)), 5)]

    def run() -> object:
        return compute_prompt_logprobs(lambda h: h @ head.T, hidden, spans, rows)

    run()
    measured = peak_extra(run)
    formula = prompt_logprobs_bytes(vocab, rows)
    # slack: the [rows] index tensors, the [rows, 5] top-k, the [rows, H] hidden rows
    assert formula <= measured <= formula + 64 * 1024, (measured, formula)


@pytest.mark.parametrize("vocab,seqs", [(49152, 1), (49152, 8), (49152, 256), (262_144, 4), (151_936, 64)])
def test_a_chunk_fits_in_the_logits_and_sampler_lines(vocab: int, seqs: int) -> None:
    rows = prompt_logprob_chunk_rows(vocab, seqs)
    assert 1 <= rows <= seqs
    assert prompt_logprobs_bytes(vocab, rows) <= seqs * vocab * 4 + sampler_bytes(vocab, seqs)
