"""The attention metadata of one step, per layer kind, and the rotary rows of its tokens.

A model whose layers all attend alike (Llama, Mistral's window on every layer) gets one
metadata set; one that mixes kinds (Gemma 2/3, ``ModelSpec.layer_types``) gets the full layers'
set and, in ``AttentionBatch.sliding``, the sliding layers' windowed one, built from the same
block tables: today's allocator keeps every block, and attention masks by window.

LongRoPE (Phi-3) picks, per token, a row of the stacked short/long rotary table
(fitserve.model.layers.RotaryEmbedding), matching transformers' generate() for one sequence::

    row(p) = p + P   if the prompt is longer than original_max_position_embeddings (every
                     token of the sequence, as transformers' prefill of the whole prompt)
                     or p >= original_max_position_embeddings (transformers: seq_len > orig)
    row(p) = p       otherwise

NOTE: transformers' generate() also recomputes the whole cache with the long factors on the
step a short-prompt sequence first grows past the original length; the engine keeps the keys it
already cached (vLLM does the same), so from that step on its tokens can differ from
transformers'. Prompts longer than the original length match exactly, as do sequences that
stay within it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fitserve.config import ModelSpec
from fitserve.model.attention.backend import AttentionBackend, DecodeBatch, PrefillSeq
from fitserve.model.attention.paged import AttentionBatch
from fitserve.types import ScheduledChunk

# (query lengths, key lengths) of a group -> its backend (the runner's dispatch rule)
BackendPicker = Callable[[list[int], list[int]], AttentionBackend]


@dataclass(slots=True)
class StepShape:
    """What the metadata is built from: each prefill chunk (packed offset, cached tokens, new
    tokens, block table) and the decode rows (table, keys)."""

    prefills: list[tuple[int, int, int, list[int]]]
    decode_tables: list[list[int]]
    decode_lens: list[int]


def layer_windows(spec: ModelSpec) -> tuple[int | None, int | None] | tuple[int | None]:
    """The windows to build metadata for: (full layers', sliding layers') for a model mixing
    kinds, else the one window every layer uses."""
    kinds = spec.layer_types
    if kinds is not None and len(set(kinds)) > 1:
        return None, spec.sliding_window
    if kinds is not None and kinds[0] == "full":
        return (None,)
    return (spec.sliding_window,)


def build_meta(shape: StepShape, window: int | None, softcap: float | None, *,
               backend: BackendPicker, block_size: int, device: torch.device
               ) -> tuple[DecodeBatch | None, list[PrefillSeq]]:
    """One metadata set: the decode group's and each prefill chunk's, under ``window``."""
    prefills = []
    for offset, start, t, table in shape.prefills:
        seq = backend([t], [start + t]).build_prefill(offset, start, t, table, block_size=block_size,
                                                      window=window, device=device)
        seq.softcap = softcap
        prefills.append(seq)
    decode = None
    if shape.decode_tables:
        decode = backend([1] * len(shape.decode_tables), shape.decode_lens).build_decode(
            shape.decode_tables, shape.decode_lens, block_size=block_size, window=window,
            device=device)
        decode.softcap = softcap
    return decode, prefills


def attention_batch(spec: ModelSpec, shape: StepShape, slots: torch.Tensor,
                    kv_blocks: torch.Tensor | None, *, backend: BackendPicker, block_size: int,
                    device: torch.device) -> AttentionBatch:
    """The step's AttentionBatch, with ``sliding`` set for a model that mixes layer kinds."""
    windows = layer_windows(spec)
    cap = spec.attn_logit_softcapping
    batches = []
    for window in windows:
        decode, prefills = build_meta(shape, window, cap, backend=backend, block_size=block_size,
                                      device=device)
        batches.append(AttentionBatch(slot_mapping=slots, decode=decode, prefills=prefills,
                                      kv_blocks=kv_blocks))
    if len(batches) == 2:
        batches[0].sliding = batches[1]
    return batches[0]


def rope_rows(chunk: ScheduledChunk, spec: ModelSpec, long_row_offset: int | None,
              long_prompt_ids: set[str]) -> range | list[int]:
    """The rotary table rows of a chunk's tokens: their positions, or LongRoPE's rows (above)."""
    start, t = chunk.start_pos, len(chunk.token_ids)
    rng = range(start, start + t)
    rs = spec.rope_scaling
    if long_row_offset is None or rs is None:
        return rng
    if chunk.request_id in long_prompt_ids:
        return range(start + long_row_offset, start + t + long_row_offset)
    orig = rs.original_max_position_embeddings
    return [p + long_row_offset if p >= orig else p for p in rng]
