"""Synthetic workloads generated locally: prompt/output length distributions and arrivals.

No dataset and no tokenizer are needed: a prompt of ``k`` tokens is ``k`` common English words,
each of which is one token (with its leading space) in the usual BPE vocabularies, so lengths
are close to exact for any model behind the endpoint.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

_WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "it", "his", "he", "by", "at", "from", "are", "this", "be", "or", "an", "not", "which", "have", "had", "one", "but", "were", "they", "all", "their", "there", "been", "has", "when", "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about", "into", "than", "them", "can", "only", "other", "new", "some", "time", "could", "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because", "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being", "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came", "right", "used", "take", "three"]


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution: ``fixed:N``, ``uniform:LO:HI`` or ``chat[:MEDIAN:MAX]``.

    ``chat`` is long-tailed like real chat traffic: log-normal with the given median (sigma 1),
    clipped to [1, MAX], so most requests are short and a few are many times the median.
    """

    kind: str
    a: int
    b: int = 0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = text.strip().lower().split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                return cls("fixed", _positive(int(parts[1])))
            if parts[0] == "uniform" and len(parts) == 3:
                lo, hi = _positive(int(parts[1])), _positive(int(parts[2]))
                if lo > hi:
                    raise ValueError
                return cls("uniform", lo, hi)
            if parts[0] == "chat" and len(parts) in (1, 3):
                median, top = (int(parts[1]), int(parts[2])) if len(parts) == 3 else (128, 2048)
                return cls("chat", _positive(median), _positive(top))
            if parts[0].isdigit() and len(parts) == 1:
                return cls("fixed", _positive(int(parts[0])))
        except ValueError:
            pass
        raise ValueError(f"not a length distribution: {text!r} (use fixed:N, uniform:LO:HI or chat[:MEDIAN:MAX])")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.randint(self.a, self.b)
        return max(1, min(self.b, round(rng.lognormvariate(math.log(self.a), 1.0))))

    def __str__(self) -> str:
        return {"fixed": f"fixed:{self.a}", "uniform": f"uniform:{self.a}:{self.b}"}.get(
            self.kind, f"chat:{self.a}:{self.b}")


def _positive(n: int) -> int:
    if n < 1:
        raise ValueError
    return n


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload."""

    prompt: str
    prompt_tokens: int  # intended length (one word per token)
    max_tokens: int


def make_prompt(num_tokens: int, rng: random.Random) -> str:
    """``num_tokens`` words; a random numeric prefix defeats prefix caches between requests."""
    words = [str(rng.randint(0, 9))] + [rng.choice(_WORDS) for _ in range(max(0, num_tokens - 1))]
    return " ".join(words)


def make_workload(n: int, prompt_len: LengthDist, output_len: LengthDist, seed: int = 0) -> list[BenchRequest]:
    """``n`` requests with lengths drawn from the two distributions (reproducible by seed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, o = prompt_len.sample(rng), output_len.sample(rng)
        out.append(BenchRequest(make_prompt(p, rng), p, o))
    return out


@dataclass(frozen=True, slots=True)
class Arrivals:
    """When requests start: ``poisson`` or ``constant`` at ``rate`` req/s, or closed-loop
    ``concurrency`` (each of C workers sends its next request when the previous one ends)."""

    mode: str  # "poisson" | "constant" | "concurrency"
    rate: float = 0.0
    concurrency: int = 1

    def gaps(self, rng: random.Random) -> float:
        """Seconds until the next arrival (open-loop modes)."""
        if self.mode == "poisson":
            return rng.expovariate(self.rate)
        return 1.0 / self.rate
