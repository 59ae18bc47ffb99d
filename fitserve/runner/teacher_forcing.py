"""Teacher-forced scoring: the model's next-token logits at every position of a text, computed
through the engine's own paged KV cache (so a quantized KV format's error is in the logits).

    for logits in score_chunks(model, spec, token_ids, chunk_size=256):
        ...  # logits [t, vocab] float32: row i predicts token i + 1 of the text

The text runs as chunked prefill of one sequence: each chunk writes its K/V into the cache,
then attends over the cache (earlier chunks and itself), exactly as a served prompt does. This
is what ``fitserve eval``, calibration and the sensitivity sweep read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from fitserve.config import ModelSpec
from fitserve.model.llama import CausalLM
from fitserve.runner.model_runner import ModelRunner
from fitserve.types import ScheduledChunk

DEFAULT_CHUNK = 256
DEFAULT_BLOCK = 16


def score_chunks(
    model: CausalLM,
    spec: ModelSpec,
    token_ids: list[int],
    *,
    chunk_size: int = DEFAULT_CHUNK,
    block_size: int = DEFAULT_BLOCK,
    kv_cache_dtype: str = "auto",
    kv_cache_scales: str = "auto",
    on_hidden: Callable[[torch.Tensor], Any] | None = None,
) -> Iterator[torch.Tensor]:
    """Yield float32 logits ``[t, vocab]`` chunk by chunk for ``token_ids`` (row i of the whole
    stream predicts ``token_ids[i + 1]``; the last row predicts past the text).

    ``kv_cache_dtype`` / ``kv_cache_scales``: the engine's KV format choice ("auto" = the model
    dtype). ``on_hidden`` sees each chunk's final hidden states (before the lm_head).
    Raises ValueError on an empty text or one longer than the model's positions.
    """
    if not token_ids:
        raise ValueError("nothing to score: the text has no tokens")
    param = next(model.parameters(), None)
    buf = next(model.buffers(), None)
    ref = param if param is not None else buf
    assert ref is not None
    device = ref.device
    dtype = model.norm.weight.dtype
    if len(token_ids) > model.rotary.cos.shape[0]:
        raise ValueError(f"the text has {len(token_ids)} tokens, more than the model's "
                         f"{model.rotary.cos.shape[0]} positions: score it in pieces")
    num_blocks = -(-len(token_ids) // block_size)
    runner = ModelRunner(model, spec, num_blocks=num_blocks, block_size=block_size,
                         kv_dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype,
                         kv_cache_scales=kv_cache_scales)
    table = list(range(num_blocks))
    for start in range(0, len(token_ids), chunk_size):
        chunk = ScheduledChunk(request_id="score", token_ids=token_ids[start:start + chunk_size],
                               start_pos=start, block_table=table, sample=False)
        # NOTE: inference mode around each chunk, never across a yield: grad mode is thread
        # state, and a generator suspended (or dropped) inside the block would leak it
        with torch.inference_mode():
            hidden = runner.forward_chunks([chunk])
            if on_hidden is not None:
                on_hidden(hidden)
            logits = model.compute_logits(hidden).float()
        yield logits


def score_logits(model: CausalLM, spec: ModelSpec, token_ids: list[int], **kwargs: Any
                 ) -> torch.Tensor:
    """All of :func:`score_chunks` at once: float32 ``[len(token_ids), vocab]``."""
    return torch.cat(list(score_chunks(model, spec, token_ids, **kwargs)))
