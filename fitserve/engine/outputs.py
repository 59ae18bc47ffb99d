"""One request's output stream: detokenize, apply stop conditions, build each RequestOutput.

The engine keeps a :class:`Tracked` per request; after each step it calls
:func:`advance_output` with the request's new token and, when the output says ``finished``,
frees the request's blocks. Nothing here touches the scheduler or the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fitserve.loading import IncrementalDetokenizer
from fitserve.sampling import RequestSamplingState, SamplingParams
from fitserve.sampling.stop import StopDecision, check_stop, find_stop_string
from fitserve.sched.request import SchedRequest
from fitserve.types import FinishReason, RequestOutput, TokenLogprobs


@dataclass(slots=True)
class Tracked:
    """Engine-side state of one request (the scheduler holds the token-level state)."""

    sched: SchedRequest
    params: SamplingParams
    sampling: RequestSamplingState
    detok: IncrementalDetokenizer
    max_tokens: int
    arrival_time: float
    pieces: list[str] = field(default_factory=list)  # text released so far, joined at the end
    held: str = ""  # text produced but held back: it might still become a stop string
    sent_tokens: int = 0  # output tokens (and logprobs) already reported in a delta
    logprobs: list[TokenLogprobs] | None = None
    # prompt_logprobs: one entry per prompt token (None first); shared by an n>1 group
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    first_token_time: float | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, and accepted
    num_accepted_tokens: int = 0
    speculates: bool = False  # gets draft tokens (speculative decoding on, and can_speculate)


def can_speculate(p: SamplingParams) -> bool:
    """Whether a request's tokens may come from verified drafts: not with penalties (the
    target distribution at a draft position would depend on which earlier drafts held), a
    grammar (its mask moves with each token too) or logit bias (the verifier's distribution
    has none), nor logprobs (one logprobs entry per step), nor vLLM's token masks
    (allowed_token_ids, bad_words, min_tokens: the verifier's distribution has none)."""
    return (p.logprobs is None and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0 and p.guided is None and not p.logit_bias
            and not p.allowed_token_ids and not p.bad_words and not p.min_tokens)


def failed_output(rid: str, t: Tracked, exc: Exception, now: float) -> RequestOutput:
    """The final output of a request that failed inside a step (its blocks are the caller's)."""
    tokens = t.sched.output_token_ids
    return RequestOutput(
        request_id=rid,
        prompt_token_ids=t.sched.prompt_token_ids,
        delta_token_ids=[],
        delta_text="",
        delta_logprobs=[] if t.logprobs is not None else None,
        finished=True,
        num_output_tokens=len(tokens),
        token_ids=list(tokens),
        text="".join(t.pieces),
        logprobs=t.logprobs,
        finish_reason=FinishReason.ERROR,
        error=exc,
        arrival_time=t.arrival_time,
        first_token_time=t.first_token_time,
        finish_time=now,
    )


def advance_output(rid: str, t: Tracked, new_tokens: list[int], now: float, *, max_model_len: int,
                   eos_token_ids: tuple[int, ...]) -> RequestOutput:
    """Take the request's new tokens (already appended to its outputs; several when
    speculative decoding accepted drafts): release their text, held back where a stop string
    might still begin, and finish it on the first stop condition (outputs past it are cut).

    A guided request's grammar state consumes each token first (GuidedDecodingError if the
    grammar refuses it: the caller fails the request); a grammar that is complete (stopped)
    finishes the request with finish_reason stop and no stop_reason."""
    if t.first_token_time is None:
        t.first_token_time = now
    outputs = t.sched.output_token_ids
    base, total_base = len(outputs) - len(new_tokens), t.sched.num_tokens - len(new_tokens)
    # Stop strings are searched in the held-back tail plus the new text: the tail holds the
    # last (longest stop - 1) characters, so any match that ends in a new delta lies inside.
    window = t.held
    p = t.params
    decision: StopDecision | None = None
    guide = t.sampling.guide
    for i, token in enumerate(new_tokens):
        if guide is not None:
            guide.advance(token)
        delta = t.detok.push(token)
        window += delta
        decision = check_stop(
            token_id=token,
            num_output_tokens=base + i + 1,
            max_tokens=t.max_tokens,
            num_total_tokens=total_base + i + 1,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids,
            stop_token_ids=p.stop_token_ids,
            ignore_eos=p.ignore_eos,
            text=window,
            new_text_len=len(delta),
            stop_strings=[p.stop] if isinstance(p.stop, str) else (p.stop or []),
            include_stop_str=p.include_stop_str_in_output,
            min_tokens=p.min_tokens,
        )
        if decision is None and guide is not None and guide.is_stopped:
            decision = StopDecision(FinishReason.STOP, None)
        if decision is not None:
            del outputs[base + i + 1:]  # tokens emitted past the stop are not output
            break
    if decision is not None and decision.text_end is None:
        decision, window = _flush(t, decision, window)
    finished = decision is not None
    if decision is not None and decision.text_end is not None:
        window = window[: decision.text_end]
    # Streaming holds back a tail that might still become a stop string.
    holdback = 0 if finished or not p.stop else max(len(s) for s in p.stop) - 1
    cut = max(len(window) - holdback, 0)
    released, t.held = window[:cut], window[cut:]
    if released:
        t.pieces.append(released)
    tokens = t.sched.output_token_ids
    lps = t.logprobs
    out = RequestOutput(
        request_id=rid,
        prompt_token_ids=t.sched.prompt_token_ids,
        delta_token_ids=tokens[t.sent_tokens :],
        delta_text=released,
        delta_logprobs=lps[t.sent_tokens :] if lps is not None else None,
        finished=finished,
        num_output_tokens=len(tokens),
        num_cached_tokens=t.sched.num_cached_tokens,
        arrival_time=t.arrival_time,
        first_token_time=t.first_token_time,
        num_draft_tokens=t.num_draft_tokens,
        num_accepted_tokens=t.num_accepted_tokens,
    )
    if t.prompt_logprobs is not None and (t.sent_tokens == 0 or decision is not None):
        out.prompt_logprobs = _own_prompt_logprobs(t)
    t.sent_tokens = len(tokens)
    if decision is not None:
        out.finish_reason, out.stop_reason, out.finish_time = decision.reason, decision.stop_reason, now
        out.token_ids, out.text, out.logprobs = list(tokens), "".join(t.pieces), lps
    return out


def _own_prompt_logprobs(t: Tracked) -> list[TokenLogprobs | None]:
    """The group's prompt logprobs with this request's own number of alternatives."""
    assert t.prompt_logprobs is not None
    n = t.params.prompt_logprobs or 0
    return [e if e is None or len(e.top) <= n else
            TokenLogprobs(e.token_id, e.logprob, e.rank, e.top[:n]) for e in t.prompt_logprobs]


def _flush(t: Tracked, decision: StopDecision, window: str) -> tuple[StopDecision, str]:
    """At the end, take the text the detokenizer held back (a character cut short by the
    last token), still subject to stop strings: a stop string in it ends the text there."""
    tail = t.detok.finish()
    if not tail:
        return decision, window
    window += tail
    stops = [t.params.stop] if isinstance(t.params.stop, str) else t.params.stop
    if stops:
        hit = find_stop_string(window, len(tail), stops, t.params.include_stop_str_in_output)
        if hit is not None:
            return StopDecision(FinishReason.STOP, hit[0], text_end=hit[1]), window
    return decision, window
