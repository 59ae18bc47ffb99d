"""A step's plan as int64 tensors: what rank 0 broadcasts to the workers each step.

No client data crosses: no request ids, prompts or sampling settings, only what the forward
needs. One fixed-size header, then (for a step) one payload::

    header  [command, payload_len, 0, 0]
    payload [num_chunks, num_copies,
             per chunk: n_tokens, start_pos, table_len, num_draft, n_sample   (5 each)
             all chunks' token ids, all chunks' block tables,
             per copy: src, dst]

``n_sample`` is how many sampling rows the chunk's last position gives (1 + its n>1 fanout,
0 when it does not sample), so a worker takes part in the same logits gathers as rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitserve.types import ScheduledChunk, SchedulerOutput

HEADER_LEN = 4
STEP, SHUTDOWN = 1, 2
_PER_CHUNK = 5


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What a worker runs: the chunks (request ids blank) and the copy-on-write block copies."""

    chunks: list[ScheduledChunk]
    block_copies: list[tuple[int, int]]


def encode_step(out: SchedulerOutput) -> torch.Tensor:
    meta: list[int] = [len(out.chunks), len(out.block_copies)]
    tokens: list[int] = []
    tables: list[int] = []
    for c in out.chunks:
        n_sample = (1 + len(c.fanout)) if c.sample and not c.num_draft else 0
        meta += [len(c.token_ids), c.start_pos, len(c.block_table), c.num_draft, n_sample]
        tokens += c.token_ids
        tables += c.block_table
    copies = [x for pair in out.block_copies for x in pair]
    return torch.tensor(meta + tokens + tables + copies, dtype=torch.int64)


def decode_step(payload: torch.Tensor) -> StepPlan:
    v = payload.tolist()
    n_chunks, n_copies = v[0], v[1]
    heads = [v[2 + i * _PER_CHUNK: 2 + (i + 1) * _PER_CHUNK] for i in range(n_chunks)]
    at = 2 + n_chunks * _PER_CHUNK
    token_lists = []
    for n_tokens, *_ in heads:
        token_lists.append(v[at: at + n_tokens])
        at += n_tokens
    chunks = []
    for (_, start, table_len, num_draft, n_sample), toks in zip(heads, token_lists, strict=True):
        chunks.append(ScheduledChunk(request_id="", token_ids=toks, start_pos=start,
                                     block_table=v[at: at + table_len], sample=n_sample > 0,
                                     fanout=[""] * max(0, n_sample - 1), num_draft=num_draft))
        at += table_len
    copies = [(v[at + 2 * i], v[at + 2 * i + 1]) for i in range(n_copies)]
    return StepPlan(chunks, copies)


def header(command: int, payload_len: int = 0) -> torch.Tensor:
    return torch.tensor([command, payload_len, 0, 0], dtype=torch.int64)
