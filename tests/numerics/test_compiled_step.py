"""The compiled decode step (fitserve.runner.compiled_step) against the eager one: in fp32 the greedy
tokens must be identical, token for token, for batched and single sequences, dense and packed
weights. Random-weight tiny models (two layers) keep the compiler's time small; the graph is the
same code the default model compiles."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.kernels.cpu.paged_attention import paged_attention_available
from fitserve.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not paged_attention_available(),
                                reason="compiled steps need the C++ paged attention kernel")

PROMPTS = [[5, 17, 99, 3, 250], [42] * 9, [7, 8, 9, 10, 11, 12, 13, 300, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.delta_token_ids)
    return [tokens[rid] for rid in ids]


def greedy_tokens(engine: Engine, batched: bool) -> list[list[int]]:
    if not batched:
        return [run(engine, [p])[0] for p in PROMPTS]
    return run(engine, PROMPTS)


@pytest.mark.parametrize(("arch", "weights"), [("llama", "float32"), ("qwen3", "int4")])
def test_compiled_decode_greedy_tokens_identical_to_eager_fp32(
        tiny_hf_model_dir: Callable[..., Any], arch: str, weights: str) -> None:
    folder: Path = tiny_hf_model_dir(arch)
    cfg = dict(model=str(folder), dtype="float32", device="cpu", weights=weights,
               max_model_len=128, max_num_seqs=4)
    eager = Engine(EngineConfig(**cfg))
    compiled = Engine(EngineConfig(**cfg, enforce_eager=False))
    assert compiled.runner.compiled is not None and eager.runner.compiled is None
    assert set(compiled.runner.compiled.compile_seconds) == {"m1", "m<=16"}  # warmed at start-up
    assert "compile" in compiled.startup_seconds
    for batched in (False, True):
        calls = compiled.runner.compiled.compiled_calls
        want, got = greedy_tokens(eager, batched), greedy_tokens(compiled, batched)
        assert compiled.runner.compiled.compiled_calls > calls + 20  # the decode steps ran it
        assert got == want
