"""Beam search on shared copy-on-write blocks equals two independent references (fp32):

(a) a plain beam search written here that keeps no cache at all: every beam recomputes its whole
    sequence with transformers each step (dense, unshared), and ranks all (beam, token) pairs;
(b) transformers' own ``generate(num_beams=k, do_sample=False)``.

EOS is ignored on both sides (transformers: ``eos_token_id=None``), so hypotheses have equal
lengths and the ranking is the cumulative logprob; the length penalty still scales the reported
score, compared with transformers' ``sequences_scores``. Every beam's tokens must be identical
and its cumulative logprob within ``LOGPROB_TOL`` (fp32 sums over the steps, two code paths).

Then the sharing itself: beams run beside other requests in the same steps, under a token
budget that splits groups across steps and a pool small enough to preempt; outputs stay the
same, blocks were shared and copied on write, and every block comes back.
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
from fitserve.sampling.beam_search import BeamSearchParams
from fitserve.types import BeamSequence, FinishReason, RunnerOutput, SchedulerOutput
from tests.gguf_vocab_files import default_hf_tokenizer

from .tiny_models import build_tiny

LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    tok = default_hf_tokenizer(smollm2_gguf)
    folder = tmp_path_factory.mktemp("tiny-llama-beams")
    hf = build_tiny("llama", folder, tok)
    return load_model(folder, dtype=torch.float32), hf


@pytest.fixture(scope="module")
def smollm2(smollm2_loaded: LoadedModel, hf_smollm2):  # type: ignore[no-untyped-def]
    return smollm2_loaded, hf_smollm2


def make(loaded: LoadedModel, **kw: Any) -> Engine:
    fields: dict[str, Any] = {"model": str(loaded.path), "dtype": "float32", "device": "cpu",
                              "max_model_len": 256, "num_kv_blocks": 128, "block_size": 8}
    return Engine(EngineConfig(**{**fields, **kw}), loaded=loaded)


def run(engine: Engine, prompt: list[int], params: BeamSearchParams) -> list[BeamSequence]:
    rid = engine.add_beam_search(prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                assert out.error is None and out.beams is not None
                return out.beams
    raise AssertionError("the beam search never finished")


@torch.inference_mode()
def dense_beam_search(hf: Any, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """Reference (a): no KV cache, no sharing; every (beam, token) pair of the vocabulary ranked."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    for _ in range(steps):
        cands: list[tuple[float, int, int]] = []
        for i, (toks, cum) in enumerate(beams):
            logits = hf(torch.tensor([prompt + toks])).logits[0, -1].double()
            lp = torch.log_softmax(logits, dim=-1)
            top = lp.topk(width)
            cands += [(cum + float(v), i, int(t)) for v, t in zip(top.values, top.indices, strict=True)]
        cands.sort(key=lambda c: -c[0])
        beams = [(beams[i][0] + [t], c) for c, i, t in cands[:width]]
    return beams


@torch.inference_mode()
def hf_beam_search(hf: Any, prompt: list[int], width: int, steps: int, lp: float) -> list[tuple[list[int], float]]:
    """Reference (b): transformers' beam search, EOS off; (tokens, score) best first."""
    out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                      max_new_tokens=steps, length_penalty=lp, early_stopping=False, eos_token_id=None,
                      pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    seqs = [s[len(prompt):].tolist() for s in out.sequences]
    assert all(len(s) == steps for s in seqs), "transformers stopped early: EOS was not off"
    return list(zip(seqs, out.sequences_scores.tolist(), strict=True))


CASES = [("tiny", 2, 10, 1.0), ("tiny", 4, 12, 0.6), ("smollm2", 4, 8, 1.0)]


@pytest.mark.parametrize(("model", "width", "steps", "lp"), CASES)
def test_beam_search_equals_dense_reference_and_transformers(
    model: str, width: int, steps: int, lp: float, request: pytest.FixtureRequest
) -> None:
    loaded, hf = request.getfixturevalue("tiny_llama" if model == "tiny" else "smollm2")
    g = torch.Generator().manual_seed(width * 100 + steps)
    # 19 tokens: the last prompt block is partial, so the first forks share it (copy-on-write)
    prompt = torch.randint(3, min(loaded.spec.vocab_size, 4000), (19,), generator=g).tolist()
    engine = make(loaded)
    beams = run(engine, prompt, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True,
                                                 length_penalty=lp))
    assert len(beams) == width
    dense = dense_beam_search(hf, prompt, width, steps)
    ref = hf_beam_search(hf, prompt, width, steps, lp)
    assert [b.token_ids for b in beams] == [t for t, _ in dense] == [t for t, _ in ref]
    for b, (_, cum), (_, score) in zip(beams, dense, ref, strict=True):
        assert b.finish_reason == FinishReason.LENGTH
        assert b.cum_logprob == pytest.approx(cum, abs=LOGPROB_TOL)
        assert b.score == pytest.approx(b.cum_logprob / steps**lp, rel=1e-9)
        assert b.score == pytest.approx(score, abs=LOGPROB_TOL / steps**lp)
    assert engine.kv.stats().used_blocks == 0


def test_beams_share_blocks_beside_other_requests_under_pressure(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    loaded, _ = tiny_llama
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (21, 13, 30)]
    others = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (9, 26)]
    params = [BeamSearchParams(beam_width=w, max_tokens=t, ignore_eos=True) for w, t in ((3, 14), (4, 10), (2, 12))]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    alone = [run(make(loaded), p, bp) for p, bp in zip(prompts, params, strict=True)]
    alone_other = [next(o for o in make(loaded).stream(p, greedy) if o.finished).token_ids for p in others]

    # 10 tokens per step: a group's beams are spread over several steps (idle beams wait);
    # 16 blocks of 8 for up to 11 sequences of up to 46 tokens: preemption
    engine = make(loaded, max_num_batched_tokens=10, num_kv_blocks=16, max_num_seqs=12, max_model_len=64)
    seen = {"copies": 0, "shared": 0, "mixed": 0}
    execute = engine.runner.execute

    def spy(plan: SchedulerOutput, states: Any) -> RunnerOutput:
        seen["copies"] += len(plan.block_copies)
        seen["shared"] = max(seen["shared"], engine.kv.stats().shared_blocks)
        ids = {c.request_id for c in plan.chunks}
        seen["mixed"] += any(".beam" in r for r in ids) and any(".beam" not in r for r in ids)
        return execute(plan, states)

    engine.runner.execute = spy  # type: ignore[method-assign]
    gids = [engine.add_beam_search(p, bp) for p, bp in zip(prompts, params, strict=True)]
    oids = [engine.add_request(p, greedy) for p in others]
    got: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None
                got[out.request_id] = out.beams if out.beams is not None else out.token_ids
    for gid, ref in zip(gids, alone, strict=True):
        assert [b.token_ids for b in got[gid]] == [b.token_ids for b in ref]
        for b, r in zip(got[gid], ref, strict=True):
            assert b.cum_logprob == pytest.approx(r.cum_logprob, abs=1e-4)
    assert [got[o] for o in oids] == alone_other
    assert seen["copies"] > 0 and seen["shared"] > 0 and seen["mixed"] > 0
    assert engine.scheduler.total_preemptions > 0
    st = engine.kv.stats()
    assert st.used_blocks == 0 and st.free_blocks == 16
    assert all(engine.kv.pool.ref_count(b) == 0 for b in range(16))


@pytest.mark.parametrize("question", ["Hi!", "What is 2+2?"])
def test_beam_search_with_eos_matches_transformers(smollm2, question: str) -> None:  # type: ignore[no-untyped-def]
    """EOS on: hypotheses end early and the length penalty decides between lengths; the order
    and scores follow transformers' (finalize EOS within the top beam_width candidates, score by
    generated length with the EOS counted, stop by its early_stopping=False heuristic)."""
    loaded, hf = smollm2
    tok = loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}],
                                                add_generation_prompt=True), add_special_tokens=False)
    width, steps, lp = 3, 24, 1.0
    beams = run(make(loaded), prompt, BeamSearchParams(beam_width=width, max_tokens=steps, length_penalty=lp))
    assert any(b.finish_reason == FinishReason.STOP for b in beams), "no beam ended on EOS: the case is vacuous"
    eos = list(tok.eos_token_ids)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                          max_new_tokens=steps, length_penalty=lp, early_stopping=False, eos_token_id=eos,
                          pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True)
    for b, seq, score in zip(beams, out.sequences, out.sequences_scores.tolist(), strict=True):
        gen = seq[len(prompt):].tolist()
        if b.finish_reason == FinishReason.STOP:  # transformers pads after the EOS
            gen = gen[: gen.index(b.token_ids[-1]) + 1]
        assert b.token_ids == gen
        assert b.score == pytest.approx(score, abs=LOGPROB_TOL)


def test_beam_blocks_between_planner_floor_and_bound(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """The planner's two beam figures (fitserve.ledger.kv.sharing_blocks) bracket what the
    engine holds: each step's used blocks lie between the beam floor (all beams descend from
    one beam: every token but the last shared) and the n-samples figure (only the prompt's full
    blocks shared), for the P + t tokens each beam has slots for at that step."""
    from fitserve.ledger.kv import sharing_blocks

    loaded, _ = tiny_llama
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 384, (19,), generator=g).tolist()
    width, steps, bs = 4, 24, 8
    engine = make(loaded)
    execute = engine.runner.execute
    held: list[tuple[int, int]] = []  # (tokens with slots per beam, blocks used)

    def spy(plan: SchedulerOutput, states: Any) -> RunnerOutput:
        beams = [c for c in plan.chunks if ".beam" in c.request_id]
        if beams and all(len(c.token_ids) == 1 for c in beams):  # every beam decodes
            slots = {c.start_pos + 1 for c in beams}
            assert len(slots) == 1 and len(beams) == width
            held.append((slots.pop(), engine.kv.stats().used_blocks))
        return execute(plan, states)

    engine.runner.execute = spy  # type: ignore[method-assign]
    run(engine, prompt, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    assert len(held) >= steps - 2
    below_bound = 0
    for tokens, used in held:
        sb = sharing_blocks(19, tokens - 19, width, bs)
        assert sb.beam_floor <= used <= sb.shared, (tokens, used, sb)
        below_bound += used < sb.shared
    assert below_bound > 0  # beams do share generated history: the bound is not the measure
