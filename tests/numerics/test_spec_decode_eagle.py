"""The EAGLE-like head (fitserve.model.eagle_head): trained here, in the test, on a random tiny
target's own greedy outputs and hidden states (no shipped weights), it drafts from the target's
last hidden state. Greedy output equals plain greedy whatever the head; the trained head's drafts
are accepted far more often than an untrained one's (the mechanism and the plumbing work); its
sampled drafts keep the target's distribution; a bad head file is a clear error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import LoadedModel, load_model
from fitserve.model.eagle_head import EagleHead
from fitserve.sampling import SamplingParams
from tests.gguf_vocab_files import default_hf_tokenizer

from .test_spec_decode import _chi2, _critical, _histograms, drive
from .tiny_models import build_tiny

PROMPTS = [torch.randint(3, 384, (8,), generator=torch.Generator().manual_seed(100 + i)).tolist() for i in range(12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, smollm2_gguf: Path) -> tuple[LoadedModel, Path, Path]:  # type: ignore[no-untyped-def]
    """(target, trained head file, untrained head file)."""
    pytest.importorskip("transformers")
    tok = default_hf_tokenizer(smollm2_gguf)
    folder = tmp_path_factory.mktemp("tiny-eagle")
    hf = build_tiny("llama", folder, tok)
    xs, hs, ys = [], [], []
    with torch.no_grad():  # (h_t, x_{t+1}) -> h_{t+1} along the target's own greedy outputs
        for prompt in PROMPTS:
            seq = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0]
            h = hf(seq[None], output_hidden_states=True).hidden_states[-1][0]  # final-normed
            for t in range(len(prompt) - 1, len(seq) - 2):
                xs.append(seq[t + 1])
                hs.append(h[t])
                ys.append(h[t + 1])
    x, hidden, nxt = torch.stack(xs), torch.stack(hs), torch.stack(ys)
    emb, lm = hf.get_input_embeddings().weight.detach(), hf.lm_head.weight.detach()
    target_tokens = (nxt @ lm.T).argmax(-1)
    torch.manual_seed(0)
    head = EagleHead(hf.config.hidden_size)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(800):  # ~2 s: full batch, cross-entropy on the next token + feature MSE
        pred = head(emb[x], hidden)
        loss = torch.nn.functional.cross_entropy(pred @ lm.T, target_tokens) + ((pred - nxt) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.save(folder / "head.safetensors")
    EagleHead(hf.config.hidden_size).save(folder / "untrained.safetensors")
    return load_model(folder, dtype=torch.float32), folder / "head.safetensors", folder / "untrained.safetensors"


def make(loaded: LoadedModel, head: Path | None, **kw: Any) -> Engine:
    spec = None if head is None else {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    fields: dict[str, Any] = {"model": str(loaded.path), "dtype": "float32", "device": "cpu", "max_model_len": 256,
                              "num_kv_blocks": 96, "block_size": 8, "speculative_config": spec}
    return Engine(EngineConfig(**{**fields, **kw}), loaded=loaded)


def test_trained_head_drafts_are_accepted_and_greedy_is_unchanged(trained) -> None:  # type: ignore[no-untyped-def]
    loaded, head, untrained = trained
    held_out = [torch.randint(3, 384, (8,), generator=torch.Generator().manual_seed(7)).tolist()]
    work = [(p, GREEDY) for p in PROMPTS + held_out]
    plain = drive(make(loaded, None), work)
    rates = {}
    for name, path in (("trained", head), ("untrained", untrained)):
        engine = make(loaded, path, max_num_batched_tokens=32)  # batched, chunked
        assert drive(engine, work) == plain
        assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 50
        rates[name] = engine.spec_stats.acceptance_rate
    assert rates["trained"] >= 0.5 and rates["trained"] > 10 * rates["untrained"], rates


@pytest.mark.slow
def test_head_sampling_keeps_the_target_distribution(trained) -> None:  # type: ignore[no-untyped-def]
    loaded, head, _ = trained
    params = SamplingParams(temperature=0.8, max_tokens=4)
    n, vocab = 500, loaded.spec.vocab_size
    plain = _histograms(make(loaded, None, max_num_seqs=64), PROMPTS[0], params, n, vocab, seed=1000)
    engine = make(loaded, head, max_num_seqs=64)
    spec = _histograms(engine, PROMPTS[0], params, n, vocab, seed=90_000)
    assert engine.spec_stats is not None and engine.spec_stats.num_accepted_tokens > 0
    for pos in (1, 2):
        stat, df = _chi2(plain[pos], spec[pos])
        assert stat < _critical(df), (pos, stat, df)


def test_a_bad_head_file_is_a_clear_error(trained, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    loaded, _, _ = trained
    with pytest.raises(ValueError, match="does not exist"):
        make(loaded, tmp_path / "missing.safetensors")
    EagleHead(32).save(tmp_path / "small.safetensors")
    with pytest.raises(ValueError, match="hidden size 32, the target has 64"):
        make(loaded, tmp_path / "small.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        make(loaded, tmp_path / "junk.safetensors")


def test_head_greedy_beside_other_requests_under_pressure(trained) -> None:  # type: ignore[no-untyped-def]
    loaded, head, _ = trained
    work = [(p, GREEDY) for p in PROMPTS[:5]]
    work.append((PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2)))
    work.append((PROMPTS[6], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)))
    kw: dict[str, Any] = {"max_num_batched_tokens": 12, "num_kv_blocks": 10, "max_model_len": 64}
    plain = drive(make(loaded, None, **kw), work)
    engine = make(loaded, head, **kw)
    assert drive(engine, work) == plain
    assert engine.spec_stats is not None and engine.spec_stats.num_accepted_tokens > 20
    assert engine.scheduler.total_preemptions > 0


def test_a_head_on_smollm2_changes_no_greedy_token(smollm2_loaded: LoadedModel, tmp_path: Path) -> None:
    """The default model with an (untrained) head: its drafts are mostly wrong, greedy is not."""
    EagleHead(smollm2_loaded.spec.hidden_size).save(tmp_path / "head.safetensors")
    tok = smollm2_loaded.tokenizer
    work = [(tok.encode(" the cat sat on the mat.", add_special_tokens=False) * 6, GREEDY),
            (tok.encode("Once upon a time"), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]
    plain = drive(make(smollm2_loaded, None), work)
    engine = make(smollm2_loaded, tmp_path / "head.safetensors")
    assert drive(engine, work) == plain
    assert engine.spec_stats is not None and engine.spec_stats.num_draft_tokens > 20
