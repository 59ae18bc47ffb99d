"""What the sampler (fitserve.sampling) allocates beyond the step's fp32 logits, exactly.

The sampler makes one private fp32 copy of the logits ``[B, V]`` (penalties, logit bias and
grammar masks change it in place), then filters and draws ``c = min(B, sampler_chunk_rows(V))``
rows at a time, so every other buffer is chunk-sized or one row. Per chunk (fp32 elements,
w = min(SAMPLER_CANDIDATE_WIDTH, V), read off sampling/sampler.py and sampling/filters.py)::

    probs = softmax(x)                      c x V
    top-k, k <= w: topk [c, k]              small;  k > w: one row's topk  3 k  (values, int64)
    top-p with top-k: renormalised copy     c x V   (the mask written straight into it)
    top-p first pass, w candidates          4 c w   (values, int64 indices, cumulative sums)
    top-p widened, g rows gathered apart    6 g V   (x and probs rows, then the same for a
                                                     nucleus wider than w; g = c // 6 or 1)
    the mask (x >= threshold)               0       (written into x, no longer needed)
    q ~ Exp(1), after the filters are gone  c x V

Logprobs come afterwards, chunk by chunk from the raw logits (the copy freed): a log-softmax
of c rows, ranks counted in place in it: c x V <= B x V. Hence the peaks of the paths below,
measured with torch.profiler's memory events (tests/unit/sampling/test_sampler_memory.py),
equal to within the [B]- and [c, k]-sized index tensors. Not counted here: a grammar's mask
(numpy, fitserve.structured: about 2 bytes per token of each constrained row while it is
applied, before the chunks run).
"""

from __future__ import annotations

from enum import StrEnum

# NOTE: the sampler filters and draws sampler_chunk_rows(V) = max(1, this // V) rows at a
# time: 2**20 fp32 elements (4 MiB) per chunk buffer.
SAMPLER_CHUNK_ELEMENTS = 1 << 20
# NOTE: the logits top-p ranks before widening (Sampler's candidate_width default) and the
# widest top-k computed for a whole chunk at once.
SAMPLER_CANDIDATE_WIDTH = 256
F32_BYTES = 4


class SamplerPath(StrEnum):
    """The sampler's allocation paths, from the cheapest; a batch takes its worst row's."""

    ARGMAX = "argmax"  # every row greedy, nothing changes the logits: argmax in place
    COPY = "copy"  # greedy rows with penalties, bias, grammar or logprobs: the private copy
    RACE = "race"  # random rows (temperature, min-p, top-k <= w): + probs and the draws
    TOP_K_WIDE = "top_k_wide"  # a top-k wider than w: + one row's topk beside probs
    TOP_P = "top_p"  # + top-p's candidates, a wide nucleus widened one row at a time
    TOP_K_TOP_P = "top_k_top_p"  # top-p over the renormalised top-k distribution: the worst


def sampler_chunk_rows(vocab: int) -> int:
    """Rows the sampler filters and draws at once: ``max(1, SAMPLER_CHUNK_ELEMENTS // V)``."""
    return max(1, SAMPLER_CHUNK_ELEMENTS // vocab)


def widen_group_rows(chunk_rows: int) -> int:
    """Rows whose top-p nucleus is widened together: ``max(1, c // 6)`` (6 g V <= c V)."""
    return max(1, chunk_rows // 6)


def sampler_path_bytes(path: SamplerPath, batch: int, vocab: int) -> int:
    """Peak bytes the sampler allocates on ``path`` for ``batch`` rows (module docstring)."""
    if path is SamplerPath.ARGMAX:
        return 0
    c = min(batch, sampler_chunk_rows(vocab))
    w = min(SAMPLER_CANDIDATE_WIDTH, vocab)
    copy, chunk = batch * vocab, c * vocab
    # the nucleus: a first pass over the chunk's w candidates, then (V > w) the widened groups
    nucleus = max(4 * c * w, 6 * widen_group_rows(c) * vocab if vocab > w else 0)
    extra = {
        SamplerPath.COPY: 0,
        SamplerPath.RACE: 2 * chunk,
        SamplerPath.TOP_K_WIDE: max(2 * chunk, chunk + 3 * (vocab - 1)),  # k <= V - 1
        SamplerPath.TOP_P: max(2 * chunk, chunk + nucleus),
        SamplerPath.TOP_K_TOP_P: 2 * chunk + nucleus,
    }[path]
    return (copy + extra) * F32_BYTES


def sampler_bytes(vocab: int, max_num_seqs: int) -> int:
    """The ledger's sampler line: the worst path (``TOP_K_TOP_P``) at ``max_num_seqs`` rows."""
    return max(sampler_path_bytes(p, max_num_seqs, vocab) for p in SamplerPath)


def prompt_logprob_chunk_rows(vocab: int, max_num_seqs: int) -> int:
    """Prompt positions whose logprobs the runner computes at once (fitserve.runner.
    prompt_logprobs): ``max(1, min(sampler_chunk_rows(V), max_num_seqs))``.

    NOTE: capped at max_num_seqs so that a chunk's buffers (``prompt_logprobs_bytes``) never
    exceed the logits line plus the sampler's copy (``2 x max_num_seqs x V x 4``): the step's
    sampling phase, which runs the prompt logprobs before the sampled rows' logits are made,
    keeps the peak the ledger already counts.
    """
    return max(1, min(sampler_chunk_rows(vocab), max_num_seqs))


def prompt_logprobs_bytes(vocab: int, rows: int) -> int:
    """Peak bytes of one chunk of prompt logprobs: the chunk's fp32 logits ``[rows, V]`` and
    their log-softmax (ranks counted in place in it): ``2 x rows x V x 4``. (A bf16 model's
    bf16 logits, ``2 rows V``, are freed once cast, before the log-softmax exists.)"""
    return 2 * rows * vocab * F32_BYTES
