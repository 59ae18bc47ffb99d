"""Verify one request's draft tokens against the target model: speculative rejection sampling.

The runner feeds the target one chunk per request: the last emitted token ``t`` followed by the
``k`` draft tokens ``x_0 .. x_{k-1}``, and gets ``k + 1`` rows of logits back. Row ``i`` is the
target's distribution of the token *after* chunk token ``i``::

    chunk token      t      x_0     x_1    ...   x_{k-1}
    logits row       0       1       2     ...     k
    row scores      x_0     x_1     x_2    ...   (bonus)

    emitted = x_0 .. x_{n-1}  +  one more token        (n accepted, 0 <= n <= k)
              one more = correction from row n if x_n was rejected, else the bonus from row k

Greedy requests accept ``x_i`` while it is the argmax of row ``i``, so the output is exactly
plain greedy decoding. Random requests use the rule of Leviathan et al. / Chen et al. (as vLLM):
with ``p_i`` the target's processed distribution (``Sampler.probabilities``) and ``q_i`` the
draft's, ``x_i`` is accepted with probability ``min(1, p_i[x_i] / q_i[x_i])``; the first
rejection is replaced by a draw from ``norm(max(0, p_i - q_i))``; when all ``k`` are accepted the
bonus is drawn from ``p_k``. The emitted tokens are then distributed exactly as sampling the
target one token at a time. A deterministic proposer (n-gram / prompt lookup) passes
``draft_probs=None``: ``q_i`` is a point mass on ``x_i``, so ``x_i`` is accepted with
probability ``p_i[x_i]`` and a rejection resamples ``p_i`` without ``x_i``.

Requests with repetition / frequency / presence penalties are not speculated (the penalties
change inside the chunk); ``Sampler.probabilities`` raises ``ValueError`` for them.
"""

from __future__ import annotations

import torch

from fitserve.sampling.sampler import RequestSamplingState, Sampler


def verify(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    state: RequestSamplingState,
    sampler: Sampler,
) -> list[int]:
    """The tokens one verification chunk emits: the accepted drafts, then exactly one more.

    ``target_logits`` is ``[k + 1, V]`` raw target logits (row ``i`` scores ``draft_tokens[i]``,
    row ``k`` gives the bonus token); ``draft_probs`` is ``[k, V]``, the draft's own distribution
    at each draft position processed by ``Sampler.probabilities`` with the same params, or
    ``None`` for a deterministic proposer. ``k`` may be 0 (one token is sampled from row 0).

    Random draws come from ``state.generator`` if set, else ``sampler.generator`` (``None``:
    torch's global RNG): ``k`` uniforms for the acceptance tests, then ``V`` for the final token.
    Returns 1 to ``k + 1`` token ids.
    """
    _check_shapes(target_logits, draft_tokens, draft_probs)
    k = len(draft_tokens)
    if state.params.greedy:
        sp = state.params
        if sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0:
            raise ValueError("verify() does not apply penalties: a penalised request cannot speculate")
        # NOTE: the argmax of the raw logits, no [k + 1, V] softmax: the output is plain greedy's
        return _verify_greedy(target_logits, draft_tokens)
    p = sampler.probabilities(target_logits, [state] * (k + 1))  # all k + 1 rows in one call
    n = _num_accepted(p, draft_tokens, draft_probs, state, sampler)
    # all accepted: the bonus from row k; else the correction for the rejected draft n
    final = p[k] if n == k else _residual(p[n], _draft_row(p, draft_tokens, draft_probs, n))
    return draft_tokens[:n] + [_draw(final, state, sampler)]


def _check_shapes(
    target_logits: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None
) -> None:
    """Raise ``ValueError`` naming the first mismatch between the three inputs."""
    k = len(draft_tokens)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(
            f"target_logits must be [k + 1, V] = [{k + 1}, V] for {k} draft tokens, "
            f"got {list(target_logits.shape)}"
        )
    vocab = target_logits.shape[1]
    if draft_probs is not None and (draft_probs.dim() != 2
                                    or tuple(draft_probs.shape) != (k, vocab)):
        raise ValueError(
            f"draft_probs must be [k, V] = [{k}, {vocab}] like target_logits, "
            f"got {list(draft_probs.shape)}"
        )
    bad = [t for t in draft_tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"draft_tokens must be in [0, {vocab}), got {bad}")


def _verify_greedy(logits: torch.Tensor, draft_tokens: list[int]) -> list[int]:
    """Accept drafts while they equal each row's argmax, then append the next row's argmax."""
    best: list[int] = logits.argmax(dim=-1).tolist()  # first index on ties, as the sampler
    out: list[int] = []
    for draft, target in zip(draft_tokens, best, strict=False):
        if draft != target:
            break
        out.append(draft)
    out.append(best[len(out)])
    return out


def _num_accepted(
    p: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    state: RequestSamplingState,
    sampler: Sampler,
) -> int:
    """Length of the accepted prefix: one uniform per draft, compared with the accept rule."""
    k = len(draft_tokens)
    if k == 0:
        return 0
    x = torch.tensor(draft_tokens, dtype=torch.long, device=p.device).unsqueeze(1)
    p_x = p[:k].gather(1, x).squeeze(1)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.to(p.device, torch.float32).gather(1, x).squeeze(1)
    # NOTE: all k uniforms are drawn up front (one RNG call, one sync); the ones after the
    # first rejection are simply unused, which does not change any probability.
    accepted = _uniform(k, state, sampler, p.device) < _accept_probability(p_x, q_x)
    return int(accepted.to(torch.int32).cumprod(dim=0).sum())


def _accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """``min(1, p_x / q_x)`` per draft; 0 where the target excludes the token (``p_x == 0``).

    Module level so a test can substitute a wrong rule and see the statistics catch it.
    """
    # NOTE: q_x == 0 (a draft its own q excludes: float drift between draft sampling and q)
    # gives p_x / 0 = inf -> 1 when the target allows the token; 0 / 0 is masked to 0.
    return torch.where(p_x > 0, (p_x / q_x).clamp(max=1.0), torch.zeros_like(p_x))


def _draft_row(
    p: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None, i: int
) -> torch.Tensor:
    """``q_i`` as a ``[V]`` fp32 tensor on ``p``'s device (a point mass when no draft_probs)."""
    if draft_probs is not None:
        return draft_probs[i].to(p.device, torch.float32)
    q = torch.zeros_like(p[i])
    q[draft_tokens[i]] = 1.0
    return q


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``, the distribution of the correction after a rejection.

    Module level so a test can substitute a wrong one (e.g. plain ``p``).
    """
    r = (p - q).clamp_(min=0.0)
    total = r.sum()
    # NOTE: all zero only when p <= q everywhere, i.e. p == q, where a rejection has
    # probability 0; fall back to p. torch.where keeps this free of a device sync.
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def _draw(weights: torch.Tensor, state: RequestSamplingState, sampler: Sampler) -> int:
    """One token from ``weights`` ([V], >= 0) by the sampler's exponential race."""
    e = _uniform(weights.shape[0], state, sampler, weights.device).log_().neg_()
    # NOTE: argmax(w / E), E ~ Exp(1), is distributed as w / sum(w) (no normalising needed);
    # U == 0 gives E = inf and w / E = 0, so that token just loses.
    return int(weights.div(e).argmax())


def _uniform(
    n: int, state: RequestSamplingState, sampler: Sampler, device: torch.device
) -> torch.Tensor:
    """``n`` U[0, 1) draws from the request's generator, else the sampler's (as ``Sampler``)."""
    g = state.generator
    if g is not None:
        # Drawn on the generator's own device so a seed means the same stream anywhere.
        return torch.rand(n, generator=g, device=g.device).to(device)
    return torch.rand(n, generator=sampler.generator, device=device)
