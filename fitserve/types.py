"""Typed contracts that pass between the scheduler, the runner and the engine.

Torch-free (tensors appear in annotations only). The scheduler produces a :class:`SchedulerOutput`; the runner turns it into tensors
and returns a :class:`RunnerOutput`; the engine feeds that back to the scheduler.

Block-table arithmetic (block_size = 4 shown)::

    positions   0 1 2 3 | 4 5 6 7 | 8 9
    block_table [   7   ,    2    ,  5 ]      slot(p) = block_table[p // 4] * 4 + p % 4
    a step with start_pos=8, token_ids=[t8, t9] writes slots 20 and 21
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken back
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # stop token, stop string or EOS
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"
    ERROR = "error"  # failed inside a step; RequestOutput.error holds the exception


@dataclass(slots=True)
class ScheduledChunk:
    """The tokens of one request that run in this step."""

    request_id: str
    token_ids: list[int]  # tokens fed this step, at positions start_pos .. start_pos+len-1
    start_pos: int  # tokens of this request already in the KV cache before this step
    block_table: list[int]  # blocks covering positions 0 .. start_pos+len(token_ids)-1
    sample: bool  # True when this chunk reaches the request's last known token
    # n>1: the request's children that sample their first token from this chunk's logits too
    fanout: list[str] = field(default_factory=list)
    # speculative decoding: the last num_draft token_ids are draft tokens to verify (the chunk
    # is [last token, d1 .. dk]; its k + 1 logits rows score d1 .. dk and give one more token)
    num_draft: int = 0
    # a hybrid model's KV layer groups (fitserve.kv.group): every group's table, group 0's
    # (``block_table``) first; empty for a one-group model. A windowed group's slots before its
    # window point at the null block 0.
    group_tables: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class SpecDecodeInputs:
    """What speculative decoding hands the runner with one step (``SchedulerOutput.spec_decode``,
    set by the engine from :meth:`fitserve.spec_decode.speculative.SpeculativeDecoding.step_inputs`)."""

    # the draft's own distribution q, [num_draft, V], at the drafts of each chunk whose drafts
    # came from a probabilistic drafter (random requests); absent: point masses (n-gram, greedy)
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    # fill RunnerOutput.hidden_states (a head-style drafter drafts from them)
    return_hidden_states: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    """What one engine step computes."""

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    # copy-on-write: (src, dst) physical blocks whose K/V the runner copies, in order, before
    # this step's forward writes anything (a shared partial block a request is about to write)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # a hybrid model's KV layer groups: each group's copies (``block_copies`` is group 0's);
    # empty for a one-group model
    group_block_copies: list[list[tuple[int, int]]] = field(default_factory=list)
    # slo policy: the prompt-chunk tokens this step was allowed beside its decodes (None: no cap)
    prefill_cap: int | None = None
    # speculative decoding's inputs to the runner (None: off; the scheduler never sets it)
    spec_decode: SpecDecodeInputs | None = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class StepRecord:
    """One engine step as the profiler and the step-time model see it.

    ``seconds`` is the whole :meth:`Engine.step` (schedule, forward, sampling, outputs): what a
    streaming client waits between tokens. The shape fields are
    :func:`fitserve.sched.slo.step_shape` of the step's plan.
    """

    index: int
    start: float  # time.perf_counter() when the step began
    seconds: float
    forward_seconds: float  # the runner's part (tensors, forward, sampling)
    new_tokens: int
    seqs: int
    kv_tokens_read: int
    num_prefill_tokens: int  # tokens of chunks longer than one token (prompt chunks)
    num_decodes: int  # one-token chunks (drafts ride along a decode's chunk)
    prefill_cap: int | None = None  # the slo policy's chunk cap in this step (None: none)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the chosen token and the top-N alternatives, as (token_id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RunnerOutput:
    """Sampled tokens for the chunks that had ``sample=True``, keyed by request id."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # chunks with drafts: every token the step emits (accepted drafts, then the correction or
    # bonus token, which is also sampled[id])
    emitted: dict[str, list[int]] = field(default_factory=dict)
    # SpecDecodeInputs.return_hidden_states: the final hidden state ([hidden], a copy) whose
    # logits gave each request's latest token (sampled[id]), for a head-style drafter (EAGLE)
    hidden_states: dict[str, torch.Tensor] = field(default_factory=dict)
    # prompt logprobs (SamplingParams.prompt_logprobs): per request, the prompt index of the
    # first token this step scored and each scored token's logprobs (fitserve.runner.prompt_logprobs)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)

    def update(self, other: RunnerOutput) -> None:
        """Add ``other``'s requests (a disjoint part of the same step) to this output."""
        self.sampled.update(other.sampled)
        self.logprobs.update(other.logprobs)
        self.emitted.update(other.emitted)
        self.hidden_states.update(other.hidden_states)
        self.prompt_logprobs.update(other.prompt_logprobs)


@dataclass(slots=True)
class BeamSequence:
    """One finished beam of a beam search (vLLM's ``BeamSearchSequence``).

    ``token_ids`` are the generated tokens (a final EOS included when the beam ended on one);
    ``score`` is ``cum_logprob / len(token_ids) ** length_penalty``, the ranking key (as
    transformers' ``sequences_scores``).
    """

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: FinishReason
    stop_reason: int | None = None
    text: str = ""


@dataclass(slots=True)
class RequestOutput:
    """What the engine reports for a request after a step.

    Every output carries this step's delta: the new token ids, their logprobs and the newly
    released text. The cumulative fields (``token_ids``, ``text``, ``logprobs``) are filled only
    on the final output (``finished=True``) and are None before it.

    NOTE: deltas keep a step's outputs O(new tokens): copying each request's whole output into
    every step's output made an n-token stream cost O(n^2) copies and memory held by a slow
    reader. A consumer that wants the running total accumulates the deltas (or reads the final
    output).
    """

    request_id: str
    prompt_token_ids: list[int]  # the request's own list, shared, not copied: don't mutate it
    delta_token_ids: list[int]
    delta_text: str
    delta_logprobs: list[TokenLogprobs] | None  # None unless the request asked for logprobs
    finished: bool
    num_output_tokens: int = 0  # tokens generated so far, this step's included
    # prompt tokens whose K/V came from the prefix cache at the latest admission (vLLM's name)
    num_cached_tokens: int = 0
    token_ids: list[int] | None = None  # final output only: every generated token
    text: str | None = None  # final output only: the whole text (stop strings applied)
    logprobs: list[TokenLogprobs] | None = None  # final output only, if logprobs were asked for
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (it has no
    # prefix); on the request's first output and its final one, None on the others
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: BaseException | None = None  # set with finish_reason ERROR: why the request failed
    beams: list[BeamSequence] | None = None  # beam search, final output only: best first
    # speculative decoding, so far: draft tokens verified for this request, and accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
