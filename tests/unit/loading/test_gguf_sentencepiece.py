"""SentencePiece GGUF vocabularies (``tokenizer.ggml.model = "llama"``: Llama-2, Mistral, Gemma,
Phi-3) against transformers' tokenizer of the same file and against sentencepiece itself.

The vocabularies are trained here with ``sentencepiece`` (BPE, byte fallback) and written as
llama.cpp's converter writes them (tests/gguf_vocab_files.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fitserve.loading import IncrementalDetokenizer, ModelLoadError, Tokenizer, load_tokenizer
from tests.gguf_vocab_files import (
    CORPUS,
    PHI3_ADDED,
    hf_tokenizer,
    phi3_vocab,
    sentencepiece_vocab,
    train_sentencepiece,
    write_vocab_gguf,
)

pytest.importorskip("sentencepiece")
pytest.importorskip("transformers")

# Special / added tokens inline: control ([INST], <start_of_turn>), user-defined (<tool>), bos/eos.
SPECIAL_TEXTS = (
    "[INST] What is 2+2? [/INST] Four.</s>",
    "<s>[INST]hi[/INST]<tool>call</s>",
    "<start_of_turn>user\nhi <end_of_turn>\n<start_of_turn>model\n<bos>x<eos>",
    "<unk> and <pad> and <mask>",
)
TEXTS = CORPUS + SPECIAL_TEXTS


@pytest.fixture(scope="module")
def llama_sp() -> Any:
    return train_sentencepiece(gemma=False)


@pytest.fixture(scope="module")
def gemma_sp() -> Any:
    return train_sentencepiece(gemma=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, llama_sp: Any, gemma_sp: Any) -> dict[str, Path]:
    """Llama-2/Mistral style (add_bos, a prefix space, control [INST], an added <tool>), the
    same vocabulary under phi3, and Gemma style (no prefix space, control turn markers,
    whitespace-run tokens written with real spaces)."""
    d = tmp_path_factory.mktemp("spm")
    llama = sentencepiece_vocab(llama_sp, added=["<tool>"])
    llama.ids = {"bos": 1, "eos": 2, "unknown": 0}
    llama.flags = {"add_bos_token": True, "add_eos_token": False}
    gemma = sentencepiece_vocab(gemma_sp, special=["<start_of_turn>", "<end_of_turn>"],
                                user=["\u2581\u2581", "\u2581" * 4])
    gemma.ids = {"bos": 2, "eos": 1, "unknown": 3, "padding": 0}
    gemma.flags = {"add_bos_token": True, "add_eos_token": False, "add_space_prefix": False}
    eos_too = sentencepiece_vocab(llama_sp)
    eos_too.ids = {"bos": 1, "eos": 2, "unknown": 0}
    eos_too.flags = {"add_bos_token": False, "add_eos_token": True}
    no_flags = sentencepiece_vocab(llama_sp)  # an older file: llama.cpp's default adds BOS
    no_flags.ids = {"bos": 1, "eos": 2, "unknown": 0}
    no_prefix_sp = train_sentencepiece(gemma=False, dummy_prefix=False)
    no_prefix = sentencepiece_vocab(no_prefix_sp)
    no_prefix.ids = {"bos": 1, "eos": 2, "unknown": 0}
    no_prefix.flags = {"add_bos_token": True, "add_space_prefix": False}
    return {
        "no_prefix": write_vocab_gguf(d / "no_prefix.gguf", no_prefix, "llama"),
        "llama": write_vocab_gguf(d / "llama2.gguf", llama, "llama"),
        "phi3": write_vocab_gguf(d / "phi3.gguf", llama, "phi3"),
        # as the converter writes Phi-3 (benchmarks/bench_families.py's phi3 file): 53 [PAD]s
        "phi3_added": write_vocab_gguf(d / "phi3_added.gguf",
                                       phi3_vocab(llama_sp, llama_sp.vocab_size() + 64), "phi3"),
        "gemma": write_vocab_gguf(d / "gemma.gguf", gemma, "gemma3"),
        "eos": write_vocab_gguf(d / "eos.gguf", eos_too, "llama"),
        "no_flags": write_vocab_gguf(d / "no_flags.gguf", no_flags, "llama"),
    }


@pytest.mark.parametrize("style", ["llama", "phi3", "phi3_added", "gemma", "eos", "no_flags"])
def test_ids_and_text_equal_transformers(files: dict[str, Path], style: str) -> None:
    ours, ref = load_tokenizer(files[style]), hf_tokenizer(files[style])
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.vocab_size == len(ref)


def test_phi3_chat_markers_are_whole_control_tokens(files: dict[str, Path]) -> None:
    """Phi-3's added tokens inline are one id each, equal to transformers', skipped on decode."""
    ours, ref = load_tokenizer(files["phi3_added"]), hf_tokenizer(files["phi3_added"])
    text = "<|system|>Be brief.<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>4<|endoftext|>"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == ref.encode(text, add_special_tokens=False)
    marks = [ours.token_to_id(t) for t in PHI3_ADDED]
    assert marks == list(range(marks[0], marks[0] + len(PHI3_ADDED)))
    assert sum(i in marks for i in ids) == 6 and ours.decode(ids) == ref.decode(
        ids, skip_special_tokens=True)
    assert ours.vocab_size == len(ref) == marks[0] + 64


def test_gemma_files_keep_added_tokens_whole(files: dict[str, Path]) -> None:
    tok = load_tokenizer(files["gemma"])
    turn = tok.token_to_id("<start_of_turn>")
    ids = tok.encode("<start_of_turn>user\nhi", add_special_tokens=False)
    assert ids[0] == turn and tok.decode(ids) == "user\nhi"  # control: special, skipped
    assert tok.decode(ids, skip_special_tokens=False) == "<start_of_turn>user\nhi"
    assert turn in tok.all_special_ids and tok.encode("x")[0] == tok.bos_token_id == 2


@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_ids_equal_sentencepiece(files: dict[str, Path], llama_sp: Any, gemma_sp: Any,
                                 style: str) -> None:
    """sentencepiece itself (no special tokens in the text; a leading space is where
    transformers' Metaspace and sentencepiece's dummy prefix differ, so those are left out)."""
    sp = llama_sp if style == "llama" else gemma_sp
    tok = load_tokenizer(files[style])
    for text in CORPUS:
        if style == "llama" and text.startswith(" "):
            continue
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text)) == text


@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_round_trip_is_byte_exact(files: dict[str, Path], style: str) -> None:
    """Byte fallback makes the vocabulary lossless, except Llama's one stripped leading space."""
    tok = load_tokenizer(files[style])
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        expect = text[1:] if style == "llama" and text.startswith(" ") else text
        assert tok.decode(ids, skip_special_tokens=False) == expect
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) >= 4 and all(tok.backend.id_to_token(i).startswith("<0x") for i in emoji[-4:])


def test_no_space_prefix_flag_equals_sentencepiece_without_dummy_prefix(
    files: dict[str, Path],
) -> None:
    """tokenizer.ggml.add_space_prefix = false on a Llama vocabulary (llama.cpp writes it from
    tokenizer_config's add_prefix_space): no "▁" is prepended, as sentencepiece trained without
    a dummy prefix and llama.cpp do. (transformers' GGUF path ignores this flag.)"""
    sp = train_sentencepiece(gemma=False, dummy_prefix=False)
    tok = load_tokenizer(files["no_prefix"])
    for text in CORPUS:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hi")[0] == 1


@pytest.mark.parametrize("style", ["gemma", "no_prefix"])
def test_ids_equal_llama_cpp(files: dict[str, Path], style: str) -> None:
    """llama.cpp's own tokenizer (when importable, see shared/PEERS.md). The Llama style is left
    out: for text that starts with a space or follows a special token, transformers (the
    reference fitserve follows) and llama.cpp place the prefix "▁" differently."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(files[style]), vocab_only=True, verbose=False)
    tok = load_tokenizer(files[style])
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == ref.tokenize(
                text.encode(), add_bos=special, special=True), (text, special)


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_incremental_detokenizer(files: dict[str, Path], style: str) -> None:
    """Streamed text equals the text of the whole output in its context: "▁" at a word start
    becomes its space, byte-fallback pieces of one character come out whole, no U+FFFD."""
    tok = load_tokenizer(files[style])
    prompt = tok.encode("Answer:")
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        deltas = _stream(tok, prompt, ids)
        whole, before = tok.decode(prompt + ids), tok.decode(prompt)
        assert whole.startswith(before) and "".join(deltas) == whole[len(before):], text
        assert not any("\ufffd" in d for d in deltas), deltas
        alone = _stream(tok, [], ids)
        assert "".join(alone) == tok.decode(ids)


def test_byte_fallback_character_split_across_tokens_streams_whole(
    files: dict[str, Path],
) -> None:
    tok = load_tokenizer(files["llama"])
    ids = tok.encode("go 😀🎉", add_special_tokens=False)
    pieces = [tok.backend.id_to_token(i) for i in ids]
    assert pieces[-8:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>",
                           "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    deltas = [detok.push(i) for i in ids]
    assert deltas[-8:] == ["", "", "", "😀", "", "", "", "🎉"]
    assert "".join(deltas) == " go 😀🎉" and detok.finish() == ""
    cut = IncrementalDetokenizer(tok)  # a stream that stops inside a character
    assert [cut.push(i) for i in ids[-8:-5]] == ["", "", ""]
    assert cut.finish() == tok.decode(ids[-8:-5])


def test_unsupported_tokenizer_models_are_refused_by_name(tmp_path: Path, llama_sp: Any) -> None:
    vocab = sentencepiece_vocab(llama_sp)
    vocab.model = "t5"
    path = write_vocab_gguf(tmp_path / "t5.gguf", vocab)
    with pytest.raises(ModelLoadError, match=r"t5\.gguf: the engine cannot run this model \(tokenizer model 't5'.*supported: gpt2, llama"):
        load_tokenizer(path)


def test_vocabulary_metadata_is_dropped_once_the_tokenizer_is_built(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """read_gguf forgets the tokenizer.ggml.* arrays before it reads weights (a 256k vocabulary
    is ~180 MiB of parsed metadata); the model's tokenizer still equals transformers'."""
    import fitserve.loading.gguf as gguf_loading
    from fitserve.loading import load_model

    left: dict[str, list[str]] = {}
    drop = gguf_loading.drop_vocabulary_metadata

    def spy(reader: Any, fields: dict[str, Any]) -> None:
        drop(reader, fields)
        left["reader"] = [k for k in reader.fields if k.startswith("tokenizer.ggml.")]
        left["fields"] = [k for k in fields if k.startswith("tokenizer.ggml.")]

    monkeypatch.setattr(gguf_loading, "drop_vocabulary_metadata", spy)
    loaded = load_model(files["llama"])
    assert left == {"reader": [], "fields": []}
    ref = hf_tokenizer(files["llama"])
    for text in TEXTS:
        assert loaded.tokenizer.encode(text) == ref.encode(text), text
    assert loaded.tokenizer.vocab_size == len(ref)
