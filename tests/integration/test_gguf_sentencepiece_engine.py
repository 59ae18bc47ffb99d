"""A real engine on a tiny Llama GGUF with a SentencePiece vocabulary (byte fallback): the
output, forced by a guided choice through "▁" words and byte-fallback pieces of multi-byte
characters, streams as text deltas that add up to the decoded output, never retracting and
never showing U+FFFD for a character whose bytes span several tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gguf_vocab_files import sentencepiece_vocab, train_sentencepiece, write_vocab_gguf

pytest.importorskip("sentencepiece")

ANSWER = "go 😀🎉 café 中文"


def test_engine_streams_byte_fallback_text(tmp_path: Path) -> None:
    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams
    from fitserve.structured.guided import GuidedDecoding

    vocab = sentencepiece_vocab(train_sentencepiece(gemma=False))
    vocab.ids = {"bos": 1, "eos": 2, "unknown": 0}
    vocab.flags = {"add_bos_token": True}
    path = write_vocab_gguf(tmp_path / "spm.gguf", vocab)
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                 max_model_len=128, num_kv_blocks=32))
    tok = engine.tokenizer
    prompt = tok.encode("Say:")
    guided = GuidedDecoding("choice", json.dumps([ANSWER]))
    params = SamplingParams(temperature=0.0, max_tokens=40, guided=guided)
    outs = list(engine.stream(prompt, params))
    final = outs[-1]
    assert final.finished and final.token_ids is not None
    ids = [i for i in final.token_ids if i not in tok.eos_token_ids]
    pieces = [tok.backend.id_to_token(i) for i in ids]
    assert sum(p.startswith("<0x") for p in pieces) >= 8, pieces  # both emoji byte by byte
    whole, before = tok.decode(prompt + ids), tok.decode(prompt)
    streamed = "".join(o.delta_text for o in outs)
    assert streamed == final.text == whole[len(before):] == ANSWER
    assert not any("\ufffd" in o.delta_text for o in outs)
    assert sum(o.delta_text == "" for o in outs) >= 6  # bytes held back until a character completes
