"""vLLM's token-level sampling extras through a real Engine (tiny random Llama, SmolLM2's tokenizer):
allowed_token_ids, bad_words, min_tokens, skip_special_tokens. Each test fails if its effect is
removed: the reference is the request without the field, or the plain rule the field states."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.sampling import SamplingParams
from fitserve.sampling.token_masks import bad_words_token_ids
from fitserve.types import FinishReason, RequestOutput
from tests.conftest import tiny_hf_config

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path) -> Iterator[Engine]:
    import transformers as tf

    torch.manual_seed(1234)
    model = tf.AutoModelForCausalLM.from_config(tiny_hf_config("llama", vocab_size=49152), dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    for f in smollm2_tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    eng = Engine(EngineConfig(model=str(folder), dtype="float32", device="cpu", max_model_len=256,
                              num_kv_blocks=64))
    yield eng
    eng.shutdown()


def run(engine: Engine, **kw: object) -> RequestOutput:
    *_, last = engine.stream(PROMPT, SamplingParams(**kw))  # type: ignore[arg-type]
    assert last.finished and last.token_ids is not None
    return last


def test_allowed_token_ids_limit_every_token(engine: Engine) -> None:
    free = run(engine, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    assert not set(free.token_ids or []) <= {12, 13}
    for temperature in (0.0, 1.0):
        out = run(engine, temperature=temperature, seed=3, max_tokens=12, ignore_eos=True,
                  allowed_token_ids=[12, 13])
        assert len(out.token_ids or []) == 12 and set(out.token_ids or []) <= {12, 13}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        engine.add_request(PROMPT, SamplingParams(allowed_token_ids=[engine.spec.vocab_size]))


def _contains(seq: list[int], sub: tuple[int, ...] | list[int]) -> bool:
    return any(seq[i:i + len(sub)] == list(sub) for i in range(len(seq) - len(sub) + 1))


def test_bad_words_never_appear(engine: Engine) -> None:
    tok = engine.tokenizer
    free = run(engine, temperature=0.0, max_tokens=12, ignore_eos=True).token_ids or []
    # a word the greedy output makes, one token long both bare and spaced
    word = next(w for t in free if (w := tok.decode([t]).strip()).isalpha()
                and all(len(v) == 1 for v in bad_words_token_ids([w], tok)))
    banned = bad_words_token_ids([word], tok)
    assert any(_contains(free, v) for v in banned)
    out = run(engine, temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=[word]).token_ids or []
    assert not any(_contains(out, v) for v in banned) and out != free


def test_min_tokens_holds_off_eos_and_stop_tokens(engine: Engine) -> None:
    eos = engine.tokenizer.eos_token_ids[0]
    forced = {eos: 100.0}
    short = run(engine, temperature=0.0, max_tokens=20, logit_bias=forced)
    assert len(short.token_ids or []) == 1 and short.finish_reason is FinishReason.STOP
    held = run(engine, temperature=0.0, max_tokens=20, logit_bias=forced, min_tokens=5)
    ids = held.token_ids or []
    assert len(ids) == 6 and eos not in ids[:5] and ids[5] == eos and held.finish_reason is FinishReason.STOP
    # a stop token id waits too (and stop strings: the output is not cut before min_tokens)
    stop = run(engine, temperature=0.0, max_tokens=20, logit_bias={7: 100.0}, stop_token_ids=[7], min_tokens=3)
    assert stop.token_ids == [stop.token_ids[0], stop.token_ids[1], stop.token_ids[2], 7] and stop.stop_reason == 7
    early = (run(engine, temperature=0.0, max_tokens=6, ignore_eos=True).text or "")[:1]
    cut = run(engine, temperature=0.0, max_tokens=6, ignore_eos=True, stop=[early])
    assert len(cut.token_ids or []) == 1 and cut.text == ""
    kept = run(engine, temperature=0.0, max_tokens=6, ignore_eos=True, stop=[early], min_tokens=5)
    assert len(kept.token_ids or []) >= 5 and (kept.text or "").startswith(early)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_skip_special_tokens_keeps_or_drops_special_text(engine: Engine) -> None:
    eos = engine.tokenizer.eos_token_ids[0]
    special = engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert special
    kw = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, "logit_bias": {eos: 100.0}}
    assert run(engine, **kw).text == ""
    assert run(engine, **kw, skip_special_tokens=False).text == special * 3
