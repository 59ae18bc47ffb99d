"""Speculative decoding in the engine against plain decoding (the unshared reference): greedy
tokens are identical for every proposer, alone and batched beside requests that do not
speculate (penalties, logprobs), under chunked prefill and preemption; sampling keeps the target
distribution (a deliberately wrong acceptance rule fails the same statistic); the n-gram
proposer accepts every draft on a prompt that repeats itself verbatim; no block leaks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import LoadedModel, load_model
from fitserve.sampling import SamplingParams
from fitserve.spec_decode import rejection
from tests.gguf_vocab_files import default_hf_tokenizer

from .tiny_models import build_tiny

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def draft(path: Path | str, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "mistral"])
def tiny(request, tmp_path_factory, smollm2_gguf: Path) -> LoadedModel:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    tok = default_hf_tokenizer(smollm2_gguf)
    folder = tmp_path_factory.mktemp(f"tiny-spec-{request.param}")
    build_tiny(request.param, folder, tok)
    return load_model(folder, dtype=torch.float32)


def make(loaded: LoadedModel, spec: dict[str, Any] | None, **kw: Any) -> Engine:
    fields: dict[str, Any] = {"model": str(loaded.path), "dtype": "float32", "device": "cpu",
                              "max_model_len": 512, "num_kv_blocks": 160, "block_size": 8,
                              "speculative_config": spec}
    return Engine(EngineConfig(**{**fields, **kw}), loaded=loaded)


def drive(engine: Engine, work: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    rids = [engine.add_request(p, sp) for p, sp in work]
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None
                got[out.request_id] = out.token_ids or []
    assert engine.kv.stats().used_blocks == 0
    return [got[r] for r in rids]


def repetitive(vocab: int, seed: int, n: int) -> list[list[int]]:
    """Prompts with repeats (where n-gram lookup hits) and one without."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(3, min(vocab, 20000), (3 + i,), generator=g).tolist()
        tail = torch.randint(3, min(vocab, 20000), (5,), generator=g).tolist()
        out.append(motif * (4 + i % 3) + tail + motif)
    out.append(torch.randint(3, min(vocab, 20000), (23,), generator=g).tolist())
    return out


@pytest.mark.parametrize("pressure", [False, True])
def test_ngram_greedy_equals_plain_greedy_batched_with_others(smollm2_loaded: LoadedModel, pressure: bool) -> None:
    prompts = repetitive(smollm2_loaded.spec.vocab_size, 1, 5)
    work = [(p, GREEDY) for p in prompts]
    # requests that do not speculate, in the same steps
    work.append((prompts[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3)))
    work.append((prompts[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)))
    kw: dict[str, Any] = {"max_num_batched_tokens": 24, "num_kv_blocks": 30, "max_model_len": 96} if pressure else {}
    plain = drive(make(smollm2_loaded, None, **kw), work)
    engine = make(smollm2_loaded, NGRAM, **kw)
    assert drive(engine, work) == plain
    st = engine.spec_stats
    assert st is not None and st.num_accepted_tokens > 0 and st.num_draft_tokens > st.num_accepted_tokens
    if pressure:
        assert engine.scheduler.total_preemptions > 0


def test_ngram_greedy_on_tiny_models(tiny: LoadedModel) -> None:
    prompts = repetitive(tiny.spec.vocab_size, 2, 4)
    work = [(p, GREEDY) for p in prompts]
    plain = drive(make(tiny, None, max_num_batched_tokens=16), work)
    engine = make(tiny, NGRAM, max_num_batched_tokens=16)
    assert drive(engine, work) == plain
    assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 0


def test_ngram_accepts_everything_on_a_verbatim_repeat(smollm2_loaded: LoadedModel) -> None:
    tok = smollm2_loaded.tokenizer
    engine = make(smollm2_loaded, NGRAM)
    prompt = tok.encode(" the cat sat on the mat.", add_special_tokens=False) * 12
    out = drive(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))])[0]
    st = engine.spec_stats
    assert st is not None and st.num_drafts >= 8 and st.acceptance_rate == 1.0
    assert st.mean_accepted_length == 1 + st.num_accepted_tokens / st.num_drafts > 4
    assert engine.num_steps < 48 / 3  # a prefill, then ~5 tokens per target step
    assert tok.decode(out).startswith(" the cat sat on the mat. the cat")


def _histograms(engine: Engine, prompt: list[int], params: SamplingParams, n: int, vocab: int,
                seed: int) -> torch.Tensor:
    """[3, vocab] counts of the 1st..3rd generated tokens over n requests seeded seed + i."""
    counts = torch.zeros(3, vocab)
    outs = drive(engine, [(prompt, SamplingParams(**{**_fields(params), "seed": seed + i})) for i in range(n)])
    for toks in outs:
        for pos in range(3):
            counts[pos, toks[pos]] += 1
    return counts


def _fields(p: SamplingParams) -> dict[str, Any]:
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "max_tokens": p.max_tokens,
            "ignore_eos": True}


def _critical(df: int) -> float:
    """Chi-square's critical value at p = 1e-3 (Wilson-Hilferty's approximation)."""
    z = 3.0902  # the standard normal's 1 - 1e-3 quantile
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _chi2(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Two-sample chi-square statistic, and its degrees of freedom, over the cells the two
    samples together hit at least 5 times."""
    keep = (a + b) >= 5
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    stat = (((a * (nb / na).sqrt() - b * (na / nb).sqrt()) ** 2) / (a + b)).sum()
    return float(stat), int(keep.sum()) - 1


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_tokens=4),
                                    SamplingParams(temperature=0.7, top_p=0.8, max_tokens=4)])
def test_sampling_distribution_matches_plain(tiny: LoadedModel, params: SamplingParams,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded samples of a small-vocab random model, speculative vs plain: the tokens after
    the drafts keep the target's distribution (two-sample chi-square below the 1e-3 critical
    value); always accepting the drafts (a wrong rule) is caught by the same statistic."""
    vocab = tiny.spec.vocab_size
    # every token once, in a shuffled order: whatever is sampled, the 1-gram lookup finds it in
    # the prompt and drafts the k tokens that followed it there (a draft at every step)
    prompt = torch.randperm(vocab - 3, generator=torch.Generator().manual_seed(5)).add(3).tolist()
    n = 500
    kw: dict[str, Any] = {"max_num_seqs": 64, "max_model_len": 512}
    plain = _histograms(make(tiny, None, **kw), prompt, params, n, vocab, seed=1000)
    spec_engine = make(tiny, NGRAM, **kw)
    spec = _histograms(spec_engine, prompt, params, n, vocab, seed=90_000)  # independent seeds
    assert spec_engine.spec_stats is not None and spec_engine.spec_stats.num_drafts >= n
    critical = _critical
    for pos in (1, 2):  # token 0 is sampled plainly (no draft yet); 1 and 2 follow drafts
        stat, df = _chi2(plain[pos], spec[pos])
        assert stat < critical(df), (pos, stat, df)
    monkeypatch.setattr(rejection, "_accept_probability", lambda p_x, q_x: torch.ones_like(p_x))
    wrong = _histograms(make(tiny, NGRAM, **kw), prompt, params, n, vocab, seed=90_000)
    stat, df = _chi2(plain[1], wrong[1])
    assert stat > critical(df), (stat, df)


@pytest.fixture(scope="module")
def random_draft_for_smollm2(tmp_path_factory, smollm2_gguf: Path) -> Path:  # type: ignore[no-untyped-def]
    """A random 3-layer model with SmolLM2's vocabulary: a draft that is mostly wrong."""
    pytest.importorskip("transformers")
    tok = default_hf_tokenizer(smollm2_gguf)
    folder = tmp_path_factory.mktemp("tiny-draft-49152")
    build_tiny("llama", folder, tok, vocab_size=49152)
    return folder


def test_target_as_its_own_draft_accepts_almost_everything(smollm2_loaded: LoadedModel) -> None:
    prompts = repetitive(smollm2_loaded.spec.vocab_size, 3, 2)[1:]  # one repetitive, one random
    work = [(p, GREEDY) for p in prompts]
    plain = drive(make(smollm2_loaded, None), work)
    engine = make(smollm2_loaded, draft(smollm2_loaded.path))
    assert drive(engine, work) == plain
    st = engine.spec_stats
    assert st is not None and st.num_drafts > 5 and st.acceptance_rate >= 0.98


def test_a_random_draft_model_changes_no_greedy_token(smollm2_loaded: LoadedModel, random_draft_for_smollm2: Path) -> None:
    prompts = repetitive(smollm2_loaded.spec.vocab_size, 4, 2)
    work = [(p, GREEDY) for p in prompts]
    plain = drive(make(smollm2_loaded, None, max_num_batched_tokens=16), work)
    engine = make(smollm2_loaded, draft(random_draft_for_smollm2), max_num_batched_tokens=16)
    assert drive(engine, work) == plain
    st = engine.spec_stats
    assert st is not None and st.num_draft_tokens > 20 and st.acceptance_rate < 0.5


def test_a_draft_of_another_vocabulary_is_refused(smollm2_loaded: LoadedModel, tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="must share a tokenizer"):
        make(smollm2_loaded, draft(tiny.path))


@pytest.mark.slow
def test_draft_model_sampling_matches_plain(tiny: LoadedModel, tmp_path_factory, smollm2_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    """A random draft (the other tiny architecture, same vocabulary) proposes from its own q:
    rejections resample norm(max(0, p - q)); the token distribution stays the target's."""
    pytest.importorskip("transformers")
    tok = default_hf_tokenizer(smollm2_gguf)
    other = "qwen2" if tiny.spec.architecture == "llama" else "llama"
    folder = tmp_path_factory.mktemp(f"tiny-draft-{other}")
    build_tiny(other, folder, tok)
    params = SamplingParams(temperature=0.9, top_k=50, max_tokens=4)
    prompt = [7, 8, 9, 10, 11]
    kw: dict[str, Any] = {"max_num_seqs": 64}
    n, vocab = 500, tiny.spec.vocab_size
    plain = _histograms(make(tiny, None, **kw), prompt, params, n, vocab, seed=1000)
    engine = make(tiny, draft(folder, k=2), **kw)
    spec = _histograms(engine, prompt, params, n, vocab, seed=90_000)
    st = engine.spec_stats
    assert st is not None and st.num_drafts >= n and 0 < st.num_accepted_tokens < st.num_draft_tokens
    for pos in (1, 2):
        stat, df = _chi2(plain[pos], spec[pos])
        assert stat < _critical(df), (pos, stat, df)


def test_draft_model_greedy_on_tiny_models_under_pressure(tiny: LoadedModel, tmp_path_factory,
                                                          smollm2_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    """A random draft of the other tiny architecture, batched with requests that do not
    speculate, a small token budget (chunked prefill) and a pool small enough to preempt."""
    pytest.importorskip("transformers")
    tok = default_hf_tokenizer(smollm2_gguf)
    other = "qwen3" if tiny.spec.architecture == "llama" else "llama"
    folder = tmp_path_factory.mktemp(f"tiny-greedy-draft-{other}")
    build_tiny(other, folder, tok)
    prompts = repetitive(tiny.spec.vocab_size, 6, 4)
    work = [(p, GREEDY) for p in prompts]
    work.append((prompts[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=0.5)))
    # NOTE: Mistral's windowed layers free their blocks behind the window (fitserve.kv.group),
    # so its pool must be smaller still to preempt
    blocks = 13 if tiny.spec.sliding_window is None else 6
    kw: dict[str, Any] = {"max_num_batched_tokens": 12, "num_kv_blocks": blocks, "max_model_len": 96}
    plain = drive(make(tiny, None, **kw), work)
    engine = make(tiny, draft(folder), **kw)
    assert drive(engine, work) == plain
    assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 10
    assert engine.scheduler.total_preemptions > 0


def test_disable_by_batch_size_turns_drafting_off_for_big_batches(tiny: LoadedModel) -> None:
    prompts = repetitive(tiny.spec.vocab_size, 8, 3)
    work = [(p, GREEDY) for p in prompts]
    spec = {**NGRAM, "disable_by_batch_size": 2}
    plain = drive(make(tiny, None), work)
    engine = make(tiny, spec)
    assert drive(engine, work) == plain
    assert engine.spec_stats is not None
    batched = engine.spec_stats.num_drafts  # drafts only once fewer than 2 are left running
    alone = make(tiny, spec)
    drive(alone, work[:1])
    assert alone.spec_stats is not None and alone.spec_stats.num_drafts > batched
