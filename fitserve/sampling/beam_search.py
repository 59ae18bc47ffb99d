"""Beam search over shared KV blocks: the parameters and the per-step choice. Torch-free.

The engine runs every live beam of a group as a request of its own, one token per step, in the
same steps as everything else. When every live beam has its top ``2 x beam_width`` next-token
logprobs, :meth:`BeamGroup.advance` picks the group's next beams; the engine applies the choice
to the scheduler, prunes first, then forks, then extends::

    width 2, live a (cum -1.0), b (cum -1.2)        candidates (cum + logprob)
      a: t5 -0.1, t7 -0.9    b: t5 -0.2, t2 -0.3    a+t5 -1.1, b+t5 -1.4, b+t2 -1.5, a+t7 -1.9
    chosen: a+t5, b+t5     ->  a extends in place with t5, b with t5 (no fork, no prune)
    chosen: a+t5, a+t7     ->  prune b (its blocks' refs drop), fork a -> c, a += t5, c += t7

A fork shares the parent's whole block table; the first to write the shared partial block gets a
copy (copy-on-write) and the last holder writes it in place. Pruning first means a beam whose
siblings all died writes with no copy at all.

Selection follows transformers' ``generate(num_beams=k)`` (the reference the tests use): the
candidates are ranked by cumulative logprob; an EOS candidate ranked within the first
``beam_width`` ends a hypothesis (unless ``ignore_eos``), the best ``beam_width`` others go on.
A hypothesis scores ``cum_logprob / generated_len ** length_penalty`` (the EOS counted, as in
transformers); the search ends at ``max_tokens`` or, with ``beam_width`` hypotheses done, once
the best live beam's score is no better than the worst of them (transformers' default
``early_stopping=False`` heuristic). The result is the ``beam_width`` best hypotheses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from fitserve.types import BeamSequence, FinishReason


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams are kept and returned."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")


def beam_score(cum_logprob: float, num_tokens: int, length_penalty: float) -> float:
    """The ranking key of a hypothesis with ``num_tokens`` generated tokens.

    NOTE: any finite ``length_penalty`` is valid (as in vLLM), so ``len ** lp`` may overflow to
    infinity or underflow to 0; the score then takes its limit (0, or -inf for a hypothesis
    with a negative cumulative logprob) instead of raising.
    """
    try:
        denom = float(max(num_tokens, 1)) ** length_penalty
    except OverflowError:
        denom = math.inf
    if denom == 0.0:
        return 0.0 if cum_logprob == 0.0 else math.copysign(math.inf, cum_logprob)
    return cum_logprob / denom


@dataclass(slots=True)
class _Beam:
    cum_logprob: float
    token_ids: list[int]  # the scheduler's own output list of this beam (it appends to it)


@dataclass(slots=True)
class BeamStep:
    """What one :meth:`BeamGroup.advance` decided, for the engine to apply in this order."""

    pruned: list[str]  # live beams with no continuation: finish them (frees their blocks)
    forks: list[tuple[str, str, int]]  # (parent id, new beam id, its token): fork, then append
    extended: list[tuple[str, int]]  # (beam id, token): appended in place
    done: bool  # the search is over: finish every beam still live


@dataclass(slots=True)
class BeamGroup:
    """One beam-search request: its live beams (request ids), their scores, the hypotheses."""

    group_id: str
    params: BeamSearchParams
    max_tokens: int  # params.max_tokens, capped by the room max_model_len leaves
    eos_token_ids: frozenset[int]
    live: dict[str, _Beam] = field(default_factory=dict)
    pending: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    completed: list[BeamSequence] = field(default_factory=list)
    num_generated: int = 0
    _next_id: int = 0

    @property
    def num_candidates(self) -> int:
        """Top logprobs each beam reports per step."""
        return 2 * self.params.beam_width

    def new_beam_id(self) -> str:
        beam_id = f"{self.group_id}.beam{self._next_id}"
        self._next_id += 1
        return beam_id

    def add_beam(self, beam_id: str, token_ids: list[int], cum_logprob: float = 0.0) -> None:
        self.live[beam_id] = _Beam(cum_logprob, token_ids)

    def record(self, beam_id: str, top: Iterable[tuple[int, float]]) -> None:
        """A beam's top next tokens (token id, logprob) from this step's forward."""
        if beam_id not in self.live:
            raise KeyError(f"{beam_id!r} is not a live beam of {self.group_id!r}")
        self.pending[beam_id] = list(top)

    @property
    def ready(self) -> bool:
        """Every live beam has reported: the next tokens can be chosen."""
        return len(self.pending) == len(self.live) and all(b in self.pending for b in self.live)

    def advance(self) -> BeamStep:
        """Choose the next beams from the recorded candidates; updates scores and hypotheses."""
        if not self.ready:
            raise RuntimeError(f"beam group {self.group_id!r} advanced before every beam reported")
        width, lp = self.params.beam_width, self.params.length_penalty
        order = {b: i for i, b in enumerate(self.live)}
        cands = [(beam.cum_logprob + logprob, order[b], tok, b)
                 for b, beam in self.live.items() for tok, logprob in self.pending[b]]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))  # ties: older beam, lower token id
        length = self.num_generated + 1
        chosen: list[tuple[float, int, int, str]] = []
        for rank, c in enumerate(cands):
            if len(chosen) == width:
                break
            cum, _, tok, b = c
            if not self.params.ignore_eos and tok in self.eos_token_ids:
                if rank < width:
                    self.completed.append(BeamSequence(
                        [*self.live[b].token_ids, tok], cum, beam_score(cum, length, lp),
                        FinishReason.STOP, stop_reason=tok))
                continue
            chosen.append(c)
        self.pending.clear()
        self.num_generated = length
        step = BeamStep(pruned=[b for b in self.live if b not in {c[3] for c in chosen}],
                        forks=[], extended=[], done=False)
        new_live: dict[str, _Beam] = {}
        taken: set[str] = set()
        for cum, _, tok, b in chosen:  # best first: the new beams' order
            parent = self.live[b]
            if b not in taken:
                taken.add(b)
                step.extended.append((b, tok))
                new_live[b] = _Beam(cum, parent.token_ids)  # the scheduler appends tok to it
            else:
                child = self.new_beam_id()
                step.forks.append((b, child, tok))
                new_live[child] = _Beam(cum, [*parent.token_ids, tok])
        self.live = new_live
        step.done = self._finished()
        return step

    def _finished(self) -> bool:
        if not self.live or self.num_generated >= self.max_tokens:
            return True
        width, lp = self.params.beam_width, self.params.length_penalty
        if len(self.completed) < width:
            return False
        worst_done = sorted((h.score for h in self.completed), reverse=True)[width - 1]
        best_live = max(b.cum_logprob for b in self.live.values())
        return worst_done >= beam_score(best_live, self.num_generated, lp)

    def results(self) -> list[BeamSequence]:
        """The ``beam_width`` best hypotheses, best first; the beams still live at the end
        count (finish reason ``length``) when the search ran to ``max_tokens``."""
        hyps = list(self.completed)
        if self.num_generated >= self.max_tokens:
            lp = self.params.length_penalty
            hyps += [BeamSequence(list(b.token_ids), b.cum_logprob,
                                  beam_score(b.cum_logprob, len(b.token_ids), lp), FinishReason.LENGTH)
                     for b in self.live.values()]
        hyps.sort(key=lambda h: -h.score)
        return hyps[: self.params.beam_width]

