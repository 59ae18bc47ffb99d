"""Tokenizer wrapper, incremental detokenization and sandboxed chat templates (SmolLM2 vocab)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitserve.loading import ChatTemplateError, IncrementalDetokenizer, Tokenizer, load_tokenizer
from fitserve.loading.chat_template import render_chat_template

TEXTS = [
    "emoji 😀🎉 then ünïcödé 漢字カタカナ and a flag 🇫🇷!",
    "plain ascii, numbers 12345.",
    "tab\tnewline\n  spaces",
]


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return load_tokenizer(smollm2_path)


def test_basic_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.encode("Hello world") == [19556, 905]  # no BOS: the file says add_bos_token=False
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert (
        tok.decode([1, 4093]) == "user"
        and tok.decode([1, 4093], skip_special_tokens=False) == "<|im_start|>user"
    )
    assert {0, 1, 2} <= set(tok.all_special_ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_reassembles_multibyte(
    tok: Tokenizer, text: str, skip: bool
) -> None:
    prompt = tok.encode("<|im_start|>assistant\n")
    ids = tok.encode(text) + [2]
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    if "😀" in text:  # the emoji's bytes span several tokens: some pushes must have held text back
        assert "" in deltas[:-1]


def test_detokenizer_flushes_invalid_utf8_at_finish(tok: Tokenizer) -> None:
    lone = tok.encode("😀")[0]  # first byte-token of a 4-byte character, never completed
    detok = IncrementalDetokenizer(tok)
    assert detok.push(lone) == ""
    assert detok.finish() == "\ufffd"


def test_chat_template_errors_and_helpers(tok: Tokenizer) -> None:
    no_template = Tokenizer(tok.backend)
    assert not no_template.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", [])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        render_chat_template("{{ messages.__class__.__mro__ }}", [])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat_template("{% for %}", [])
    out = render_chat_template(
        "{{ strftime_now('%Y') | length }} {{ messages | tojson }} {{ bos_token }}",
        [{"role": "user", "content": "é<"}],
        special_tokens={"bos_token": "<s>"},
    )
    assert out == '4 [{"role": "user", "content": "é<"}] <s>'
