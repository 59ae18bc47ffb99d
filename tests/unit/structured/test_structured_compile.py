"""fitserve.structured.compiler and guide on a tiny byte-level BPE tokenizer (no model).

The compile cache (hits, LRU eviction, keys by kind + value + tokenizer), the errors an invalid
grammar raises, independent per-request states, and the mask itself against an independent
reference: Python's ``regex`` module, whose ``partial=True`` full match says whether a text can
still be extended into a match.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from fitserve.loading.tokenizer import Tokenizer, byte_level_bpe, bytes_to_unicode
from fitserve.structured.compiler import GrammarCompiler
from fitserve.structured.guide import GuidedDecodingError, bitmask_words
from fitserve.structured.guided import GuidedDecoding
from fitserve.structured.logits import disallowed_bits

EXTRA = ["ab", "abc", "\u0120a", "12", "ba", "<eos>"]  # \u0120 is the byte-level space
MERGES = ["a b", "ab c", "\u0120 a", "1 2", "b a"]


def tiny_tokenizer() -> Tokenizer:
    """256 byte tokens, five merges and an EOS (id 261)."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + EXTRA
    types = [1] * (len(tokens) - 1) + [3]  # the last one is a CONTROL token: special
    return Tokenizer(byte_level_bpe(tokens, MERGES, types), eos_token_ids=[len(tokens) - 1])


TOK = tiny_tokenizer()
EOS = TOK.eos_token_ids[0]
VOCAB = TOK.vocab_size


def token_bytes(token_id: int) -> bytes:
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    text = TOK.backend.id_to_token(token_id)
    return bytes(u2b[c] for c in text)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(max_entries=4)


def allowed(state, vocab: int = VOCAB) -> set[int]:  # type: ignore[no-untyped-def]
    bitmask = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)
    return {int(t) for t in (~torch.from_numpy(disallowed_bits(bitmask, vocab)[0].copy())).nonzero()}


def test_cache_hits_and_keys(compiler: GrammarCompiler) -> None:
    g = GuidedDecoding("regex", "[ab]+")
    first = compiler.compile(g, TOK, VOCAB)
    hits, misses = compiler.hits, compiler.misses
    assert compiler.compile(GuidedDecoding("regex", "[ab]+"), TOK, VOCAB) is first
    assert (compiler.hits, compiler.misses) == (hits + 1, misses)
    # json_object ignores its value: one entry whatever it says
    a = compiler.compile(GuidedDecoding("json_object", ""), TOK, VOCAB)
    assert compiler.compile(GuidedDecoding("json_object", "anything"), TOK, VOCAB) is a
    # the same text under another kind is another grammar
    assert compiler.compile(GuidedDecoding("grammar", 'root ::= "ab"'), TOK, VOCAB) is not first
    # another tokenizer (an equal one, even) gets its own LLTokenizer and its own entry
    other = tiny_tokenizer()
    assert compiler.lltokenizer(other, VOCAB) is not compiler.lltokenizer(TOK, VOCAB)
    assert compiler.lltokenizer(TOK, VOCAB) is compiler.lltokenizer(TOK, VOCAB)
    assert compiler.compile(g, other, VOCAB) is not first


def test_lru_evicts_the_least_recently_used() -> None:
    c = GrammarCompiler(max_entries=2)
    a = c.compile(GuidedDecoding("regex", "a+"), TOK, VOCAB)
    b = c.compile(GuidedDecoding("regex", "b+"), TOK, VOCAB)
    assert c.compile(GuidedDecoding("regex", "a+"), TOK, VOCAB) is a  # a is now the newest
    c.compile(GuidedDecoding("regex", "c+"), TOK, VOCAB)  # evicts b
    assert len(c) == 2
    assert c.compile(GuidedDecoding("regex", "a+"), TOK, VOCAB) is a
    assert c.compile(GuidedDecoding("regex", "b+"), TOK, VOCAB) is not b
    with pytest.raises(ValueError, match="max_entries"):
        GrammarCompiler(max_entries=0)


@pytest.mark.parametrize(("kind", "value", "needle"), [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", '{"type": "frobnicate"}', "frobnicate"),
    ("regex", "a(?=b)", "look-around"),
    ("regex", "(ab", "unclosed"),
    ("grammar", 'root ::= "a" missing', "missing"),
    ("choice", "not a list", "JSON list of strings"),
    ("choice", "[]", "non-empty"),
    ("choice", '["a", 1]', "non-empty JSON list of strings"),
])
def test_invalid_grammars_name_the_problem(kind: str, value: str, needle: str) -> None:
    c = GrammarCompiler()
    with pytest.raises(ValueError, match=needle) as err:
        c.compile(GuidedDecoding(kind, value), TOK, VOCAB)
    assert f"guided {kind}" in str(err.value)
    assert len(c) == 0  # nothing cached


def test_states_are_independent(compiler: GrammarCompiler) -> None:
    compiled = compiler.compile(GuidedDecoding("choice", json.dumps(["ab", "ba"])), TOK, VOCAB)
    one, two = compiled.new_state(), compiled.new_state()
    start = allowed(one)
    one.advance(TOK.encode("ab")[0])
    assert one.is_stopped and one.num_tokens == 1
    assert allowed(two) == start and not two.is_stopped  # the other did not move
    fork = two.fork()
    two.advance(TOK.encode("b")[0])
    assert allowed(fork) == start  # nor does a fork move with its origin
    with pytest.raises(GuidedDecodingError, match="does not fit"):
        fork.advance(TOK.encode("1")[0])
    with pytest.raises(GuidedDecodingError):
        allowed(fork)  # the matcher is now in its error state


def test_rollback_restores_the_mask(compiler: GrammarCompiler) -> None:
    state = compiler.compile(GuidedDecoding("regex", "[ab]{2,4}[12]"), TOK, VOCAB).new_state()
    before = allowed(state)
    state.advance(TOK.encode("a")[0])
    state.advance(TOK.encode("b")[0])
    state.rollback(2)
    assert state.num_tokens == 0 and allowed(state) == before
    with pytest.raises(GuidedDecodingError):
        state.rollback(1)


def test_bitmask_row_width_is_checked(compiler: GrammarCompiler) -> None:
    state = compiler.compile(GuidedDecoding("regex", "a"), TOK, VOCAB).new_state()
    with pytest.raises(ValueError, match="bitmask row"):
        state.fill_bitmask(torch.zeros(1, bitmask_words(VOCAB) + 1, dtype=torch.int32), 0)


# NOTE: no literal of several characters in these: llguidance admits only the canonical
# tokenization of text it forces, which the partial-match reference does not model.
REGEXES = ["[ab]+[12]?", "(a|b)*c?[0-9]{0,3}", "[a-c ]{1,6}", "b?[ab]{2}(1|2)*"]


@pytest.mark.parametrize("pattern", REGEXES)
def test_mask_matches_a_partial_match_reference(compiler: GrammarCompiler, pattern: str) -> None:
    regex = pytest.importorskip("regex")
    ref = regex.compile(pattern.encode())
    rng = random.Random(pattern)
    state = compiler.compile(GuidedDecoding("regex", pattern), TOK, VOCAB).new_state()
    text = b""
    for _ in range(8):
        want = {t for t in range(VOCAB) if t != EOS
                and ref.fullmatch(text + token_bytes(t), partial=True) is not None}
        if ref.fullmatch(text) is not None:
            want.add(EOS)  # EOS only where the output is already a complete match
        got = allowed(state)
        assert got == want, (pattern, text)
        if state.is_stopped:
            assert got == {EOS}
            break
        token = rng.choice(sorted(got - {EOS}))
        state.advance(token)
        text += token_bytes(token)


def test_vocab_padding_is_never_allowed(compiler: GrammarCompiler) -> None:
    """Logits wider than the tokenizer (a padded embedding): the extra ids are forbidden."""
    wide = VOCAB + 40
    state = compiler.compile(GuidedDecoding("regex", "[ab]*"), TOK, wide).new_state()
    got = allowed(state, wide)
    assert got and max(got) < VOCAB
