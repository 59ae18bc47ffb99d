"""Named workloads and the offline driver that times every token of every request.

W1 and W2 are the benchmark's (benchmarks/bench_engine.py ``workload_spec``):

    W1  1 request,   32-token prompt, 128 new tokens     (single-stream decode)
    W2  32 requests, 128-token prompt, 128 new tokens    (a batch: prefill, then batched decode)

Prompts are random token ids from a seeded RNG (the same ids for the same seed and model), so
no tokenizer or text is involved and nothing hits the prefix cache by accident. Generation
ignores EOS, so every request produces exactly its output length.

The driver calls :meth:`Engine.add_request` / :meth:`Engine.step` directly (no HTTP): every
request arrives when it is added (all at the start: an offline batch), and each new token is
stamped with ``time.perf_counter()`` when the step that made it returns.
"""

from __future__ import annotations

import random
import resource
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fitserve.types import StepRecord

if TYPE_CHECKING:
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class Workload:
    """``num_prompts`` requests of ``input_len`` prompt tokens, ``output_len`` new tokens each."""

    name: str
    num_prompts: int
    input_len: int
    output_len: int
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        for label, v in (("num_prompts", self.num_prompts), ("input_len", self.input_len),
                         ("output_len", self.output_len)):
            if v < 1:
                raise ValueError(f"workload {self.name}: {label} must be >= 1, got {v}")

    def describe(self) -> str:
        return (f"{self.name}: {self.num_prompts} request(s) x {self.input_len}-token prompt x "
                f"{self.output_len} new tokens{', ignore_eos' if self.ignore_eos else ''}")


NAMED_WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", 1, 32, 128),
    "W2": Workload("W2", 32, 128, 128),
}


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` random token ids in [4, vocab) from ``random.Random(seed)``.

    NOTE: ids below 4 are skipped: most vocabularies keep pad/bos/eos/unk there.
    """
    rng = random.Random(seed)
    low = min(4, vocab_size - 1)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]


@dataclass(slots=True)
class RequestTiming:
    """One request: when it was added and when each of its tokens came out."""

    request_id: str
    prompt_tokens: int
    arrival: float  # time.perf_counter() when added
    token_times: list[float] = field(default_factory=list)  # one per generated token


@dataclass(slots=True)
class RunResult:
    """A timed run: per-request token times, the steps it ran, wall and CPU time."""

    requests: list[RequestTiming]
    steps: list[StepRecord]
    wall_s: float
    cpu_s: float  # process CPU time (user + system, all threads) during the run
    threads: int  # torch.get_num_threads()
    rejected: int = 0  # prompts --scheduling-policy slo turned away at admission


def _process_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def sampling_params(output_len: int, ignore_eos: bool) -> SamplingParams:
    """Greedy, ``output_len`` new tokens (exactly that many with ``ignore_eos``)."""
    from fitserve.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)


def warm_up(engine: Engine, seed: int = 1234) -> None:
    """A short untimed run first (two 16-token prompts, 4 new tokens each): the first steps pay
    for allocator growth and kernel set-up that a serving engine pays once. Leaves the engine
    idle with an empty prefix cache."""
    prompts = random_prompts(2, min(16, engine.max_model_len - 5), engine.spec.vocab_size, seed)
    params = sampling_params(4, True)
    ids = [engine.add_request(p, params) for p in prompts]
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.reset_prefix_cache()


def run_workload(engine: Engine, workload: Workload, prompts: list[list[int]]) -> RunResult:
    """Add every prompt now, step until all finish; the tokens' times and the steps' records."""
    import torch

    params = sampling_params(workload.output_len, workload.ignore_eos)
    first_step = engine.num_steps
    cpu0, t0 = _process_cpu_s(), time.perf_counter()
    from fitserve.sched.slo import AdmissionRejected

    timings: dict[str, RequestTiming] = {}
    rejected = 0
    for p in prompts:
        arrival = time.perf_counter()
        try:
            rid = engine.add_request(p, params)
        except AdmissionRejected:  # predicted to miss its TTFT target: not run, counted
            rejected += 1
            continue
        timings[rid] = RequestTiming(rid, len(p), arrival)
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}") from out.error
                timing = timings.get(out.request_id)
                if timing is not None:
                    timing.token_times.extend([now] * len(out.delta_token_ids))
    finally:
        wall, cpu = time.perf_counter() - t0, _process_cpu_s() - cpu0
        for rid in timings:
            engine.abort(rid)
    steps = [r for r in engine.step_log if r.index > first_step]
    return RunResult(list(timings.values()), steps, wall, cpu, torch.get_num_threads(), rejected)
