"""Typed contracts that pass between the scheduler, the runner and the engine.

Torch-free. The scheduler produces a :class:`SchedulerOutput`; the runner turns it into tensors
and returns a :class:`RunnerOutput`; the engine feeds that back to the scheduler.

Block-table arithmetic (block_size = 4 shown)::

    positions   0 1 2 3 | 4 5 6 7 | 8 9
    block_table [   7   ,    2    ,  5 ]      slot(p) = block_table[p // 4] * 4 + p % 4
    a step with start_pos=8, token_ids=[t8, t9] writes slots 20 and 21
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken back
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # stop token, stop string or EOS
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"


@dataclass(slots=True)
class ScheduledChunk:
    """The tokens of one request that run in this step."""

    request_id: str
    token_ids: list[int]  # tokens fed this step, at positions start_pos .. start_pos+len-1
    start_pos: int  # tokens of this request already in the KV cache before this step
    block_table: list[int]  # blocks covering positions 0 .. start_pos+len(token_ids)-1
    sample: bool  # True when this chunk reaches the request's last known token


@dataclass(slots=True)
class SchedulerOutput:
    """What one engine step computes."""

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


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


@dataclass(slots=True)
class RequestOutput:
    """What the engine reports for a request after a step: cumulative output plus this step's delta."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
