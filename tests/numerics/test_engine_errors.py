"""Bad input gets a clear error, changes nothing, and never disturbs the other requests."""

from __future__ import annotations

import pytest

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import ModelLoadError
from fitserve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPT = "The history of the printing press begins"


def _run(engine: Engine, rid: str) -> list[int]:
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.token_ids


BAD_CALLS = [
    ("prompt longer than max_model_len", lambda e: e.add_request([5] * 300, GREEDY), "max_model_len=256"),
    ("empty prompt", lambda e: e.add_request("", GREEDY), "empty"),
    ("token id out of range", lambda e: e.add_request([1, 2, 10**6], GREEDY), "out of range"),
    ("negative token id", lambda e: e.add_request([-1], GREEDY), "out of range"),
    ("duplicate id", lambda e: e.add_request("hi", GREEDY, request_id="target"), "already in use"),
    ("n above 1 on the engine", lambda e: e.add_request("hi", SamplingParams(n=2)), "n=1"),
]


def test_bad_requests_raise_and_leave_others_untouched(make_engine) -> None:  # type: ignore[no-untyped-def]
    alone_engine = make_engine(max_model_len=256, num_kv_blocks=64)
    alone_engine.add_request(PROMPT, GREEDY, request_id="target")
    alone = _run(alone_engine, "target")

    engine = make_engine(max_model_len=256, num_kv_blocks=64)
    engine.add_request(PROMPT, GREEDY, request_id="target")
    engine.step()
    engine.step()
    used_before = engine.kv.stats().used_blocks
    for name, call, needle in BAD_CALLS:
        with pytest.raises(ValueError, match=needle):
            call(engine)
        assert engine.num_unfinished_requests == 1, name
        assert engine.kv.stats().used_blocks == used_before, name
    assert _run(engine, "target") == alone
    assert engine.kv.stats().used_blocks == 0


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -7}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_out_of_range_sampling_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_pool_too_small_fails_at_startup_naming_the_knobs(smollm2_loaded) -> None:  # type: ignore[no-untyped-def]
    cfg = EngineConfig(model=str(smollm2_loaded.path), dtype="float32", device="cpu", max_model_len=2048,
                       num_kv_blocks=10, block_size=16)
    with pytest.raises(ValueError) as err:
        Engine(cfg, loaded=smollm2_loaded)
    msg = str(err.value)
    assert "max_model_len=2048" in msg and "kv-cache-memory" in msg and "at most 160" in msg
    # The same through a memory budget: 1 MiB of fp32 KV holds 22 tokens of SmolLM2 (46,080 B/token).
    cfg2 = EngineConfig(model=str(smollm2_loaded.path), dtype="float32", device="cpu", max_model_len=512,
                        kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="at most 16"):
        Engine(cfg2, loaded=smollm2_loaded)


def test_missing_and_corrupt_model_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        Engine(EngineConfig(model=str(tmp_path / "nope.gguf"), device="cpu"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 40)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        Engine(EngineConfig(model=str(bad), device="cpu"))
