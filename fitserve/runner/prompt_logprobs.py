"""Prompt logprobs (vLLM's ``prompt_logprobs``), read off the prefill that computes the prompt.

A step's tokens are packed (decode-like chunks first); a chunk at ``start_pos`` s with t tokens
owns t rows, for positions s .. s+t-1, and the row of position p scores the token at p + 1::

    prompt      t0 t1 t2 t3 t4 t5 t6        (7 tokens, chunked prefill: 5 then 2)
    chunk 1     rows of positions 0..4 -> logprobs of t1 t2 t3 t4 t5
    chunk 2     rows of positions 5..6 -> logprobs of t6 (position 6's row scores the first
                                          generated token: that one is sampled, not scored here)

t0 has no logprob (``RequestOutput.prompt_logprobs[0]`` is None). The logprobs are the raw
logits' fp32 log-softmax over the whole vocabulary (vLLM's default ``raw_logprobs``: before
temperature, penalties or bias), computed ``chunk_rows`` rows at a time and kept only as the
scored token's logprob, its rank and the top N (``fitserve.ledger.sampler_memory.
prompt_logprobs_bytes`` counts a chunk's buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from fitserve.sampling import RequestSamplingState
from fitserve.sampling.filters import chunk_logprobs
from fitserve.types import ScheduledChunk, TokenLogprobs


@dataclass(slots=True)
class PromptSpan:
    """The rows of one chunk that score prompt tokens."""

    request_id: str
    first_row: int  # packed row of the chunk's first scoring position
    first_index: int  # prompt index of the first token scored (start_pos + 1)
    targets: list[int]  # the prompt tokens scored, in order
    num_top: int  # alternatives to keep per token


def prompt_spans(chunks: list[ScheduledChunk],
                 states: Mapping[str, RequestSamplingState]) -> list[PromptSpan]:
    """The spans of ``chunks`` (in packed order) whose requests ask for prompt logprobs.

    A recomputed chunk (after preemption) scores the same prompt tokens again: the engine
    stores them by prompt index, so they are written twice with the same values."""
    spans: list[PromptSpan] = []
    offset = 0
    for chunk in chunks:
        state = states.get(chunk.request_id)
        num = None if state is None else state.num_prompt_logprobs
        t = len(chunk.token_ids)
        if state is not None and num is not None and not chunk.num_draft:
            prompt = state.prompt_token_ids
            end = min(chunk.start_pos + t, len(prompt) - 1)  # positions p < end score prompt[p + 1]
            if end > chunk.start_pos:
                spans.append(PromptSpan(chunk.request_id, offset, chunk.start_pos + 1,
                                        prompt[chunk.start_pos + 1: end + 1], num))
        offset += t
    return spans


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
    spans: list[PromptSpan], chunk_rows: int,
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """request id -> (prompt index of the first token scored, each scored token's logprobs),
    from the step's final hidden states ``hidden`` [tokens, H], ``chunk_rows`` rows at a time."""
    rows = [s.first_row + i for s in spans for i in range(len(s.targets))]
    targets = [tok for s in spans for tok in s.targets]
    nums: list[int | None] = [s.num_top for s in spans for _ in s.targets]
    top_n = max(s.num_top for s in spans)
    entries: list[TokenLogprobs | None] = []
    for a in range(0, len(rows), chunk_rows):
        index = torch.tensor(rows[a: a + chunk_rows], dtype=torch.long, device=hidden.device)
        logits = compute_logits(hidden.index_select(0, index))
        chosen = torch.tensor(targets[a: a + chunk_rows], dtype=torch.long, device=hidden.device)
        entries += chunk_logprobs(logits, chosen, nums[a: a + chunk_rows], top_n)
        del logits
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    at = 0
    for s in spans:
        got = [e for e in entries[at: at + len(s.targets)] if e is not None]
        at += len(s.targets)
        out[s.request_id] = (s.first_index, got)  # a request has one chunk per step
    return out
