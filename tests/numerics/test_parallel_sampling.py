"""n>1 on one prefill equals the plain unshared algorithm: n separate requests, child j seeded
``seed + j``, each computing the whole prompt on its own blocks (prefix caching off).

The shared run computes the prompt once (counted: ``P`` tokens; every child samples its first
token from those logits), writes the children's next tokens through copy-on-write of the shared
partial block (none when the prompt fills whole blocks), and gives every block back; with
chunked prefill, preemption and caching on or off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.engine.llm import LLM
from fitserve.loading import LoadedModel
from fitserve.sampling import SamplingParams
from fitserve.types import RunnerOutput, SchedulerOutput


def make(loaded: LoadedModel, **kw: Any) -> Engine:
    fields: dict[str, Any] = {"model": str(loaded.path), "dtype": "float32", "device": "cpu",
                              "max_model_len": 256, "num_kv_blocks": 96, "block_size": 8}
    return Engine(EngineConfig(**{**fields, **kw}), loaded=loaded)


def separate(loaded: LoadedModel, prompt: list[int], params: list[SamplingParams]) -> list[list[int]]:
    engine = make(loaded, enable_prefix_caching=False)
    return [next(o for o in engine.stream(prompt, p) if o.finished).token_ids or [] for p in params]


def children(n: int, seed: int | None, **kw: Any) -> list[SamplingParams]:
    base = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 16, "ignore_eos": True, **kw}
    return [SamplingParams(**base, seed=None if seed is None else seed + j) for j in range(n)]


@pytest.mark.parametrize(("n", "prompt_len", "caching", "extra"), [
    (4, 37, True, {}),  # 37 = 4 full blocks + 5: the children share a partial block
    (3, 32, False, {}),  # whole blocks: the first new token starts a fresh block, no copy
    # chunks, and a pool that a request running beside the group (added first) makes preempt
    (4, 50, True, {"max_num_batched_tokens": 16, "num_kv_blocks": 20, "max_model_len": 96}),
])
def test_n_samples_on_one_prefill_equal_separate_requests(
    smollm2_loaded: LoadedModel, n: int, prompt_len: int, caching: bool, extra: dict[str, Any]
) -> None:
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(5, 40000, (prompt_len,), generator=g).tolist()
    params = children(n, seed=11)
    engine = make(smollm2_loaded, enable_prefix_caching=caching, **extra)
    counted = {"prompt": 0, "copies": 0, "shared": 0}
    execute = engine.runner.execute

    def spy(plan: SchedulerOutput, states: Any) -> RunnerOutput:
        counted["prompt"] += sum(max(0, min(c.start_pos + len(c.token_ids), prompt_len) - c.start_pos)
                                 for c in plan.chunks if c.request_id in rids)
        counted["copies"] += len(plan.block_copies)
        counted["shared"] = max(counted["shared"], engine.kv.stats().shared_blocks)
        return execute(plan, states)

    rids = [f"c{j}" for j in range(n)]
    engine.runner.execute = spy  # type: ignore[method-assign]
    if "num_kv_blocks" in extra:
        engine.add_request(list(range(300, 360)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.add_requests(prompt, params, rids)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None
                got[out.request_id] = out.token_ids or []
    assert [got[r] for r in rids] == separate(smollm2_loaded, prompt, params)
    assert counted["shared"] >= prompt_len // 8 - 1
    assert (engine.scheduler.total_preemptions > 0) == ("num_kv_blocks" in extra)
    if engine.scheduler.total_preemptions == 0:
        assert counted["prompt"] == prompt_len  # the prompt once
        assert counted["copies"] == (n - 1 if prompt_len % 8 else 0)
    else:  # preempted children recompute their prompt (from cached blocks where they can)
        assert counted["prompt"] < n * prompt_len
    assert engine.kv.stats().used_blocks == 0


def test_llm_generate_n_is_one_prefill(smollm2_gguf: Path, smollm2_loaded: LoadedModel) -> None:
    llm = LLM(str(smollm2_gguf), dtype="float32", max_model_len=256, num_kv_blocks=96, block_size=8)
    prompt = "The three primary colours are"
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    res = llm.generate(prompt, params)[0]
    ids = llm.tokenizer.encode(prompt)
    assert [o.token_ids for o in res.outputs] == separate(smollm2_loaded, ids, children(3, 5, top_p=1.0, max_tokens=12, temperature=1.0))
    assert llm.engine.kv.stats().prefix_cache_queries == len(ids)  # admitted once, not 3 times


def test_unseeded_children_differ_and_bad_groups_leave_nothing(smollm2_loaded: LoadedModel) -> None:
    engine = make(smollm2_loaded)
    prompt = list(range(200, 230))
    with pytest.raises(ValueError, match="distinct request ids"):
        engine.add_requests(prompt, children(2, None), ["x", "x"])
    with pytest.raises(ValueError, match="more than max_num_seqs"):
        make(smollm2_loaded, max_num_seqs=2).add_requests(prompt, children(3, None))
    assert not engine.has_unfinished_requests()
    rids = engine.add_requests(prompt, children(4, None, temperature=1.5))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids or []
    assert len({tuple(outs[r]) for r in rids}) > 1
    assert engine.kv.stats().used_blocks == 0
