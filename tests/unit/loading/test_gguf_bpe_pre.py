"""Byte-level BPE GGUF vocabularies under several ``tokenizer.ggml.pre`` values against
transformers' tokenizer of the same file (the values its table covers, and GPT-2's regex for the
others), the default model's file too; the values fitserve fills from llama.cpp's table against
llama.cpp itself (when ``llama_cpp`` is importable, see shared/PEERS.md) and the digit-splitting
ones against their tokenizer.json formulation.

The vocabulary is trained here on whole lines, so its merges cross word, digit and whitespace
boundaries and the split regex a file names decides its ids (a test checks they differ).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fitserve.loading import load_tokenizer
from fitserve.loading.gguf_vocab import PRE_TOKENIZER_SEQUENCES, PRE_TOKENIZER_SPLITS
from tests.gguf_vocab_files import (
    CORPUS,
    Vocab,
    hf_tokenizer,
    train_byte_level_bpe,
    write_vocab_gguf,
)

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER = ["<think>", "</think>"]
SPECIAL_TEXTS = (
    "<|im_start|>user\nWrite 12345 lines<|im_end|>\n<|im_start|>assistant\n",
    "<think>hmm  so</think>Answer: 42<|endoftext|>",
)
TEXTS = CORPUS + SPECIAL_TEXTS
# Covered by transformers' table (each a different regex family), GPT-2's regex by name, and a
# file with no pre at all: fitserve equals transformers.
PRE_VALUES = ["llama-bpe", "qwen2", "qwen35", "gpt-4o", "tekken", "gpt-2", "smollm", None]
# Read by transformers as GPT-2's regex, filled by fitserve from llama.cpp's table.
FILLED = ["deepseek-llm", "deepseek-coder", "deepseek-v3", "falcon", "stablelm2", "starcoder",
          "command-r"]


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    v = train_byte_level_bpe(SPECIALS, USER)
    v.ids = {"bos": 0, "eos": 2, "padding": 0}
    v.flags = {"add_bos_token": False}
    return v


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab) -> dict[str | None, Path]:
    d = tmp_path_factory.mktemp("bpe")
    out: dict[str | None, Path] = {}
    for pre in PRE_VALUES + FILLED:
        v = Vocab(vocab.model, vocab.tokens, vocab.token_types, merges=vocab.merges, pre=pre,
                  ids=vocab.ids, flags=vocab.flags)
        out[pre] = write_vocab_gguf(d / f"{pre or 'none'}.gguf", v, "qwen2" if pre else "llama")
    bos = Vocab(vocab.model, vocab.tokens, vocab.token_types, merges=vocab.merges,
                pre="llama-bpe", ids={"bos": 1, "eos": 2}, flags={"add_bos_token": True})
    out["bos"] = write_vocab_gguf(d / "bos.gguf", bos)
    return out


def _assert_same(ours: Any, ref: Any, texts: tuple[str, ...]) -> None:
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
        # byte-level BPE is lossless
        assert ours.decode(ours.encode(text, add_special_tokens=False), False) == text


@pytest.mark.parametrize("pre", [*PRE_VALUES, "bos"])
def test_ids_and_text_equal_transformers(files: dict[str | None, Path], pre: str | None) -> None:
    _assert_same(load_tokenizer(files[pre]), hf_tokenizer(files[pre]), TEXTS)


def test_user_defined_and_control_tokens_stay_whole(files: dict[str | None, Path]) -> None:
    tok = load_tokenizer(files["qwen2"])
    ids = tok.encode("<think>a</think><|im_end|>")
    think, end = tok.token_to_id("<think>"), tok.token_to_id("<|im_end|>")
    assert ids[0] == think and ids[-1] == end and tok.decode(ids) == "<think>a</think>"
    assert end in tok.all_special_ids and think not in tok.all_special_ids


def test_split_regex_changes_ids(files: dict[str | None, Path]) -> None:
    """The test above can tell the regexes apart: each family splits the corpus differently."""
    seen: dict[tuple[tuple[int, ...], ...], str | None] = {}
    for pre in ("llama-bpe", "qwen2", "qwen35", "gpt-4o", "tekken", None):
        tok = load_tokenizer(files[pre])
        ids = tuple(tuple(tok.encode(t)) for t in TEXTS)
        assert ids not in seen, (pre, seen.get(ids))
        seen[ids] = pre


def test_split_table_is_transformers_table() -> None:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert PRE_TOKENIZER_SPLITS == GGUF_PRE_TOKENIZER_SPLITS


def test_default_model_file_equals_transformers(smollm2_path: Path) -> None:
    """The default model's GGUF (byte-level, pre "smollm") as before: same ids as transformers."""
    _assert_same(load_tokenizer(smollm2_path), hf_tokenizer(smollm2_path), TEXTS)


def test_filled_values_are_not_in_transformers_table() -> None:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert set(FILLED) <= set(PRE_TOKENIZER_SEQUENCES)
    assert not set(PRE_TOKENIZER_SEQUENCES) & set(GGUF_PRE_TOKENIZER_SPLITS)


@pytest.mark.parametrize("pre", FILLED)
def test_filled_values_equal_llama_cpp(files: dict[str | None, Path], pre: str) -> None:
    """llama.cpp's own tokenizer on the same file (vocab only), special tokens parsed."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(files[pre]), vocab_only=True, verbose=False)
    ours = load_tokenizer(files[pre])
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == ref.tokenize(
            text.encode(), add_bos=False, special=True), text


@pytest.mark.parametrize("pre", ["starcoder", "command-r"])
def test_digit_splitting_values_equal_their_tokenizer_json(
    files: dict[str | None, Path], pre: str
) -> None:
    """These models' tokenizer.json pre-tokenize with Digits(individual) then GPT-2's ByteLevel
    regex; the same vocabulary under that pre-tokenizer gives fitserve's ids."""
    from tokenizers import pre_tokenizers

    ours = load_tokenizer(files[pre])
    ref = load_tokenizer(files[pre]).backend
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    gpt2 = load_tokenizer(files["gpt-2"])
    differs = False
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        differs |= ids != gpt2.encode(text, add_special_tokens=False)
    assert differs  # the vocabulary merges digits: transformers' GPT-2 reading splits otherwise
