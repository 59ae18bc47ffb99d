"""Prompt logprobs (SamplingParams.prompt_logprobs) vs transformers' log-softmax on the same weights.

A tiny random-weight Llama (fp32 in the engine) against the same transformers model run in
float64: the reference's log_softmax(logits[p - 1])[prompt[p]] for every prompt token p >= 1.
Alone, batched in one step with another prompt, chunked (7 tokens per step) and with the
prefix already in the prefix cache (the request must recompute it: its num_cached_tokens is 0,
while a plain request after it does hit).

Tolerance: the engine runs fp32 (eps = 2**-24 ~ 6e-8 per rounding). A logit is a sum over the
hidden size (64) after 3 layers whose sums run over <= 160 terms; with the weights' scale the
logits are O(10), so accumulated rounding is ~ sqrt(160) x 6e-8 x 10 per sum, a few 1e-6 after
the layers. The log-softmax is 1-Lipschitz in each logit for the chosen token and in the
max-norm for the log-sum-exp, so |d logprob| <= 2 max |d logit|: 1e-4 leaves >10x margin
(measured: 3.9e-6 at most, chunked, logits up to 8.5) and is still 4 orders of magnitude below
any real error (a wrong position or a missing prefix token moves logprobs by O(1)).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import LoadedModel, load_model
from fitserve.sampling import SamplingParams
from fitserve.types import RequestOutput, TokenLogprobs
from tests.gguf_vocab_files import default_hf_tokenizer

from .tiny_models import build_tiny

ATOL = 1e-4
TOP = 3


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    tok = default_hf_tokenizer(smollm2_gguf)
    folder = tmp_path_factory.mktemp("tiny-llama-lp")
    hf = build_tiny("llama", folder, tok)
    return load_model(folder, dtype=torch.float32), hf.double()


def engine(loaded: LoadedModel, **kw: object) -> Engine:
    fields: dict[str, object] = {"model": str(loaded.path), "dtype": "float32", "device": "cpu",
                                 "max_model_len": 160, "num_kv_blocks": 64, "block_size": 8,
                                 "enable_prefix_caching": True, **kw}
    return Engine(EngineConfig(**fields), loaded=loaded)  # type: ignore[arg-type]


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


@torch.inference_mode()
def reference(hf, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """float64 log-softmax at every prompt position: row p - 1 scores token p."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def run(eng: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, RequestOutput]:
    for rid, ids in prompts.items():
        eng.add_request(ids, params, request_id=rid)
    first: dict[str, RequestOutput] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.error is None
            first.setdefault(out.request_id, out)
    return first


def check(got: list[TokenLogprobs | None] | None, ids: list[int], ref: torch.Tensor) -> None:
    assert got is not None and len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        e, row = got[p], ref[p - 1]
        assert e is not None and e.token_id == ids[p]
        assert abs(e.logprob - row[ids[p]].item()) < ATOL, (p, e.logprob, row[ids[p]].item())
        assert e.rank == int((row > row[ids[p]]).sum()) + 1
        top = row.topk(TOP)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in e.top], dtype=torch.float64), top.values,
                              atol=ATOL)


GREEDY = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)


def test_alone_and_batched(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    loaded, hf = tiny_llama
    a, b = prompt(1, 41), prompt(2, 23)
    out = run(engine(loaded), {"a": a}, GREEDY)
    check(out["a"].prompt_logprobs, a, reference(hf, a))
    eng = engine(loaded)
    out = run(eng, {"a": a, "b": b}, GREEDY)
    assert eng.step_log[0].num_prefill_tokens == len(a) + len(b)  # one step held both prompts
    check(out["a"].prompt_logprobs, a, reference(hf, a))
    check(out["b"].prompt_logprobs, b, reference(hf, b))


def test_chunked_prefill(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    loaded, hf = tiny_llama
    a = prompt(3, 45)
    eng = engine(loaded, long_prefill_token_threshold=7, max_num_batched_tokens=10)
    out = run(eng, {"a": a}, GREEDY)
    assert [r.num_prefill_tokens for r in eng.step_log][:3] == [7, 7, 7]  # really chunked
    check(out["a"].prompt_logprobs, a, reference(hf, a))


def test_prefix_cache_populated(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    loaded, hf = tiny_llama
    head = prompt(4, 32)
    a = head + prompt(5, 9)
    eng = engine(loaded)
    run(eng, {"warm": head + prompt(6, 5)}, SamplingParams(temperature=0.0, max_tokens=1))
    out = run(eng, {"a": a}, GREEDY)
    assert out["a"].num_cached_tokens == 0  # it recomputed the cached head
    check(out["a"].prompt_logprobs, a, reference(hf, a))
    plain = run(eng, {"plain": a}, SamplingParams(temperature=0.0, max_tokens=1))
    assert plain["plain"].num_cached_tokens == 40  # the cache was there (and "a" refilled it)
    assert plain["plain"].prompt_logprobs is None


def test_n_children_share_and_trim(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    loaded, hf = tiny_llama
    a = prompt(7, 20)
    eng = engine(loaded)
    ids = eng.add_requests(a, [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP),
                               SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)])
    first: dict[str, RequestOutput] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            first.setdefault(out.request_id, out)
    check(first[ids[0]].prompt_logprobs, a, reference(hf, a))
    one = first[ids[1]].prompt_logprobs
    assert one is not None and all(len(e.top) == 1 for e in one[1:] if e is not None)
    assert [e.logprob for e in one[1:] if e] == [e.logprob for e in first[ids[0]].prompt_logprobs[1:] if e]


def test_bad_value_is_named() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
