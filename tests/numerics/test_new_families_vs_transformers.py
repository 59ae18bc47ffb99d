"""Gemma 2, Gemma 3 (text) and Phi-3 vs transformers on the same random tiny weights.

The models (tests/numerics/tiny_models.py) have GQA 4:1, head_dim != hidden / heads, windows
shorter than the prompts (Gemma 2: 6, Gemma 3: 5, Phi-3: 48), Gemma 2's attention and final
soft-caps small enough to change the logits, Gemma 3's two RoPE tables (local base 1e4; global
1e6 with linear scaling 4) and Phi-3's LongRoPE with an original context of 100: a 120-token
prompt starts past it (every token on the long factors) and a 90-token one crosses it while
decoding. Greedy tokens must equal transformers' for 32 tokens and every top-5 logprob must be
within a tolerance derived from the shapes (``derived_tolerance``): alone, batched with chunked
prefill (chunk 7, block 4), under preemption, with n-gram speculative decoding, and from a GGUF
file written as llama.cpp's converter writes it; beam search equals a dense beam search on
transformers' model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import LoadedModel, load_model
from fitserve.sampling import SamplingParams
from fitserve.sampling.beam_search import BeamSearchParams
from tests.gguf_vocab_files import default_hf_tokenizer

from .conftest import hf_greedy
from .hf_to_gguf import write_gguf_like_llama_cpp
from .test_beam_search import dense_beam_search
from .tiny_models import PHI3_ORIGINAL_CONTEXT, build_tiny

transformers = pytest.importorskip("transformers")

NUM_TOKENS = 32
PROMPT_LENGTHS = {"gemma2": (1, 5, 23, 40), "gemma3": (1, 5, 23, 40),
                  "phi3": (1, 23, 90, 120)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
FP32_EPS = torch.finfo(torch.float32).eps


@dataclass
class Family:
    arch: str
    folder: Path
    ref: Any  # the transformers model
    loaded: LoadedModel
    prompts: list[list[int]]
    want: list[tuple[list[int], list[torch.Tensor]]]  # transformers' tokens and logprobs
    tol: float


@torch.inference_mode()
def derived_tolerance(ref: Any, prompt: list[int]) -> float:
    """The logprob error two fp32 implementations that differ only in summation order can
    show: each of the L layers (and the head) sums at most K = max(hidden, intermediate)
    products, a relative error of about sqrt(K) * eps each; relative errors of the hidden state
    reach the logits scaled by their magnitude. A factor 10 covers softmax/norm amplification
    (a wrong rule anywhere — a mask, a scale, a norm — is off by far more: ~1e-1 and up)."""
    cfg = ref.config
    logits = ref(torch.tensor([prompt])).logits[0].double()
    k = max(cfg.hidden_size, cfg.intermediate_size)
    return 10 * (cfg.num_hidden_layers + 1) * k**0.5 * FP32_EPS * float(logits.abs().max())


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf: Path) -> Any:
    return default_hf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "phi3"])
def family(request: Any, tmp_path_factory: Any, hf_tokenizer: Any) -> Family:
    arch = request.param
    folder = tmp_path_factory.mktemp(f"tiny-{arch}")
    ref = build_tiny(arch, folder, hf_tokenizer)
    loaded = load_model(folder, dtype=torch.float32)
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, loaded.spec.vocab_size) for _ in range(n)]
               for n in PROMPT_LENGTHS[arch]]
    want = [hf_greedy(ref, p, NUM_TOKENS) for p in prompts]
    return Family(arch, folder, ref, loaded, prompts, want, derived_tolerance(ref, prompts[-1]))


def make(loaded: LoadedModel, **kw: Any) -> Engine:
    fields: dict[str, Any] = {"model": str(loaded.path), "dtype": "float32", "device": "cpu",
                              "max_model_len": 256, "num_kv_blocks": 320, "block_size": 4}
    return Engine(EngineConfig(**{**fields, **kw}), loaded=loaded)


def run(engine: Engine, prompts: list[list[int]], *, together: bool) -> list[Any]:
    """The finished outputs of ``prompts``: all added at once, or one after another."""
    done: dict[int, Any] = {}
    waves = [list(enumerate(prompts))] if together else [[(i, p)] for i, p in enumerate(prompts)]
    for wave in waves:
        for i, p in wave:
            engine.add_request(p, GREEDY, request_id=str(i))
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None
                if out.finished:
                    done[int(out.request_id)] = out
    return [done[i] for i in range(len(prompts))]


def check(fam: Family, outs: list[Any], what: str) -> None:
    for i, (out, (tokens, lps)) in enumerate(zip(outs, fam.want, strict=True)):
        assert out.token_ids == tokens, f"{fam.arch} {what}: prompt {i} ({len(fam.prompts[i])})"
        for ours, ref in zip(out.logprobs, lps, strict=True):
            for tok, lp in ours.top:
                assert abs(lp - float(ref[tok])) < fam.tol, (fam.arch, what, i, tok)


def test_spec(family: Family) -> None:
    """The config read as transformers reads it (the fields that make these families)."""
    spec, cfg = family.loaded.spec, family.ref.config
    assert spec.num_heads == 4 * spec.num_kv_heads  # GQA 4:1
    if family.arch == "phi3":
        rs = spec.rope_scaling
        assert rs is not None and rs.kind == "longrope"
        assert rs.original_max_position_embeddings == PHI3_ORIGINAL_CONTEXT
        assert rs.long_factor == tuple(cfg.rope_parameters["long_factor"])
        assert family.ref.model.rotary_emb.attention_scaling == pytest.approx(rs.attention_factor)
        assert spec.sliding_window == cfg.sliding_window and spec.layer_types is None
        return
    assert spec.head_dim != spec.hidden_size // spec.num_heads
    assert spec.query_pre_attn_scalar == cfg.query_pre_attn_scalar
    assert spec.layer_types == tuple(t.split("_")[0] for t in cfg.layer_types)
    assert spec.attn_logit_softcapping == cfg.attn_logit_softcapping
    assert spec.final_logit_softcapping == cfg.final_logit_softcapping


def test_alone(family: Family) -> None:
    """One request at a time, whole prompts in one step."""
    check(family, run(make(family.loaded, block_size=16), family.prompts, together=False),
          "alone")


def test_batched_chunked(family: Family) -> None:
    """All prompts at once, chunked prefill of 7 tokens over 4-token blocks."""
    engine = make(family.loaded, long_prefill_token_threshold=7)
    check(family, run(engine, family.prompts, together=True), "batched, chunk 7")


def test_ngram_speculative_decoding(family: Family) -> None:
    """Greedy speculative decoding emits exactly the greedy tokens (verification chunks run
    as decode rows over the same soft-capped / windowed / LongRoPE attention)."""
    engine = make(family.loaded, speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 3})
    check(family, run(engine, family.prompts, together=True), "ngram speculative")


def test_gguf_round_trip(family: Family, tmp_path: Path, hf_tokenizer: Any) -> None:
    """The same model as a GGUF file (gguf-py's writer, llama.cpp's names, metadata and norm
    + 1): the engine loads it and generates transformers' tokens. Gemma's attention scale is
    written by no key (llama.cpp derives head_dim**-0.5), so the Gemma models here have
    query_pre_attn_scalar = head_dim."""
    overrides: dict[str, Any] = {}
    if family.arch != "phi3":
        overrides["query_pre_attn_scalar"] = family.ref.config.head_dim
    ref = build_tiny(family.arch, tmp_path / "hf", hf_tokenizer, **overrides) if overrides else (
        family.ref)
    path = write_gguf_like_llama_cpp(ref, tmp_path / f"{family.arch}.gguf")
    loaded = load_model(path, dtype=torch.float32)
    assert loaded.file_format == "gguf"
    hf_spec = load_model(tmp_path / "hf", dtype=torch.float32).spec if overrides else (
        family.loaded.spec)
    for field in ("num_layers", "head_dim", "sliding_window", "layer_types", "rope_theta",
                  "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "sliding_rope_theta", "tie_word_embeddings"):
        assert getattr(loaded.spec, field) == getattr(hf_spec, field), field
    ours, theirs = loaded.spec.rope_scaling, hf_spec.rope_scaling
    assert (ours is None) == (theirs is None)
    if ours is not None and theirs is not None:  # the file stores float32 factors
        assert (ours.kind, ours.original_max_position_embeddings) == (
            theirs.kind, theirs.original_max_position_embeddings)
        for a, b in ((ours.factor, theirs.factor), (ours.attention_factor, theirs.attention_factor),
                     *zip(ours.long_factor + ours.short_factor,
                          theirs.long_factor + theirs.short_factor, strict=True)):
            assert a == pytest.approx(b, rel=1e-6)
    fam = Family(family.arch, path, ref, loaded, family.prompts,
                 [hf_greedy(ref, p, NUM_TOKENS) for p in family.prompts], family.tol)
    check(fam, run(make(loaded, long_prefill_token_threshold=7), fam.prompts, together=True),
          "gguf")


def test_under_preemption(family: Family) -> None:
    """All prompts at once in a pool too small for them together: requests are preempted (their
    blocks, windowed groups' included, go back) and recomputed, and still emit transformers'
    tokens."""
    longest = max(map(len, family.prompts)) + NUM_TOKENS
    engine = make(family.loaded, num_kv_blocks=-(-longest // 4) + 4, max_model_len=longest,
                  long_prefill_token_threshold=7)
    # Gemma: the two longest cannot run together; Phi-3 (every layer on a 48-token window, so a
    # request holds at most ~15 blocks) needs all four
    first = 0 if family.arch == "phi3" else 2
    some = Family(family.arch, family.folder, family.ref, family.loaded, family.prompts[first:],
                  family.want[first:], family.tol)
    check(some, run(engine, some.prompts, together=True), "preempted")
    assert engine.scheduler.total_preemptions > 0
    assert engine.kv.stats().used_blocks == 0


def test_beam_search(family: Family) -> None:
    """Beam search (width 3) over copy-on-write blocks, windowed groups included, equals a dense
    beam search on transformers' model that keeps no cache (tests/numerics/test_beam_search)."""
    prompt = family.prompts[2]  # longer than the Gemma windows; Phi-3: past 90 on long factors
    steps = 8
    engine = make(family.loaded, block_size=4)
    rid = engine.add_beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=steps,
                                                          ignore_eos=True))
    beams = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                beams = out.beams
    assert beams is not None
    dense = dense_beam_search(family.ref, prompt, 3, steps)
    assert [b.token_ids for b in beams] == [t for t, _ in dense]
    for b, (_, cum) in zip(beams, dense, strict=True):
        assert b.cum_logprob == pytest.approx(cum, abs=steps * family.tol)
    assert engine.kv.stats().used_blocks == 0


def test_draft_model(family: Family) -> None:
    """A draft model (the model itself): Phi-3 emits transformers' greedy tokens; Gemma, whose
    layers mix windowed and full attention (two KV groups), is refused by name."""
    spec = {"method": "draft_model", "model": str(family.folder), "num_speculative_tokens": 3}
    if family.arch != "phi3":
        with pytest.raises(ValueError, match="cannot use a draft model yet.*ngram"):
            make(family.loaded, speculative_config=spec)
        return
    check(family, run(make(family.loaded, speculative_config=spec), family.prompts,
                      together=True), "draft model")


def test_gqa_8_to_1(tmp_path: Path, hf_tokenizer: Any) -> None:
    """Gemma 2 with 8 query heads on 1 KV head (8:1), soft-caps and windows as above: batched,
    chunked, transformers' greedy tokens and logprobs."""
    ref = build_tiny("gemma2", tmp_path, hf_tokenizer, num_attention_heads=8)
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert loaded.spec.num_heads == 8 * loaded.spec.num_kv_heads
    prompts = [list(range(7, 47)), [11, 5, 300]]
    fam = Family("gemma2 8:1", tmp_path, ref, loaded, prompts,
                 [hf_greedy(ref, p, NUM_TOKENS) for p in prompts], derived_tolerance(ref, prompts[0]))
    check(fam, run(make(loaded, long_prefill_token_threshold=7), prompts, together=True),
          "batched, chunk 7")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3"], indirect=True)
def test_tensor_parallel_2_sliding_and_full(family: Family) -> None:
    """--tp 2 (two gloo processes) on a model whose KV layer groups differ (sliding, full):
    the step message carries each group's table, its 1 KV head replicated on both ranks;
    batched and chunked, transformers' greedy tokens and logprobs."""
    engine = make(family.loaded, long_prefill_token_threshold=7, tensor_parallel_size=2)
    try:
        assert set(engine.runner.group_windows) == {None, family.loaded.spec.sliding_window}
        check(family, run(engine, family.prompts, together=True), "tp 2")
    finally:
        engine.shutdown()
