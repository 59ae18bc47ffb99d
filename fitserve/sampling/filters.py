"""Top-k / top-p / min-p thresholds and logprobs over one row chunk of a step's logits.

Everything here works on a chunk of at most ``sampler_chunk_rows(V)`` rows (the sampler's
loop) and allocates only chunk-sized or single-row temporaries, so what the sampler holds
beyond its private copy of the logits does not grow with the batch (fitserve.ledger.scratch,
``sampler_bytes``, counts it). Rows that do not ask for a filter are computed along with the
others (per-row results never depend on the other rows: torch's softmax, topk, cumsum and
argmax work row by row) and ignored, rather than gathered into copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fitserve.ledger.sampler_memory import widen_group_rows
from fitserve.types import TokenLogprobs

_NEG_INF = float("-inf")


@dataclass(slots=True, frozen=True)
class RowFilter:
    """One row's filters as the sampler applies them (a greedy row: none)."""

    top_k: int = 0  # 0: off (already clipped to 0 < k < V)
    top_p: float = 1.0
    min_p: float = 0.0


def chunk_thresholds(
    x: torch.Tensor, probs: torch.Tensor, filters: Sequence[RowFilter], *,
    renormalise_top_k: bool, candidate_width: int,
) -> torch.Tensor | None:
    """Per-row logit threshold of chunk ``x`` from top-k, top-p and min-p; None: no filter.

    ``probs`` is ``softmax(x)``. ``renormalise_top_k``: top-p sees the top-k-filtered,
    renormalised distribution (the batch had a top-p row with top-k; every top-p row then
    gets it, as the batched formula did).
    """
    rows = x.shape[0]
    k_rows = [i for i, f in enumerate(filters) if f.top_k > 0]
    p_rows = [i for i, f in enumerate(filters) if f.top_p < 1.0]
    m_rows = [i for i, f in enumerate(filters) if f.min_p > 0.0]
    if not (k_rows or p_rows or m_rows):
        return None
    thresh = torch.full((rows,), _NEG_INF, dtype=x.dtype, device=x.device)
    if k_rows:
        kth = _kth_largest(x, [filters[i].top_k for i in k_rows], k_rows, candidate_width)
        thresh[_index(k_rows, x)] = kth
    if p_rows:
        pp = probs
        if renormalise_top_k:  # NOTE: a chunk-sized buffer, freed before the race
            # (x >= t) written as 1.0 / 0.0 straight into the new buffer: no bool mask and no
            # float copy of it (what ``probs * bool_mask`` makes); mask * p == p * mask.
            pp = torch.ge(x, thresh.unsqueeze(1), out=torch.empty_like(probs)).mul_(probs)
            pp.div_(pp.sum(dim=-1, keepdim=True))
        top_p = torch.tensor([f.top_p for f in filters], device=x.device)
        p_thresh = _top_p_thresholds(x, pp, top_p, p_rows, candidate_width)
        idx = _index(p_rows, x)
        thresh[idx] = torch.maximum(thresh[idx], p_thresh[idx])
        del pp
    if m_rows:
        log_min_p = torch.tensor([math.log(f.min_p) if f.min_p > 0.0 else 0.0 for f in filters],
                                 dtype=x.dtype, device=x.device)
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); the max survives top-k/p,
        # so the ratio is the same before or after their renormalisation.
        m_thresh = x.amax(dim=-1) + log_min_p
        idx = _index(m_rows, x)
        thresh[idx] = torch.maximum(thresh[idx], m_thresh[idx])
    return thresh


def _kth_largest(
    x: torch.Tensor, ks: list[int], rows: list[int], candidate_width: int
) -> torch.Tensor:
    """The k-th largest logit of each row in ``rows`` (a value: the same whatever the method).

    Small k: one topk over the chunk ([rows, k_max]); a k beyond ``candidate_width``: one row
    at a time, so no [rows, ~V] topk output exists.
    """
    k_max = max(ks)
    if k_max <= candidate_width:
        top = x.topk(k_max, dim=-1).values  # sorted descending
        k = torch.tensor(ks, device=x.device)
        return top[_index(rows, x)].gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    # NOTE: clone the one value, so each row's [k] values are freed before the next row's
    return torch.cat([x[r].topk(k).values[k - 1:k].clone() for r, k in zip(rows, ks, strict=True)])


def _top_p_thresholds(
    x: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor, rows: list[int],
    candidate_width: int,
) -> torch.Tensor:
    """Smallest logit in the nucleus of each row of ``x`` (valid for ``rows``).

    ``probs`` is the distribution top-p cuts (top-k already applied, renormalised). Sorted
    descending, token j is kept while the mass strictly before it is < top_p. Only the
    ``candidate_width`` largest logits are ranked first (a full sort costs ~2 ms a row at
    V=49152 on CPU); rows whose nucleus is wider are redone 16x wider, then in full, in groups
    of ``widen_group_rows`` rows gathered apart (torch sorts rows in parallel, so a group keeps
    the threads busy; its buffers, 6 rows per row, stay within one chunk buffer).
    """
    vocab = x.shape[1]
    width = min(candidate_width, vocab)
    out, short = _nucleus(x, probs, top_p, width)
    todo = [r for r in rows if short[r]]
    group = widen_group_rows(x.shape[0])
    while todo and width < vocab:
        width = min(width * 16, vocab)
        still = []
        for a in range(0, len(todo), group):
            idx = _index(todo[a:a + group], x)
            o, s = _nucleus(x.index_select(0, idx), probs.index_select(0, idx),
                            top_p.index_select(0, idx), width)
            out[idx] = o
            still += [r for r, more in zip(todo[a:a + group], s, strict=True) if more]
        todo = still
    return out


def _nucleus(
    x: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor, width: int
) -> tuple[torch.Tensor, list[bool]]:
    """(threshold among the ``width`` largest, whether the nucleus may reach past them)."""
    values, indices = x.topk(width, dim=-1)  # sorted descending
    cum = probs.gather(1, indices)
    del indices  # NOTE: int64, the largest buffer here: freed before the comparisons
    cum.cumsum_(dim=-1)
    total = cum[:, -1].clone()
    # mass strictly before j < top_p: always true for j = 0 (top_p > 0), so 1 + the rest,
    # counted as 1.0 / 0.0 in place (a bool mask would be summed through an int64 copy);
    # an fp32 sum of ones is exact up to 2**24.
    n_keep = cum.lt_(top_p.unsqueeze(1))[:, :-1].sum(dim=-1).long() + 1
    out = values.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
    short = (n_keep == width) & (total < top_p)
    return out, short.tolist()


def chunk_logprobs(
    raw: torch.Tensor, chosen: torch.Tensor, nums: Sequence[int | None], top_n: int
) -> list[TokenLogprobs | None]:
    """Chosen token's logprob, its rank (1 = most likely) and the top-N, per row of ``raw``.

    ``raw``: the chunk's raw logits (any float dtype); rows whose ``nums`` is None get None.
    ``top_n`` is the batch's largest N, so every row's top list comes from the same topk.
    """
    lp = torch.log_softmax(raw.to(torch.float32), dim=-1)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1))
    top_v: list[list[float]] = [[] for _ in nums]
    top_i: list[list[int]] = [[] for _ in nums]
    if top_n > 0:
        top = lp.topk(top_n, dim=-1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    # NOTE: rank counts strictly better tokens, so a tie with the best is rank 1 (as vLLM);
    # counted as 1.0 / 0.0 in lp itself (no longer needed), exact up to 2**24 tokens.
    ranks = (lp.gt_(chosen_lp).sum(dim=-1).long() + 1).tolist()
    return [
        None if n is None else
        TokenLogprobs(token_id=t, logprob=v, rank=rank, top=list(zip(ti[:n], tv[:n], strict=True)))
        for t, v, rank, n, ti, tv in zip(chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks,
                                         nums, top_i, top_v, strict=True)
    ]


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=like.device)
