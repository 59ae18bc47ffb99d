"""Scheduling policies and the SLO rules: what the TPOT target caps, what TTFT admission predicts.

Three policies (``--scheduling-policy``, vLLM's names plus ``slo``):

- ``fcfs``: running requests oldest first, the queue first come first served;
- ``priority``: requests in ``(priority, arrival)`` order, lower value first (vLLM's), in the
  queue and among the running; the running request last in that order is preempted first;
- ``slo``: fcfs order plus two rules driven by the step-time model
  (:class:`fitserve.ledger.step_time.StepTimeModel`) and the TTFT/TPOT targets.

**Rule 1, the chunk cap.** A step that carries decodes must finish within the tightest TPOT
target among them. Decodes always run; the tokens of prompt chunks in that step are capped at
the most the model says still fit::

    cap = max(min_prefill_tokens, max x: t(decodes + x tokens, decodes + 1 seqs,
                                            kv_decodes + x) <= tpot)

``min_prefill_tokens`` (one block) keeps the queue moving when the decodes alone fill the
target; with no decode in the step there is nothing to protect and the budget is whole.

**Rule 2, admission.** When a request arrives, its TTFT is predicted from the prompt tokens
queued ahead of it (prompt chunks of running requests, then on-time waiting requests, then its
own prompt) drained at the capped rate, plus the wait for a free seat when ``max_num_seqs`` is
taken::

    backlog = remaining prompt tokens of running requests still prefilling
              + every on-time waiting request's tokens + its own prompt
    decodes = the running decodes plus every request ahead of it (they will be decoding by
              then), at most max_num_seqs - 1; cap = rule 1 for those decodes
    ttft    = seat_wait + full x t(cap) + t(rest)      (full, rest = divmod(backlog, cap);
              t(x) = t(decodes + x tokens, decodes + 1 seqs, kv of the decodes + x))
    seat_wait = 0 if a seat is free, else (fewest steps any running request has left to its
                max_tokens) x t(the running decodes' step)

**Rule 3, TPOT admission.** The decode batch itself must fit the TPOT target: a request is
admitted only if a step decoding every running and on-time queued request plus it (at most
``max_num_seqs``; contexts as they are now), beside the minimum prompt chunk, is predicted
within the tightest TPOT target among them::

    t(B + min_prefill tokens, B + 1 seqs, kv of the B + min_prefill) <= tpot

Without it a TTFT-only rule keeps admitting until the decodes alone overrun every step.

A request whose predicted TTFT or decode step exceeds its target is **rejected**
(``slo_action="reject"``:
:class:`AdmissionRejected`, a 429 with Retry-After on the server) or **deprioritised**
(``"deprioritize"``: it waits behind every on-time request and is not counted in their
backlog). With ``deprioritize``, a waiting request that has already waited longer than its
target is moved behind the on-time ones too. Accepted requests are never dropped.

Every rule predicts with the step-time model scaled by a running measured/predicted ratio
(:meth:`SLOController.observe`, fed by the engine after each step), so a model fitted on an
idle engine stays honest under serving load.

Torch-free: the scheduler calls these with exact numbers, tests use a fake clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from fitserve.config import SLOTargets
from fitserve.ledger.step_time import StepShape, StepTimeModel
from fitserve.sched.request import SchedRequest
from fitserve.types import SchedulerOutput

CORRECTION_WEIGHT = 0.2  # of each new measured/predicted ratio in the running correction
CORRECTION_MIN, CORRECTION_MAX = 0.5, 4.0


class AdmissionRejected(RuntimeError):
    """A request the ``slo`` policy turned away: its predicted TTFT, or the decode step it would
    join, misses its target (``target`` is "TTFT" or "TPOT").

    Not a ValueError: the request is valid, the server is busy (HTTP 429, not 400).
    """

    def __init__(self, request_id: str, target: str, predicted_s: float, target_s: float,
                 retry_after_s: float) -> None:
        self.request_id = request_id
        self.target = target
        self.predicted_s = predicted_s
        self.target_s = target_s
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        why = (f"would start after ~{predicted_s * 1e3:.0f} ms (queued prompt tokens ahead of it)"
               if target == "TTFT" else
               f"would make each decode step ~{predicted_s * 1e3:.0f} ms (the sequences running "
               "and queued, with it)")
        super().__init__(f"request {request_id!r} {why}, past its {target} target of "
                         f"{target_s * 1e3:.0f} ms; retry in {self.retry_after_s} s")


def step_shape(out: SchedulerOutput) -> StepShape:
    """The step-time model's view of a planned step: tokens, sequences, cached tokens read."""
    return StepShape(
        new_tokens=sum(len(c.token_ids) for c in out.chunks),
        seqs=len(out.chunks),
        kv_tokens_read=sum(c.start_pos + len(c.token_ids) for c in out.chunks),
    )


def prefill_cap(model: StepTimeModel, tpot_s: float, *, decode_tokens: int, decode_seqs: int,
                decode_kv: int, min_prefill_tokens: int) -> int:
    """Rule 1: prompt-chunk tokens a step with these decodes may add within ``tpot_s``."""
    fit = model.max_new_tokens(tpot_s, new_tokens=decode_tokens, seqs=decode_seqs,
                               kv_tokens_read=decode_kv)
    return max(min_prefill_tokens, fit)


def predict_ttft(model: StepTimeModel, *, backlog_tokens: int, cap: int, decode_tokens: int,
                 decode_seqs: int, decode_kv: int, seat_wait_s: float = 0.0) -> float:
    """Rule 2: seconds until a request's last prompt token is computed (its first token).

    The backlog drains ``cap`` tokens per step beside the decodes; the last step carries the
    remainder: ``seat_wait_s + full x t(cap) + t(rest)`` with
    ``t(x) = t(decodes + x, decodes + 1, kv + x)``.
    """
    cap = max(1, cap)

    def step_s(x: int) -> float:
        return model.predict(decode_tokens + x, decode_seqs + 1, decode_kv + x)

    full, rest = divmod(max(0, backlog_tokens), cap)
    return seat_wait_s + full * step_s(cap) + (step_s(rest) if rest else 0.0)


class SLOController:
    """The ``slo`` policy's two rules over the scheduler's running list and queue (see the
    module docstring). The scheduler owns the lists; this only reads them and marks requests.
    """

    def __init__(self, targets: SLOTargets, *, max_num_batched_tokens: int, max_num_seqs: int,
                 min_prefill_tokens: int, step_model: StepTimeModel | None = None) -> None:
        self.targets = targets
        self.step_model = step_model
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.min_prefill_tokens = min_prefill_tokens
        self.num_rejected = 0
        self.num_deprioritized = 0
        # measured / predicted step time, a running average: the rules use the model scaled by it
        self.correction = 1.0
        self._scaled: tuple[StepTimeModel, float, StepTimeModel] | None = None

    def _model(self) -> StepTimeModel:
        """The step-time model scaled by the measured correction (see :meth:`observe`)."""
        m = self.step_model
        if m is None:
            raise RuntimeError("the slo scheduling policy needs a step-time model (Scheduler.step_model)")
        k = self.correction
        if k == 1.0:
            return m
        if self._scaled is None or self._scaled[0] is not m or self._scaled[1] != k:
            self._scaled = (m, k, StepTimeModel(m.a * k, m.b * k, m.c * k, m.d * k, m.source))
        return self._scaled[2]

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Feed one step's measured time (start to the next step's start while the engine is
        busy: what a streaming client waits per token) back into the correction::

            correction <- (1 - CORRECTION_WEIGHT) correction + CORRECTION_WEIGHT x measured / predicted

        clamped to [CORRECTION_MIN, CORRECTION_MAX].

        NOTE: a model calibrated on an idle engine under-predicts a serving one (the HTTP side
        and the clients share the cores, the GIL and the memory bus); the ratio is the cheap,
        honest fix, and the server reports it (fitserve_slo_step_time_correction).
        """
        if self.step_model is None or seconds <= 0:
            return
        predicted = self.step_model.predict_shape(shape)
        if predicted <= 0:
            return
        ratio = seconds / predicted
        k = (1 - CORRECTION_WEIGHT) * self.correction + CORRECTION_WEIGHT * ratio
        self.correction = min(CORRECTION_MAX, max(CORRECTION_MIN, k))

    def tpot_of(self, req: SchedRequest) -> float | None:
        """The TPOT the rules plan for: the request's (or the server's) target x headroom."""
        t = req.slo_tpot_s if req.slo_tpot_s is not None else self.targets.tpot_s
        return None if t is None else t * self.targets.headroom

    def ttft_of(self, req: SchedRequest) -> float | None:
        """The TTFT the rules plan for: the request's (or the server's) target x headroom."""
        t = req.slo_ttft_s if req.slo_ttft_s is not None else self.targets.ttft_s
        return None if t is None else t * self.targets.headroom

    @staticmethod
    def decoding(running: Sequence[SchedRequest]) -> list[SchedRequest]:
        """Running requests whose next chunk is one token (plus its drafts)."""
        return [r for r in running if r.num_tokens - r.num_computed_tokens == 1]

    def _cap(self, tpot: float | None, tokens: int, seqs: int, kv: int) -> int:
        if tpot is None or seqs == 0:
            return self.max_num_batched_tokens
        cap = prefill_cap(self._model(), tpot, decode_tokens=tokens, decode_seqs=seqs,
                          decode_kv=kv, min_prefill_tokens=self.min_prefill_tokens)
        return min(cap, self.max_num_batched_tokens)

    def prefill_cap(self, running: Sequence[SchedRequest]) -> int | None:
        """Rule 1 for this step: prompt-chunk tokens allowed, None for no cap."""
        dec = self.decoding(running)
        tpots = [t for r in dec if (t := self.tpot_of(r)) is not None]
        if not dec or not tpots:
            return None
        tokens = sum(1 + len(r.spec_token_ids) for r in dec)
        kv = sum(r.num_tokens + len(r.spec_token_ids) for r in dec)
        return self._cap(min(tpots), tokens, len(dec), kv)

    def predict(self, req: SchedRequest, running: Sequence[SchedRequest],
                waiting: Iterable[SchedRequest]) -> float:
        """Rule 2: the TTFT a request arriving now would see (seconds)."""
        ahead = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        ahead += [r for r in waiting if not r.late]
        backlog = sum(r.num_tokens - r.num_computed_tokens for r in ahead) + req.num_tokens
        dec = self.decoding(running)
        # by the time its prompt runs, the requests ahead of it are decoding too
        members = [*dec, *ahead][: self.max_num_seqs - 1]
        seqs = len(members)
        kv = sum(r.num_tokens for r in members)
        tpots = [t for r in (*members, req) if (t := self.tpot_of(r)) is not None]
        cap = self._cap(min(tpots) if tpots else None, seqs, seqs, kv)
        seats = sum(r.seats for r in running) + sum(r.seats for r in ahead if r not in running)
        seat_wait_s = 0.0
        if seats + req.seats > self.max_num_seqs and running:
            steps = min(max(1, r.max_tokens - len(r.output_token_ids)) for r in running)
            seat_wait_s = steps * self._model().predict(len(dec), len(dec), sum(r.num_tokens for r in dec))
        return predict_ttft(self._model(), backlog_tokens=backlog, cap=cap, decode_tokens=seqs,
                            decode_seqs=seqs, decode_kv=kv, seat_wait_s=seat_wait_s)

    def decode_step_with(self, req: SchedRequest, running: Sequence[SchedRequest],
                         waiting: Iterable[SchedRequest]) -> float:
        """Rule 3: a decode step of every running and on-time queued request plus this one
        (at most max_num_seqs), with the minimum prompt chunk beside it (seconds)."""
        seqs, kv = req.seats, req.seats * req.num_tokens  # n > 1: every sample decodes
        for r in (*running, *(r for r in waiting if not r.late)):
            if seqs + r.seats > self.max_num_seqs:
                break
            seqs, kv = seqs + r.seats, kv + r.seats * r.num_tokens
        x = self.min_prefill_tokens
        return self._model().predict(seqs + x, seqs + 1, kv + x)

    def admit(self, req: SchedRequest, running: Sequence[SchedRequest],
              waiting: Iterable[SchedRequest]) -> None:
        """Rules 2 and 3: reject the request (AdmissionRejected) or mark it late if its TTFT or
        the decode step it joins would miss its target. Changes nothing else."""
        waiting = list(waiting)
        miss: tuple[str, float, float, float] | None = None
        ttft = self.ttft_of(req)
        if ttft is not None:
            req.predicted_ttft_s = predicted = self.predict(req, running, waiting)
            if predicted > ttft:
                miss = ("TTFT", predicted, ttft, predicted - ttft)
        # the tightest TPOT target among the sequences it would decode beside, its own included
        tpots = [t for r in (req, *running, *(w for w in waiting if not w.late))
                 if (t := self.tpot_of(r)) is not None]
        tpot = min(tpots) if tpots else None
        if miss is None and tpot is not None:
            step = self.decode_step_with(req, running, waiting)
            if step > tpot:
                # a seat in the batch frees when the running request closest to done ends
                left = min((max(1, r.max_tokens - len(r.output_token_ids)) for r in running), default=1)
                miss = ("TPOT", step, tpot, left * tpot)
        if miss is None:
            return
        if self.targets.action == "reject":
            self.num_rejected += 1
            what, predicted, planned, wait = miss
            raise AdmissionRejected(req.request_id, what, predicted, planned / self.targets.headroom, wait)
        req.late = True
        self.num_deprioritized += 1

    def mark_overdue(self, waiting: Iterable[SchedRequest], now: float) -> bool:
        """``deprioritize``: requests never started that already waited past their TTFT target
        become late. True when any changed (the queue must be re-sorted)."""
        if self.targets.action != "deprioritize":
            return False
        changed = False
        for r in waiting:
            target = r.slo_ttft_s if r.slo_ttft_s is not None else self.targets.ttft_s
            if (not r.late and r.num_computed_tokens == 0 and r.num_preemptions == 0
                    and target is not None and now - r.arrival_time > target):
                r.late = True
                self.num_deprioritized += 1
                changed = True
        return changed
