"""Turn one step's logits into next tokens (and logprobs), vLLM style.

Per row, in this order::

    raw logits --log_softmax--> logprobs returned to the user (chosen, rank, top-N)
        |
        +-- allowed_token_ids / bad_words / min_tokens -> -inf (vLLM's; sampling.token_masks)
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

Memory: one private fp32 copy of the logits (penalties, bias and grammar in place), then the
rows are filtered and drawn one chunk of ``sampler_chunk_rows(V)`` rows at a time (probs, the
draws and top-p's candidates are chunk-sized; a nucleus sorted in full is sorted one row
alone), and logprobs are read chunk by chunk from the raw logits. Every per-row result is the
one the whole-batch formula gave (tests/unit/sampling/test_sampler_matches_batched.py);
fitserve.ledger.sampler_memory counts the bytes, path by path.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

from fitserve.kernels.cpu.fused import argmax
from fitserve.ledger.sampler_memory import SAMPLER_CANDIDATE_WIDTH, sampler_chunk_rows
from fitserve.sampling.filters import RowFilter, chunk_logprobs, chunk_thresholds
from fitserve.sampling.params import SamplingParams
from fitserve.sampling.token_masks import TokenMasks, apply_token_masks
from fitserve.structured.logits import GuidedMasker, apply_logit_bias
from fitserve.types import TokenLogprobs

if TYPE_CHECKING:
    from fitserve.structured.guide import GuideState

_NEG_INF = float("-inf")
_U64_MASK = (1 << 64) - 1


@dataclass(slots=True)
class RequestSamplingState:
    """What the sampler needs to know about one request at each step.

    ``output_token_ids`` is the scheduler's own list (it appends; the sampler only reads it),
    so penalties always see the tokens generated so far without any copying.

    ``num_logprobs`` is how many top alternatives to return (None: no logprobs); it is
    ``params.logprobs`` unless the engine asks for more than a client may (beam search reads
    the top 2 x beam_width of each beam).

    ``guide`` is the request's grammar state when ``params.guided`` is set (the engine builds
    it: fitserve.structured); the sampler only reads it. ``logit_bias`` is ``params.logit_bias``
    as (token ids, values) tensors, built once. ``token_masks`` is what the engine resolved of
    ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` (fitserve.sampling.token_masks).
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    num_logprobs: int | None = None
    guide: GuideState | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    token_masks: TokenMasks | None = None
    # alternatives per prompt token when the runner scores the prompt (None: it does not);
    # ``params.prompt_logprobs``, or the largest of an n>1 group's on the request computing it
    num_prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.num_logprobs is None:
            self.num_logprobs = self.params.logprobs
        if self.num_prompt_logprobs is None:
            self.num_prompt_logprobs = self.params.prompt_logprobs
        bias = self.params.logit_bias
        if bias and self.logit_bias is None:
            self.logit_bias = (torch.tensor(list(bias), dtype=torch.long),
                               torch.tensor(list(bias.values()), dtype=torch.float32))

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        device: str | torch.device = "cpu",
    ) -> RequestSamplingState:
        """Build the state, with a private generator seeded from ``params.seed`` if set."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed & _U64_MASK)  # any Python int -> a valid seed
        return cls(params, prompt_token_ids, output_token_ids, generator)


class Sampler:
    """Samples one token per row of a ``[B, V]`` logits tensor.

    ``generator`` serves every request without a seed (``None``: torch's global RNG, so
    ``torch.manual_seed`` makes unseeded runs repeatable); it must live on the logits' device.
    ``candidate_width`` is how many of the largest logits top-p ranks before widening.
    """

    def __init__(
        self, generator: torch.Generator | None = None,
        candidate_width: int = SAMPLER_CANDIDATE_WIDTH,
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
        # A private fp32 copy: penalties and filters then work in place on it. ``logits``
        # itself stays raw, for the logprobs below.
        x = logits.to(torch.float32, copy=True).contiguous()
        masked = [i for i, s in enumerate(states) if s.token_masks is not None]
        if masked:
            apply_token_masks(x, masked, [m for i in masked if (m := states[i].token_masks) is not None],
                              [states[i].output_token_ids for i in masked])
        biased = [i for i, s in enumerate(states) if s.logit_bias is not None]
        if biased:
            apply_logit_bias(x, biased, [b for i in biased if (b := states[i].logit_bias) is not None])
        _apply_penalties(x, states)
        guided = [i for i, s in enumerate(states) if s.guide is not None]
        if guided:
            self.masker(x, guided, [g for i in guided if (g := states[i].guide) is not None])

        tokens = torch.empty(len(states), dtype=torch.long, device=x.device)
        # NOTE: top-p rows see a renormalised top-k distribution when any top-p row of the
        # batch has top-k (a batch-wide choice, kept from the batched formula).
        renorm = any(_top_k(s, x.shape[1]) for s in states
                     if not s.params.greedy and s.params.top_p < 1.0)
        step = sampler_chunk_rows(x.shape[1])
        for a in range(0, len(states), step):
            self._sample_chunk(x[a:a + step], states[a:a + step], tokens[a:a + step], renorm)
        del x
        logprobs: list[TokenLogprobs | None] = [None] * len(states)
        nums = [s.num_logprobs for s in states]
        if any(n is not None for n in nums):
            # NOTE: logprobs come from the raw logits (vLLM's default "raw_logprobs"), before
            # penalties and temperature change them; one chunk of rows at a time.
            top_n = max(n for n in nums if n is not None)
            for a in range(0, len(states), step):
                if any(n is not None for n in nums[a:a + step]):
                    logprobs[a:a + step] = chunk_logprobs(logits[a:a + step], tokens[a:a + step],
                                                          nums[a:a + step], top_n)
        return tokens.tolist(), logprobs

    def _sample_chunk(
        self, x: torch.Tensor, states: list[RequestSamplingState], out: torch.Tensor,
        renorm: bool,
    ) -> None:
        """Tokens of one row chunk ``x`` (a view of the private copy, mutated) into ``out``.

        Greedy rows: argmax. Random rows: / temperature -> thresholds -> softmax -> the race.
        Greedy rows in a mixed chunk go through the random path too (temperature 1, no
        filter, draws nothing) rather than being gathered apart; their result is dropped.
        """
        greedy = [s.params.greedy for s in states]
        if any(greedy):
            best = argmax(x)
            if all(greedy):
                out.copy_(best)
                return
        temps = [1.0 if g else s.params.temperature for s, g in zip(states, greedy, strict=True)]
        if any(t != 1.0 for t in temps):
            x.div_(torch.tensor(temps, dtype=x.dtype, device=x.device).unsqueeze(1))
        probs = torch.softmax(x, dim=-1)
        vocab = x.shape[1]
        filters = [RowFilter() if g else RowFilter(_top_k(s, vocab), s.params.top_p,
                                                   s.params.min_p)
                   for s, g in zip(states, greedy, strict=True)]
        thresh = chunk_thresholds(x, probs, filters, renormalise_top_k=renorm,
                                  candidate_width=self.candidate_width)
        if thresh is not None:
            # NOTE: x is not needed any more: it becomes the 1.0 / 0.0 mask in place (a bool
            # mask would be multiplied through a float copy of it). Multiplying is ~3x faster
            # than masked_fill_ on CPU, and the race below needs no renormalisation:
            # argmax(c * p / q) = argmax(p / q).
            probs.mul_(x.ge_(thresh.unsqueeze(1)))
        q = self._exponentials(states, greedy, vocab, x.device)
        drawn = probs.div_(q).argmax(dim=-1)
        del probs, q
        if any(greedy):
            drawn = torch.where(torch.tensor(greedy, device=x.device), best, drawn)
        out.copy_(drawn)

    def probabilities(
        self, logits: torch.Tensor, states: list[RequestSamplingState]
    ) -> torch.Tensor:
        """``[B, V]`` fp32: the distribution each row of ``logits`` would be sampled from.

        A random row gets exactly what ``__call__`` draws from: temperature, then the same
        top-k / top-p / min-p threshold (``chunk_thresholds``), filtered tokens zeroed and the rest
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
        # NOTE: the output doubles as the working copy: one row chunk at a time is replaced by
        # its distribution, so only chunk-sized temporaries exist beside it.
        out = logits.to(torch.float32, copy=True).contiguous()
        vocab = out.shape[1]
        filters = [RowFilter() if s.params.greedy else RowFilter(_top_k(s, vocab), s.params.top_p,
                                                                 s.params.min_p)
                   for s in states]
        # Every random row is renormalised when any random row of the batch filters (as the
        # batched formula did); ``renorm`` as in __call__.
        filtering = any(f != RowFilter() for f in filters)
        renorm = any(f.top_k and f.top_p < 1.0 for f in filters)
        step = sampler_chunk_rows(vocab)
        for a in range(0, len(states), step):
            self._chunk_probabilities(out[a:a + step], states[a:a + step], filters[a:a + step],
                                      filtering, renorm)
        return out

    def _chunk_probabilities(
        self, x: torch.Tensor, states: list[RequestSamplingState], filters: list[RowFilter],
        filtering: bool, renorm: bool,
    ) -> None:
        """Replace the rows of ``x`` by their distributions, in place (``probabilities``)."""
        greedy = [s.params.greedy for s in states]
        best = argmax(x) if any(greedy) else None
        if not all(greedy):
            temps = [1.0 if g else s.params.temperature
                     for s, g in zip(states, greedy, strict=True)]
            if any(t != 1.0 for t in temps):
                x.div_(torch.tensor(temps, dtype=x.dtype, device=x.device).unsqueeze(1))
            probs = torch.softmax(x, dim=-1)
            thresh = chunk_thresholds(x, probs, filters, renormalise_top_k=renorm,
                                      candidate_width=self.candidate_width)
            if thresh is not None:
                probs.mul_(x.ge_(thresh.unsqueeze(1)))  # x becomes the mask (as in __call__)
            if filtering:
                probs.div_(probs.sum(dim=-1, keepdim=True))
            x.copy_(probs)
            del probs
        if best is not None:
            for i in (i for i, g in enumerate(greedy) if g):
                x[i].zero_()
                x[i, best[i]] = 1.0

    def _exponentials(
        self, states: list[RequestSamplingState], skip: list[bool], vocab: int,
        device: torch.device,
    ) -> torch.Tensor:
        """``[R, V]`` Exp(1) draws, each row drawn in place from its generator in row order.

        A seeded row draws from its own generator; the others from ``self.generator``, whose
        stream is the same drawn row by row as in one [R, V] call (torch draws uniforms
        serially). Rows in ``skip`` (greedy) draw nothing and get q = 1.
        """
        q = torch.empty(len(states), vocab, dtype=torch.float32, device=device)
        for i, s in enumerate(states):
            g = s.generator
            if skip[i]:
                q[i].fill_(1.0)
            elif g is None:
                q[i].uniform_(0.0, 1.0, generator=self.generator)
            elif g.device == q.device:
                q[i].uniform_(0.0, 1.0, generator=g)
            else:  # drawn on the generator's own device so a seed means the same stream
                q[i] = torch.rand(vocab, generator=g, device=g.device).to(device)
        # NOTE: -log(U) is Exp(1); 4x faster than Tensor.exponential_ on CPU. U == 0 gives
        # q = inf and p / q = 0 (that token just loses); U < 1 so q > 0 and no 0/0 NaN.
        return q.log_().neg_()


def _top_k(s: RequestSamplingState, vocab: int) -> int:
    """The row's top-k as applied: 0 when off or when it keeps the whole vocabulary."""
    k = s.params.top_k
    return k if 0 < k < vocab else 0


def _changes_logits(s: RequestSamplingState) -> bool:
    """A penalty, a logit bias, a token mask or a grammar applies to this row's logits."""
    p = s.params
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0 or s.guide is not None or s.logit_bias is not None
            or s.token_masks is not None)


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
