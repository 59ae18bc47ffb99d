"""REFERENCE ONLY (tests): the sampler as it was before it worked one row chunk at a time.

A frozen copy of fitserve/sampling/sampler.py at 6b44b16, the whole-batch formula (up to 15
fp32 [B, V] buffers); test_sampler_matches_batched.py checks that the chunked sampler draws
exactly its tokens and logprobs on fixed seeds. Its docstring follows.

Turn one step's logits into next tokens (and logprobs), vLLM style.

Per row, in this order::

    raw logits --log_softmax--> logprobs returned to the user (chosen, rank, top-N)
        |
        +-- logit_bias (OpenAI's: added to the raw logits)
        +-- repetition penalty (prompt + output tokens), frequency / presence (output tokens)
        +-- guided rows: tokens the grammar forbids -> -inf (fitserve.structured)
        |
        +-- greedy row: argmax
        +-- random row: / temperature -> top-k -> top-p -> min-p -> softmax
                        -> argmax(probs / q),  q ~ Exp(1) per vocab entry

The random draw is the exponential race (equivalent to Gumbel-max): the winner of
``argmax(p_i / q_i)`` is distributed exactly as ``p``. A seeded request draws its ``V`` values
from its own generator, so its tokens do not depend on what else is in the batch.

Top-k, top-p and min-p are each a *threshold* on the (temperature-scaled) logits: a row keeps
every token whose logit is >= the largest of the three thresholds. Ties at a boundary are kept,
so the kept set never depends on token-id order. The grammar mask comes before them, so the
filters and the greedy argmax choose among the allowed tokens only.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import TYPE_CHECKING

import torch

from fitserve.kernels.cpu.fused import argmax
from fitserve.sampling.params import SamplingParams

# NOTE: the per-request state is data, not the algorithm under comparison: the engine's own
from fitserve.sampling.sampler import RequestSamplingState
from fitserve.structured.logits import GuidedMasker, apply_logit_bias
from fitserve.types import TokenLogprobs

if TYPE_CHECKING:
    pass

_NEG_INF = float("-inf")


class Sampler:
    """Samples one token per row of a ``[B, V]`` logits tensor.

    ``generator`` serves every request without a seed (``None``: torch's global RNG, so
    ``torch.manual_seed`` makes unseeded runs repeatable); it must live on the logits' device.
    ``candidate_width`` is how many of the largest logits top-p ranks before widening.
    """

    def __init__(
        self, generator: torch.Generator | None = None, candidate_width: int = 256
    ) -> None:
        self.generator = generator
        self.candidate_width = candidate_width
        self.masker = GuidedMasker()  # fills and applies grammar masks; counts their time

    def __call__(
        self, logits: torch.Tensor, states: list[RequestSamplingState]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Return the chosen token of each row and, where requested, its logprobs."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [len(states), V] = [{len(states)}, V], got {list(logits.shape)}"
            )
        if not states:
            return [], []
        if all(_plain_greedy(s) for s in states):  # nothing changes the logits: no copy
            return argmax(logits).tolist(), [None] * len(states)
        # A private fp32 copy: penalties and filters then work in place on it.
        x = logits.to(torch.float32, copy=True).contiguous()
        lp_rows = [i for i, s in enumerate(states) if s.num_logprobs is not None]
        # NOTE: logprobs come from the raw logits (vLLM's default "raw_logprobs"), before
        # penalties and temperature change them.
        raw_lp = torch.log_softmax(_take(x, lp_rows), dim=-1) if lp_rows else None

        biased = [i for i, s in enumerate(states) if s.logit_bias is not None]
        if biased:
            apply_logit_bias(x, biased, [b for i in biased if (b := states[i].logit_bias) is not None])
        _apply_penalties(x, states)
        guided = [i for i, s in enumerate(states) if s.guide is not None]
        if guided:
            self.masker(x, guided, [g for i in guided if (g := states[i].guide) is not None])

        tokens = torch.empty(len(states), dtype=torch.long, device=x.device)
        greedy = [i for i, s in enumerate(states) if s.params.greedy]
        rand = [i for i, s in enumerate(states) if not s.params.greedy]
        if greedy:
            _put(tokens, greedy, argmax(_take(x, greedy)))
        if rand:
            chosen = self._sample(_take(x, rand), [states[i] for i in rand])
            _put(tokens, rand, chosen)
        token_list: list[int] = tokens.tolist()

        logprobs: list[TokenLogprobs | None] = [None] * len(states)
        if raw_lp is not None:
            for i, lp in zip(lp_rows, _logprobs(raw_lp, tokens[lp_rows], states, lp_rows),
                             strict=True):
                logprobs[i] = lp
        return token_list, logprobs

    def probabilities(
        self, logits: torch.Tensor, states: list[RequestSamplingState]
    ) -> torch.Tensor:
        """``[B, V]`` fp32: the distribution each row of ``logits`` would be sampled from.

        A random row gets exactly what ``__call__`` draws from: temperature, then the same
        top-k / top-p / min-p threshold (``_thresholds``), filtered tokens zeroed and the rest
        renormalised to sum 1. A greedy row gets a point mass on its argmax (first index on
        ties, as ``__call__``). Speculative decoding compares these distributions (target p,
        draft q) when it verifies draft tokens.

        Penalties are not applied: they depend on the tokens generated so far, which change
        inside a speculative chunk, so speculative decoding is only used for requests without
        them; nor are logit bias and grammar masks (speculative decoding skips those requests
        too). A state with a non-default repetition / frequency / presence penalty, a bias or
        a grammar raises ``ValueError`` rather than silently returning a distribution
        ``__call__`` never uses.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [len(states), V] = [{len(states)}, V], got {list(logits.shape)}"
            )
        penalised = [i for i, s in enumerate(states) if _changes_logits(s)]
        if penalised:
            raise ValueError(
                f"probabilities() does not apply penalties, logit bias or grammars; rows "
                f"{penalised} have a repetition, frequency or presence penalty, a bias or a grammar"
            )
        x = logits.to(torch.float32, copy=True).contiguous()
        out = torch.zeros_like(x)
        greedy = [i for i, s in enumerate(states) if s.params.greedy]
        rand = [i for i, s in enumerate(states) if not s.params.greedy]
        if greedy:
            best = argmax(_take(x, greedy)).unsqueeze(1)
            _put(out, greedy, torch.zeros_like(_take(x, greedy)).scatter_(1, best, 1.0))
        if rand:
            xr = _take(x, rand)  # may be x itself: it is our private copy, so mutating is fine
            temps = [states[i].params.temperature for i in rand]
            if any(t != 1.0 for t in temps):
                xr.div_(torch.tensor(temps, dtype=xr.dtype, device=xr.device).unsqueeze(1))
            probs = torch.softmax(xr, dim=-1)
            thresh = self._thresholds(xr, probs, [states[i].params for i in rand])
            if thresh is not None:
                probs.mul_(xr >= thresh.unsqueeze(1))
                probs.div_(probs.sum(dim=-1, keepdim=True))
            _put(out, rand, probs)
        return out

    def _sample(self, x: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
        """Temperature, filters and the exponential race on the random rows ``x`` (mutated)."""
        temps = [s.params.temperature for s in states]
        if any(t != 1.0 for t in temps):
            x.div_(torch.tensor(temps, dtype=x.dtype, device=x.device).unsqueeze(1))
        probs = torch.softmax(x, dim=-1)
        thresh = self._thresholds(x, probs, [s.params for s in states])
        if thresh is not None:
            # NOTE: multiplying by the bool mask is ~3x faster than masked_fill_ on CPU, and
            # the race below needs no renormalisation: argmax(c * p / q) = argmax(p / q).
            probs.mul_(x >= thresh.unsqueeze(1))
        q = self._exponentials(states, x.shape[1], x.device)
        return probs.div_(q).argmax(dim=-1)

    def _exponentials(
        self, states: list[RequestSamplingState], vocab: int, device: torch.device
    ) -> torch.Tensor:
        """``[R, V]`` Exp(1) draws: one batched draw for unseeded rows, one per seeded row."""
        q = torch.empty(len(states), vocab, dtype=torch.float32, device=device)
        shared = [i for i, s in enumerate(states) if s.generator is None]
        if shared:
            u = torch.rand(len(shared), vocab, generator=self.generator, device=device)
            _put(q, shared, u)
        for i, s in enumerate(states):
            if s.generator is not None:
                # Drawn on the generator's own device so a seed means the same stream anywhere.
                g = s.generator
                q[i] = torch.rand(vocab, generator=g, device=g.device).to(device)
        # NOTE: -log(U) is Exp(1); 4x faster than Tensor.exponential_ on CPU. U == 0 gives
        # q = inf and p / q = 0 (that token just loses); U < 1 so q > 0 and no 0/0 NaN.
        return q.log_().neg_()

    def _thresholds(
        self, x: torch.Tensor, probs: torch.Tensor, params: list[SamplingParams]
    ) -> torch.Tensor | None:
        """Per-row logit threshold from top-k, top-p and min-p; None when no row filters.

        ``probs`` is ``softmax(x)``, shared with the caller so it is computed once.
        """
        rows, vocab = x.shape
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        m_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
        if not (any(ks) or p_rows or m_rows):
            return None
        thresh = torch.full((rows,), _NEG_INF, dtype=x.dtype, device=x.device)
        k_rows = [i for i, k in enumerate(ks) if k > 0]
        if k_rows:
            k = torch.tensor([ks[i] for i in k_rows], device=x.device)
            top = _take(x, k_rows).topk(int(k.max()), dim=-1).values  # sorted descending
            _put(thresh, k_rows, top.gather(1, (k - 1).unsqueeze(1)).squeeze(1))
        if p_rows:
            xp, pp = _take(x, p_rows), _take(probs, p_rows)
            if any(ks[i] for i in p_rows):  # top-p sees the top-k-filtered distribution
                pp = pp * (xp >= _take(thresh, p_rows).unsqueeze(1))
                pp.div_(pp.sum(dim=-1, keepdim=True))
            top_p = torch.tensor([params[i].top_p for i in p_rows], device=x.device)
            p_thresh = self._top_p_thresholds(xp, pp, top_p)
            _put(thresh, p_rows, torch.maximum(_take(thresh, p_rows), p_thresh))
        if m_rows:
            xm = _take(x, m_rows)
            log_min_p = torch.tensor([math.log(params[i].min_p) for i in m_rows],
                                     dtype=x.dtype, device=x.device)
            # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); the max survives top-k/p,
            # so the ratio is the same before or after their renormalisation.
            m_thresh = xm.amax(dim=-1) + log_min_p
            _put(thresh, m_rows, torch.maximum(_take(thresh, m_rows), m_thresh))
        return thresh

    def _top_p_thresholds(
        self, x: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor
    ) -> torch.Tensor:
        """Smallest logit in the nucleus of each row of ``x``.

        ``probs`` is the distribution top-p cuts (top-k already applied, renormalised). Sorted
        descending, token j is kept while the mass strictly before it is < top_p. Only the
        ``candidate_width`` largest logits are ranked first (a full sort costs ~2 ms a row at
        V=49152 on CPU); rows whose nucleus is wider are redone 16x wider, then in full.
        """
        vocab = x.shape[1]
        out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
        todo = list(range(x.shape[0]))
        width = min(self.candidate_width, vocab)
        while todo:
            ps = _take(top_p, todo)
            top = _take(x, todo).topk(width, dim=-1)  # sorted descending
            cand = _take(probs, todo).gather(1, top.indices)
            cum = cand.cumsum(dim=-1)
            before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # mass strictly before j
            n_keep = (before < ps.unsqueeze(1)).sum(dim=-1).clamp(min=1)
            _put(out, todo, top.values.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1))
            if width == vocab:
                break
            # Every candidate kept and the nucleus not yet full: the boundary lies further out.
            short = (n_keep == width) & (cum[:, -1] < ps)
            todo = [r for r, s in zip(todo, short.tolist(), strict=True) if s]
            width = min(width * 16, vocab)
        return out


def _changes_logits(s: RequestSamplingState) -> bool:
    """A penalty, a logit bias or a grammar applies to this row's logits before sampling."""
    p = s.params
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0 or s.guide is not None or s.logit_bias is not None)


def _plain_greedy(s: RequestSamplingState) -> bool:
    """The token is the argmax of the raw logits: greedy, no logprobs, nothing changes them."""
    return s.params.greedy and s.num_logprobs is None and not _changes_logits(s)


def _apply_penalties(x: torch.Tensor, states: list[RequestSamplingState]) -> None:
    """Repetition, then frequency and presence penalties, in place on ``x`` ([B, V]).

    Works on flat indices ``row * V + token`` so the cost grows with the number of tokens seen,
    not with ``B * V``.
    """
    vocab = x.shape[1]
    flat = x.view(-1)
    rep = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if rep:
        idx = _flat_ids(x, rep, [s.prompt_token_ids for s in states], vocab)
        idx = torch.cat([idx, _flat_ids(x, rep, [s.output_token_ids for s in states], vocab)])
        idx = torch.unique(idx)  # each seen token penalised once
        r = _row_values(x, [s.params.repetition_penalty for s in states])[idx // vocab]
        v = flat[idx]
        # HF/vLLM: a positive logit is divided, a non-positive one multiplied (both less likely).
        flat[idx] = torch.where(v > 0, v / r, v * r)
    fp = [i for i, s in enumerate(states)
          if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0]
    if fp:
        idx = _flat_ids(x, fp, [s.output_token_ids for s in states], vocab)
        idx, counts = torch.unique(idx, return_counts=True)
        row = idx // vocab
        freq = _row_values(x, [s.params.frequency_penalty for s in states])[row]
        pres = _row_values(x, [s.params.presence_penalty for s in states])[row]
        flat[idx] -= freq * counts.to(x.dtype) + pres


def _flat_ids(
    x: torch.Tensor, rows: list[int], ids: list[list[int]], vocab: int
) -> torch.Tensor:
    """``row * vocab + token`` for every token of ``ids[row]``, ``row`` in ``rows``."""
    lengths = torch.tensor([len(ids[r]) for r in rows], device=x.device)
    tokens = torch.tensor(list(chain.from_iterable(ids[r] for r in rows)),
                          dtype=torch.long, device=x.device)
    # An id >= vocab would silently land in the next row's slice of the flat view.
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}) for penalties")
    row_of = torch.repeat_interleave(torch.tensor(rows, device=x.device), lengths)
    return row_of * vocab + tokens


def _row_values(x: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=x.dtype, device=x.device)


def _logprobs(
    raw_lp: torch.Tensor,
    chosen: torch.Tensor,
    states: list[RequestSamplingState],
    rows: list[int],
) -> list[TokenLogprobs]:
    """Chosen token's logprob, its rank (1 = most likely) and the top-N, from ``raw_lp``."""
    chosen_lp = raw_lp.gather(1, chosen.unsqueeze(1))
    # NOTE: rank counts strictly better tokens, so a tie with the best is rank 1 (as vLLM).
    ranks = ((raw_lp > chosen_lp).sum(dim=-1) + 1).tolist()
    ns = [states[r].num_logprobs or 0 for r in rows]
    top_v: list[list[float]] = [[] for _ in rows]
    top_i: list[list[int]] = [[] for _ in rows]
    if max(ns) > 0:
        top = raw_lp.topk(max(ns), dim=-1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprobs(token_id=t, logprob=lp, rank=rank,
                      top=list(zip(ti[:n], tv[:n], strict=True)))
        for t, lp, rank, n, ti, tv in zip(chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks,
                                          ns, top_i, top_v, strict=True)
    ]


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows ``rows`` of ``t``; ``t`` itself (no copy) when that is every row in order."""
    if len(rows) == t.shape[0]:
        return t  # rows are built in increasing order, so this means all of them
    return t[torch.tensor(rows, device=t.device)]


def _put(t: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """``t[rows] = values``, without an index tensor when ``rows`` is every row."""
    if len(rows) == t.shape[0]:
        t.copy_(values)
    else:
        t[torch.tensor(rows, device=t.device)] = values
