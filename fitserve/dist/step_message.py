"""A step's plan as int64 tensors: what rank 0 broadcasts to the workers each step.

No client data crosses: no request ids, prompts or sampling settings, only what the forward
needs. One fixed-size header, then (for a step) one payload::

    header  [command, payload_len, 0, 0]
    payload [num_chunks, num_copies, num_groups,
             per chunk: n_tokens, start_pos, table_len, num_draft, n_sample   (5 each)
             all chunks' token ids, all chunks' block tables,
             per copy: src, dst,
             a hybrid model's KV layer groups (num_groups > 0; 0 for a one-group model):
             per chunk, per group: table_len, table;  per group: n_copies, (src, dst) each]

``n_sample`` is how many sampling rows the chunk's last position gives (1 + its n>1 fanout,
0 when it does not sample), so a worker takes part in the same logits gathers as rank 0.

The start-up message (``encode_startup``) gives the workers the KV pool rank 0 sized: its
block count and, for a hybrid model (sliding and full layers: Gemma 2/3, gpt-oss), each
group's kind, pool, window and layers, so every rank builds the same caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitserve.kv.group import KVGroup
from fitserve.types import ScheduledChunk, SchedulerOutput

HEADER_LEN = 4
STEP, SHUTDOWN = 1, 2
_PER_CHUNK = 5


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What a worker runs: the chunks (request ids blank) and the copy-on-write block copies
    (``group_block_copies``: each KV group's, for a hybrid model; else empty)."""

    chunks: list[ScheduledChunk]
    block_copies: list[tuple[int, int]]
    group_block_copies: list[list[tuple[int, int]]]


def encode_step(out: SchedulerOutput) -> torch.Tensor:
    groups = len(out.chunks[0].group_tables) if out.chunks else len(out.group_block_copies)
    meta: list[int] = [len(out.chunks), len(out.block_copies), groups]
    tokens: list[int] = []
    tables: list[int] = []
    for c in out.chunks:
        n_sample = (1 + len(c.fanout)) if c.sample and not c.num_draft else 0
        meta += [len(c.token_ids), c.start_pos, len(c.block_table), c.num_draft, n_sample]
        tokens += c.token_ids
        tables += c.block_table
    copies = [x for pair in out.block_copies for x in pair]
    hybrid: list[int] = []
    if groups:
        for c in out.chunks:
            if len(c.group_tables) != groups:
                raise ValueError(f"a step's chunks carry {len(c.group_tables)} and {groups} "
                                 "KV group tables")
            for table in c.group_tables:
                hybrid += [len(table), *table]
        group_copies = out.group_block_copies or [[] for _ in range(groups)]
        for pairs in group_copies:
            hybrid += [len(pairs), *(x for pair in pairs for x in pair)]
    return torch.tensor(meta + tokens + tables + copies + hybrid, dtype=torch.int64)


class _Reader:
    """Reads a payload's ints in order."""

    def __init__(self, values: list[int]) -> None:
        self.v, self.at = values, 0

    def take(self, n: int) -> list[int]:
        out = self.v[self.at: self.at + n]
        self.at += n
        return out

    def one(self) -> int:
        return self.take(1)[0]


def decode_step(payload: torch.Tensor) -> StepPlan:
    r = _Reader(payload.tolist())
    n_chunks, n_copies, n_groups = r.take(3)
    heads = [r.take(_PER_CHUNK) for _ in range(n_chunks)]
    token_lists = [r.take(h[0]) for h in heads]
    chunks = []
    for (_, start, table_len, num_draft, n_sample), toks in zip(heads, token_lists, strict=True):
        chunks.append(ScheduledChunk(request_id="", token_ids=toks, start_pos=start,
                                     block_table=r.take(table_len), sample=n_sample > 0,
                                     fanout=[""] * max(0, n_sample - 1), num_draft=num_draft))
    flat = r.take(2 * n_copies)
    copies = list(zip(flat[0::2], flat[1::2], strict=True))
    group_copies: list[list[tuple[int, int]]] = []
    if n_groups:
        for c in chunks:
            c.group_tables = [r.take(r.one()) for _ in range(n_groups)]
        for _ in range(n_groups):
            pairs = r.take(2 * r.one())
            group_copies.append(list(zip(pairs[0::2], pairs[1::2], strict=True)))
    return StepPlan(chunks, copies, group_copies)


def encode_startup(num_blocks: int, groups: list[KVGroup]) -> torch.Tensor:
    """``[num_blocks, num_groups, per group: sliding?, num_blocks, window, n_layers, layers]``
    (window 0 for a full group)."""
    v = [num_blocks, len(groups)]
    for g in groups:
        v += [int(g.kind == "sliding"), g.num_blocks, g.window or 0, len(g.layers), *g.layers]
    return torch.tensor(v, dtype=torch.int64)


def decode_startup(payload: torch.Tensor) -> tuple[int, list[KVGroup]]:
    r = _Reader(payload.tolist())
    num_blocks, n_groups = r.take(2)
    groups = []
    for _ in range(n_groups):
        sliding, blocks, window, n_layers = r.take(4)
        groups.append(KVGroup("sliding" if sliding else "full", blocks,
                              window if sliding else None, tuple(r.take(n_layers))))
    return num_blocks, groups


def header(command: int, payload_len: int = 0) -> torch.Tensor:
    return torch.tensor([command, payload_len, 0, 0], dtype=torch.int64)
