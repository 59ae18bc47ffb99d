"""The rotary-table rows of a step's tokens: their positions, or LongRoPE's rows.

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

from fitserve.config import ModelSpec
from fitserve.types import ScheduledChunk


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
