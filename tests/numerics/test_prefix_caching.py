"""Prefix caching changes no output: fp32 greedy tokens with it on equal those with it off.

Tiny random Llama-3, Mistral (sliding window 12, shorter than the shared prefixes, so a hit
feeds windowed attention from cached blocks) and Gemma 3 (sliding and full layers mixed, window
5: a hit feeds both kinds from the same cached blocks) run a workload whose prompts share a system
prefix, repeat one another, extend one another and arrive over time, so later requests hit the
blocks of earlier (running, finished, aborted or preempted) ones. Each case checks it is not
vacuous: hits happened with caching on (none with it off), chunks were split, requests were
preempted or aborted. The default model (SmolLM2) checks that a second request sharing a long
prefix prefills only its suffix.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import LoadedModel, load_model
from fitserve.sampling import SamplingParams
from fitserve.types import RunnerOutput, SchedulerOutput
from tests.gguf_vocab_files import default_hf_tokenizer

from .tiny_models import build_tiny

BLOCK = 8
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    return default_hf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma3"])
def tiny(request, tmp_path_factory, hf_tokenizer) -> LoadedModel:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_tiny(request.param, folder, hf_tokenizer)
    loaded = load_model(folder, dtype=torch.float32)
    if request.param in ("mistral", "gemma3"):
        assert loaded.spec.sliding_window is not None and loaded.spec.sliding_window < 37
    return loaded


def make(loaded: LoadedModel, caching: bool, **kw: Any) -> Engine:
    fields: dict[str, Any] = {"model": str(loaded.path), "dtype": "float32", "device": "cpu",
                              "max_model_len": 160, "num_kv_blocks": 256, "block_size": BLOCK,
                              "enable_prefix_caching": caching}
    return Engine(EngineConfig(**{**fields, **kw}), loaded=loaded)


def workload() -> list[tuple[int, str, list[int]]]:
    """(arrival step, request id, prompt): shared heads, repeats, extensions, a short one."""
    rng = random.Random(7)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 384) for _ in range(n)]

    sys_prompt, q0, q1, q2 = toks(37), toks(5), toks(9), toks(6)  # 37: 4 full blocks + 5
    return [
        (0, "r0", sys_prompt + q0),
        (0, "r1", sys_prompt + q1),
        (3, "r2", sys_prompt + q0),  # identical to r0: the cap recomputes its last block
        (5, "r3", sys_prompt[:20] + toks(12)),  # shares 2 full blocks
        (6, "r4", toks(15)),  # unrelated
        (9, "r5", sys_prompt + q1 + q2),  # extends r1's prompt
        (12, "r6", toks(3)),  # shorter than a block
        (14, "r7", sys_prompt[:16]),  # exactly 2 blocks, all cached: recomputes block 2
        (30, "r8", sys_prompt + q0),  # after r0 and r2 finished: hits evictable blocks
    ]


def drive(engine: Engine, abort_at: dict[str, int] | None = None,
          watch: Callable[[Engine], None] | None = None) -> dict[str, list[int]]:
    """Run the workload (arrivals and aborts at fixed steps); the tokens of each finished one.
    ``watch`` sees the engine after every step."""
    plan = workload()
    abort_at = abort_at or {}
    done: dict[str, list[int]] = {}
    step = 0
    while step <= max(a for a, _, _ in plan) or engine.has_unfinished_requests():
        assert step < 2000, "no progress"
        for arrive, rid, prompt in plan:
            if arrive == step:
                engine.add_request(prompt, GREEDY, request_id=rid)
        for rid, at in abort_at.items():
            if at == step:
                assert engine.abort(rid), f"{rid} had already finished at step {at}"
        for out in engine.step():
            assert out.error is None
            if out.finished:
                done[out.request_id] = out.token_ids  # type: ignore[assignment]
        if watch is not None:
            watch(engine)
        step += 1
    assert engine.kv.stats().used_blocks == 0
    return done


def check_on_equals_off(loaded: LoadedModel, abort_at: dict[str, int] | None = None,
                        watch: Callable[[Engine], None] | None = None,
                        **kw: Any) -> tuple[Engine, Engine]:
    off, on = make(loaded, False, **kw), make(loaded, True, **kw)
    want, got = drive(off, abort_at), drive(on, abort_at, watch)
    assert got == want
    assert len(set(map(tuple, want.values()))) > 3, "vacuous: the prompts give the same tokens"
    assert off.kv.stats().prefix_cache_hits == 0
    assert on.kv.stats().prefix_cache_hits > 0, "vacuous: no prefix-cache hit"
    return off, on


def test_batch_with_shared_prefixes(tiny: LoadedModel) -> None:
    _, on = check_on_equals_off(tiny)
    st = on.kv.stats()
    # blocks 0-3 hold sys[:32], block 4 sys[32:37] + the question's first 3 tokens: r2 and r8
    # (= r0) and r5 (r1's prompt + more) hit 5 blocks each; r3 2 (sys[:16]); r7 (16 tokens,
    # all cached) 1, capped so its second block is recomputed
    assert st.prefix_cache_hits == (5 * 3 + 2 + 1) * BLOCK
    assert st.prefix_cache_queries == sum(len(p) for _, _, p in workload())  # no preemption


@pytest.mark.parametrize("chunk", [3, 7])
def test_chunk_sizes(tiny: LoadedModel, chunk: int) -> None:
    split: list[bool] = []

    def watch(engine: Engine) -> None:
        split.extend(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running)

    _, on = check_on_equals_off(tiny, watch=watch, long_prefill_token_threshold=chunk,
                                max_num_batched_tokens=max(chunk, 10))
    assert any(split), "vacuous: no prompt was ever split into chunks"
    # a request arriving while the prompt it shares is mid-prefill hits the blocks done so far
    assert on.kv.stats().prefix_cache_hits >= (4 + 2) * BLOCK


def test_pool_small_enough_to_preempt(tiny: LoadedModel) -> None:
    # 9 requests of up to 52 + 24 tokens (10 blocks) against 14 blocks: preemption, and
    # readmitted requests may hit their own (or others') evictable blocks
    back_with_hits: set[str] = set()

    def watch(engine: Engine) -> None:
        back_with_hits.update(r.request_id for r in engine.scheduler.running
                              if r.num_preemptions and r.num_cached_tokens)

    # NOTE: Mistral's windowed pool keeps one block as its null block (fitserve.kv.group)
    blocks = 14 + (tiny.spec.sliding_window is not None)
    off, on = check_on_equals_off(tiny, watch=watch, num_kv_blocks=blocks, max_model_len=112)
    assert off.scheduler.total_preemptions > 0 and on.scheduler.total_preemptions > 0
    assert back_with_hits, "vacuous: no preempted request hit cached blocks on its return"
    assert on.kv.pool.num_evictions > 0, "vacuous: the pool never needed a cached block"
    # readmitted requests were looked up again (queries count every admission)
    assert on.kv.stats().prefix_cache_queries > sum(len(p) for _, _, p in workload())


def test_while_others_abort(tiny: LoadedModel) -> None:
    # r1 is aborted before r5 (which extends its prompt) arrives: r5 hits r1's freed blocks
    off, on = check_on_equals_off(tiny, abort_at={"r1": 8, "r4": 10, "r3": 7})
    assert on.kv.stats().prefix_cache_hits >= 4 * BLOCK


def test_streamed_equals_returned(tiny: LoadedModel) -> None:
    on, off = make(tiny, True), make(tiny, False)
    for _, _, prompt in workload():
        outs = {}
        for name, engine in (("on", on), ("off", off)):
            deltas: list[int] = []
            last = None
            for out in engine.stream(prompt, GREEDY):
                deltas.extend(out.delta_token_ids)
                last = out
            assert last is not None and last.finished and deltas == last.token_ids
            outs[name] = deltas
        assert outs["on"] == outs["off"]
    assert on.kv.stats().prefix_cache_hits > 0


def test_generated_tokens_are_reused(tiny: LoadedModel) -> None:
    """A follow-up whose prompt is an earlier request's prompt + output (a chat turn) hits the
    blocks holding the output too."""
    on, off = make(tiny, True), make(tiny, False)
    first = workload()[0][2]
    (out0,) = [o for o in on.stream(first, GREEDY) if o.finished]
    assert out0.token_ids is not None
    follow = first + out0.token_ids[:20] + [5, 6, 7]  # 42 + 20 = 62 known tokens: 7 blocks
    before = on.kv.stats().prefix_cache_hits
    (a,) = [o for o in on.stream(follow, GREEDY) if o.finished]
    (b,) = [o for o in off.stream(follow, GREEDY) if o.finished]
    assert a.token_ids == b.token_ids
    # the first request computed 42 + 23 tokens: 8 full blocks, 7 of them in follow's head
    assert on.kv.stats().prefix_cache_hits - before == 7 * BLOCK


class ChunkLog:
    """Wraps a runner's execute to record (request id, start_pos, number of tokens) per chunk."""

    def __init__(self, engine: Engine) -> None:
        self.chunks: list[tuple[str, int, int]] = []
        inner: Callable[..., RunnerOutput] = engine.runner.execute

        def execute(plan: SchedulerOutput, states: Any) -> RunnerOutput:
            self.chunks.extend((c.request_id, c.start_pos, len(c.token_ids)) for c in plan.chunks)
            return inner(plan, states)

        engine.runner.execute = execute  # type: ignore[method-assign]

    def prefilled(self, rid: str, prompt_len: int) -> int:
        """Prompt tokens of ``rid`` that went through the model."""
        return sum(max(0, min(s + n, prompt_len) - s) for r, s, n in self.chunks if r == rid)


def test_second_request_with_a_long_shared_prefix_prefills_only_its_suffix(tiny: LoadedModel) -> None:
    rng = random.Random(3)
    shared = [rng.randrange(3, 384) for _ in range(100)]
    a, b = shared + [11, 12, 13], shared + [21, 22, 23, 24, 25, 26, 27]
    on, off = make(tiny, True), make(tiny, False)
    log_on, log_off = ChunkLog(on), ChunkLog(off)
    results = {}
    for name, engine in (("on", on), ("off", off)):
        outs = [o for p in (a, b) for o in engine.stream(p, GREEDY) if o.finished]
        results[name] = [o.token_ids for o in outs]
    assert results["on"] == results["off"]
    assert log_off.prefilled("req-1", len(b)) == len(b) == 107
    # 100 shared tokens = 12 full blocks of 8 (96 tokens) cached: only 11 tokens computed
    assert log_on.prefilled("req-1", len(b)) == len(b) - 96 == 11
    assert log_on.prefilled("req-0", len(a)) == len(a)
    st = on.kv.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (len(a) + len(b), 96)


@pytest.mark.slow
def test_default_model_prefills_only_the_suffix(make_engine) -> None:  # type: ignore[no-untyped-def]
    """SmolLM2 (blocks of 16): a long shared chat prefix is computed once."""
    prefix = ("You are a helpful assistant. Answer briefly and precisely. " * 6).strip()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    on, off = make_engine(), make_engine(enable_prefix_caching=False)
    assert on.config.cache.enable_prefix_caching and on.kv.block_size == 16
    log = ChunkLog(on)
    results = {}
    for name, engine in (("on", on), ("off", off)):
        results[name] = [[o for o in engine.stream(f"{prefix}\nQ: {q}\nA:", params) if o.finished][0].token_ids
                         for q in ("What is 2 + 2?", "Name a colour.")]
    assert results["on"] == results["off"] and results["on"][0] != results["on"][1]
    n = len(on.tokenizer.encode(f"{prefix}\nQ: Name a colour.\nA:"))
    hits = on.kv.stats().prefix_cache_hits
    assert hits >= 16 * 3 and hits % 16 == 0
    assert log.prefilled("req-1", n) == n - hits


def test_reset_prefix_cache_makes_the_next_run_compute_everything(tiny: LoadedModel) -> None:
    on = make(tiny, True)
    prompt = workload()[0][2]
    first = [o for o in on.stream(prompt, GREEDY) if o.finished][0].token_ids
    cached = on.kv.stats().evictable_cached_blocks
    # every full block of every KV layer group (a windowed group's too: the blocks it dropped
    # behind its window stay cached, evictable), none held
    assert cached == (len(prompt) + MAX_TOKENS - 1) // BLOCK * len(on.kv.groups)
    assert on.reset_prefix_cache() == cached
    assert on.kv.stats().cached_blocks == 0
    again = [o for o in on.stream(prompt, GREEDY) if o.finished][0].token_ids
    assert again == first and on.kv.stats().prefix_cache_hits == 0
