"""How far a candidate model's next-token distributions are from a reference's, on one text.

Pure functions: logits (or per-position values) in, numbers with confidence intervals out.
Row t of a logits tensor predicts ``targets[t]`` (the text's token t + 1). Per position t:

    KL[t]    = sum_v p_ref(v) (log p_ref(v) - log p_cand(v))    nats; KL(reference || candidate)
    flip[t]  = 1 if argmax_v p_ref != argmax_v p_cand else 0     (llama.cpp's "same top p" = 1 - mean)
    NLL[t]   = -log p(targets[t])  for each model;  perplexity = exp(mean NLL)

Greedy agreement length (teacher-forced, horizon H, default 32): from each start s the number
of consecutive positions s, s+1, ... at which the two argmaxes agree before the first flip,
capped at H; starts s = 0 .. n - H, so every start has a full horizon:

    flip:  0 0 1 0 0 0 1 0        agree[s] = min(H, (first t >= s with flip[t]) - s)
    s=0 -> 2, s=1 -> 1, s=2 -> 0, s=3 -> 3 ...

It is the teacher-forced "acceptance length" of speculative decoding with greedy verification
(vLLM's mean accepted tokens per step, less the bonus token): how many tokens the candidate, used
as a draft, would get accepted from a random point of the text before its first mismatch. A
model against itself gives exactly H.

Every mean comes with a circular block-bootstrap percentile interval (default 95%, blocks of 64
contiguous positions, 2000 resamples, seed 0): neighbouring tokens' errors are correlated, so
resampling single tokens would make the interval too narrow. Two candidates on the same
positions are compared by the same bootstrap of the per-position difference (paired): "real"
when its interval excludes 0, else "noise".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_BLOCK = 64
DEFAULT_RESAMPLES = 2000
DEFAULT_HORIZON = 32
DEFAULT_CONFIDENCE = 0.95
_ROWS = 64  # logits rows taken to float64 at a time (64 x 49152 x 8 B = 25 MB)


@dataclass(frozen=True, slots=True)
class BootstrapConfig:
    """Circular block bootstrap: ``resamples`` resamples of whole blocks of ``block_len``
    contiguous positions (wrapping at the end), percentile interval at ``confidence``."""

    block_len: int = DEFAULT_BLOCK
    resamples: int = DEFAULT_RESAMPLES
    seed: int = 0
    confidence: float = DEFAULT_CONFIDENCE


DEFAULT_BOOTSTRAP = BootstrapConfig()


@dataclass(frozen=True, slots=True)
class Interval:
    """A mean and its bootstrap confidence interval [lo, hi]."""

    mean: float
    lo: float
    hi: float

    def excludes(self, value: float = 0.0) -> bool:
        """Whether ``value`` lies outside [lo, hi]."""
        return self.lo > value or self.hi < value

    def as_dict(self) -> dict[str, float]:
        """``{"mean", "lo", "hi"}`` for JSON."""
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi}


@dataclass(slots=True)
class TokenStats:
    """Per-position values of one candidate against the reference (float64, length n)."""

    kl: torch.Tensor
    flip: torch.Tensor
    nll_ref: torch.Tensor
    nll_cand: torch.Tensor

    def __len__(self) -> int:
        return int(self.kl.shape[0])

    @staticmethod
    def cat(parts: list[TokenStats]) -> TokenStats:
        """The positions of ``parts`` one after the other."""
        if not parts:
            raise ValueError("no token statistics to join")
        return TokenStats(*(torch.cat([getattr(p, f) for p in parts]) for f in
                            ("kl", "flip", "nll_ref", "nll_cand")))


def token_stats(ref_logits: torch.Tensor, cand_logits: torch.Tensor,
                targets: torch.Tensor) -> TokenStats:
    """KL(ref || cand), top-1 flip and both NLLs at each row of ``[n, vocab]`` logits.

    Computed in float64, ``_ROWS`` rows at a time. Identical logits give KL and flip exactly 0
    (the same log-softmax on both sides: every term is p * 0).
    """
    if ref_logits.shape != cand_logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(ref_logits.shape)} vs "
                         f"{tuple(cand_logits.shape)} (different vocabularies?)")
    if targets.shape != ref_logits.shape[:1]:
        raise ValueError(f"{targets.shape[0]} targets for {ref_logits.shape[0]} logits rows")
    parts: list[TokenStats] = []
    for r0 in range(0, ref_logits.shape[0], _ROWS):
        lr = torch.log_softmax(ref_logits[r0:r0 + _ROWS].double(), dim=-1)
        lc = torch.log_softmax(cand_logits[r0:r0 + _ROWS].double(), dim=-1)
        p = lr.exp()
        # NOTE: where p == 0 the term is 0 (not 0 * -inf = nan); where p > 0 and the candidate
        # gives -inf, KL is +inf, as it should be.
        kl = torch.where(p > 0, p * (lr - lc), torch.zeros_like(p)).sum(-1)
        flip = (lr.argmax(-1) != lc.argmax(-1)).double()
        t = targets[r0:r0 + _ROWS].to(lr.device).long().unsqueeze(-1)
        parts.append(TokenStats(kl.cpu(), flip.cpu(), -lr.gather(-1, t).squeeze(-1).cpu(),
                                -lc.gather(-1, t).squeeze(-1).cpu()))
    return TokenStats.cat(parts)


def agreement_lengths(flip: torch.Tensor, horizon: int = DEFAULT_HORIZON) -> torch.Tensor:
    """Teacher-forced greedy agreement from each start (see the module docstring): float64
    ``[n - H + 1]`` with ``H = min(horizon, n)``, each value in 0..H."""
    n = int(flip.shape[0])
    if n == 0:
        raise ValueError("no positions")
    h = min(horizon, n)
    pos = torch.arange(n, dtype=torch.float64)
    flip_at = torch.where(flip.bool(), pos, torch.full_like(pos, float(n)))
    # next flip at or after s: a cumulative minimum from the right
    next_flip = torch.flip(torch.cummin(torch.flip(flip_at, [0]), 0).values, [0])
    return torch.clamp(next_flip - pos, max=float(h))[: n - h + 1]


def effective_block(n: int, block_len: int) -> int:
    """The block length used for ``n`` positions: ``block_len``, but at most n // 4 (so a
    short series still has blocks to resample), and at least 1."""
    return max(1, min(block_len, n // 4))


def bootstrap_means(values: torch.Tensor, cfg: BootstrapConfig = DEFAULT_BOOTSTRAP
                    ) -> torch.Tensor:
    """``cfg.resamples`` means of circular block-bootstrap resamples of ``values`` [n].

    Each resample joins k = ceil(n / L) blocks of L contiguous positions, each starting at a
    uniform random position and wrapping around the end, and takes the mean of its k * L values.
    """
    v = values.double().flatten().cpu()
    n = int(v.shape[0])
    if n == 0:
        raise ValueError("cannot bootstrap an empty series")
    L = effective_block(n, cfg.block_len)
    k = -(-n // L)
    # NOTE: each block's sum from a prefix sum of the series extended by L - 1 (the wrap), so a
    # resample costs k look-ups, not k * L: cheap even for 2000 resamples of 10^5 tokens.
    ext = torch.cat([v, v[: L - 1]])
    csum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(ext, 0)])
    block_sums = csum[L:L + n] - csum[:n]
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(n, (cfg.resamples, k), generator=gen)
    return block_sums[starts].sum(1) / (k * L)


def mean_ci(values: torch.Tensor, cfg: BootstrapConfig = DEFAULT_BOOTSTRAP) -> Interval:
    """The mean of ``values`` with its block-bootstrap percentile interval."""
    means = bootstrap_means(values, cfg)
    alpha = (1.0 - cfg.confidence) / 2
    q = torch.quantile(means, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64))
    mean = float(values.double().mean())
    # NOTE: a constant series can put a percentile an ulp off its mean (prefix-sum rounding);
    # clip so that lo <= mean <= hi always holds (a zero series stays exactly [0, 0]).
    return Interval(mean, min(float(q[0]), mean), max(float(q[1]), mean))


@dataclass(frozen=True, slots=True)
class Summary:
    """Every metric of one candidate against the reference, each with its interval."""

    num_tokens: int
    kl: Interval
    flip_rate: Interval
    ppl_ref: Interval
    ppl_cand: Interval
    agreement: Interval
    horizon: int
    kl_p99: float
    kl_max: float

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: each interval as ``{"mean", "lo", "hi"}``."""
        return {"num_tokens": self.num_tokens, "kl": self.kl.as_dict(),
                "flip_rate": self.flip_rate.as_dict(), "ppl_ref": self.ppl_ref.as_dict(),
                "ppl": self.ppl_cand.as_dict(), "agreement": self.agreement.as_dict(),
                "agreement_horizon": self.horizon, "kl_p99": self.kl_p99, "kl_max": self.kl_max}


def _exp(iv: Interval) -> Interval:
    return Interval(math.exp(iv.mean), math.exp(iv.lo), math.exp(iv.hi))


def summarize(stats: TokenStats, cfg: BootstrapConfig = DEFAULT_BOOTSTRAP,
              horizon: int = DEFAULT_HORIZON) -> Summary:
    """Means and intervals of every metric (perplexity: exp of the NLL mean and its bounds)."""
    agree = agreement_lengths(stats.flip, horizon)
    return Summary(
        num_tokens=len(stats), kl=mean_ci(stats.kl, cfg), flip_rate=mean_ci(stats.flip, cfg),
        ppl_ref=_exp(mean_ci(stats.nll_ref, cfg)), ppl_cand=_exp(mean_ci(stats.nll_cand, cfg)),
        agreement=mean_ci(agree, cfg), horizon=min(horizon, len(stats)),
        kl_p99=float(torch.quantile(stats.kl, 0.99)), kl_max=float(stats.kl.max()))


@dataclass(frozen=True, slots=True)
class Comparison:
    """Candidate A minus candidate B on one metric, paired by position."""

    metric: str
    diff: Interval
    verdict: str  # "real" (the interval excludes 0) or "noise"

    def as_dict(self) -> dict[str, object]:
        """JSON-ready."""
        return {"metric": self.metric, "diff": self.diff.as_dict(), "verdict": self.verdict}


def paired_verdict(a: torch.Tensor, b: torch.Tensor, cfg: BootstrapConfig = DEFAULT_BOOTSTRAP,
                   metric: str = "") -> Comparison:
    """Paired block bootstrap of ``a - b`` (values on the same positions): "real" when the
    interval of the mean difference excludes 0, "noise" otherwise."""
    if a.shape != b.shape:
        raise ValueError(f"paired values must be on the same positions: {a.shape} vs {b.shape}")
    diff = mean_ci(a.double() - b.double(), cfg)
    return Comparison(metric, diff, "real" if diff.excludes(0.0) else "noise")


def compare(a: TokenStats, b: TokenStats, cfg: BootstrapConfig = DEFAULT_BOOTSTRAP,
            horizon: int = DEFAULT_HORIZON) -> dict[str, Comparison]:
    """A vs B (both against the same reference, on the same text) on each metric: KL, flip,
    the candidate's NLL (the perplexity difference, in nats/token) and the agreement length."""
    if len(a) != len(b):
        raise ValueError(f"the candidates were scored on different texts ({len(a)} vs {len(b)})")
    pairs = {"kl": (a.kl, b.kl), "flip_rate": (a.flip, b.flip),
             "nll": (a.nll_cand, b.nll_cand),
             "agreement": (agreement_lengths(a.flip, horizon), agreement_lengths(b.flip, horizon))}
    return {name: paired_verdict(x, y, cfg, name) for name, (x, y) in pairs.items()}
