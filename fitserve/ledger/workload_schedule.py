"""The steps fitserve's scheduler runs for an offline batch, as counts (no torch, no timing).

``batch`` requests of ``input_len`` prompt tokens and ``output_len`` new tokens, all added at
once (bench_engine's W2, vllm bench throughput's shape). Each step spends one token budget
(``max_num_batched_tokens``) over at most ``max_num_seqs`` requests: the running requests
first (one decode token each), then prompt chunks in arrival order, the last chunk of a
prompt sampling that request's first token (fitserve.sched: no prefill or decode phase)::

    32 x 128 prompts, budget 2048:  step 1   16 prompts whole            (16 sampled)
                                    step 2   16 decodes + 15 prompts + 112 tokens of the 32nd
                                    step 3   31 decodes + the 32nd's last 16 tokens
                                    ...      decodes, the first 16 finishing a step earlier
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.ledger.errors import PlanError


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """One step: the decoding requests' contexts (tokens cached before this one, + 1 read),
    the prompt chunks as (start, tokens), and how many requests sample a token."""

    decode_contexts: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    sampled: int

    @property
    def new_tokens(self) -> int:
        return len(self.decode_contexts) + sum(n for _s, n in self.chunks)

    @property
    def seqs(self) -> int:
        return len(self.decode_contexts) + len(self.chunks)


def workload_schedule(*, batch: int, input_len: int, output_len: int,
                      max_num_batched_tokens: int, max_num_seqs: int) -> list[ScheduledStep]:
    """Every step of the workload in order (see the module doc). PlanError for counts < 1."""
    for flag, n in (("batch", batch), ("input_len", input_len), ("output_len", output_len),
                    ("max_num_batched_tokens", max_num_batched_tokens),
                    ("max_num_seqs", max_num_seqs)):
        if n < 1:
            raise PlanError(f"{flag} must be >= 1, got {n}")
    prefilled = [0] * batch  # prompt tokens computed
    generated = [0] * batch
    steps: list[ScheduledStep] = []
    while any(g < output_len for g in generated):
        budget, decodes, chunks, sampled = max_num_batched_tokens, [], [], 0
        running = [i for i in range(batch) if prefilled[i] > 0 and generated[i] < output_len]
        for i in running[:max_num_seqs]:
            if budget == 0:
                break
            if prefilled[i] == input_len:  # a decode: one token, reads its context
                decodes.append(input_len + generated[i])
                generated[i] += 1
                sampled += 1
                budget -= 1
        seqs = len(decodes)
        for i in range(batch):
            if budget == 0 or seqs >= max_num_seqs:
                break
            if prefilled[i] < input_len:
                n = min(input_len - prefilled[i], budget)
                chunks.append((prefilled[i], n))
                prefilled[i] += n
                budget -= n
                seqs += 1
                if prefilled[i] == input_len:
                    generated[i] += 1
                    sampled += 1
        steps.append(ScheduledStep(tuple(decodes), tuple(chunks), sampled))
    return steps
