"""A GGUF file's vocabulary -> a Hugging Face ``tokenizers.Tokenizer`` (the backend of
:class:`fitserve.loading.tokenizer.Tokenizer`).

This mirrors transformers' own GGUF tokenizer conversion
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``, the reference the tests compare
with); transformers is a test dependency only, so its builders are restated here on
``tokenizers`` alone:

- ``gpt2`` (byte-level BPE): the file's merges; the split regex picked by ``tokenizer.ggml.pre``
  (:mod:`fitserve.loading.gguf_pre_splits`: transformers' table, and llama.cpp's for the values
  transformers reads as GPT-2's regex), GPT-2's own regex for any other value.
- ``llama`` (SentencePiece vocabulary, BPE with byte fallback): merges recovered from the scores,
  ``▁`` for spaces, ``<0xNN>`` byte pieces; Gemma files (architecture gemma/gemma2/gemma3) the
  Gemma way (no prefix space, merges in file order, whitespace-run tokens respelled with ``▁``),
  Phi-3 files with the prefix space from a normalizer.

In both, CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens (matched
whole in the text), and the bos/eos/unk/pad tokens are special.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from fitserve.loading.gguf_pre_splits import PRE_TOKENIZER_SEQUENCES, PRE_TOKENIZER_SPLITS

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # tokenizer.ggml.token_type values
SPM = "\u2581"  # SentencePiece's visible space, "▁"

# Architectures whose SentencePiece vocabulary transformers builds its own way.
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_PHI3_ARCHS = ("phi3",)
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")


class VocabError(ValueError):
    """The vocabulary metadata cannot make a tokenizer (the message names what is wrong)."""


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The ``tokenizer.ggml.*`` metadata of a GGUF file that builds its tokenizer."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    add_space_prefix: bool | None = None

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], architecture: str) -> GGUFVocab:
        """Read the vocabulary from GGUF metadata; raises :class:`VocabError` if it cannot."""
        model = fields.get("tokenizer.ggml.model")
        if model not in SUPPORTED_TOKENIZER_MODELS:
            raise VocabError(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); supported: "
                + ", ".join(SUPPORTED_TOKENIZER_MODELS)
            )
        tokens = list(fields.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise VocabError("tokenizer.ggml.tokens missing from metadata")
        merges = fields.get("tokenizer.ggml.merges")
        scores = fields.get("tokenizer.ggml.scores")
        if model == "gpt2" and not merges:
            raise VocabError("tokenizer.ggml.merges missing from metadata (a gpt2 vocabulary)")
        if model == "llama" and not merges and scores is None:
            raise VocabError("tokenizer.ggml.scores missing from metadata (a llama vocabulary)")
        types = list(fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        if len(types) != len(tokens) or (scores is not None and len(scores) != len(tokens)):
            raise VocabError("tokenizer.ggml.token_type/scores differ in length from the tokens")

        def tid(key: str) -> int | None:
            i = fields.get(f"tokenizer.ggml.{key}")
            return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

        add_bos = fields.get("tokenizer.ggml.add_bos_token")
        # NOTE: llama.cpp (and transformers) add BOS to a SentencePiece vocabulary that does not
        # say otherwise; a byte-level one adds none unless it says so.
        add_space = fields.get("tokenizer.ggml.add_space_prefix")
        return cls(
            model=str(model),
            tokens=tokens,
            token_types=[int(t) for t in types],
            scores=None if scores is None else [float(s) for s in scores],
            merges=None if not merges else list(merges),
            pre=fields.get("tokenizer.ggml.pre"),
            architecture=architecture,
            bos_token_id=tid("bos_token_id"),
            eos_token_id=tid("eos_token_id"),
            unk_token_id=tid("unknown_token_id"),
            pad_token_id=tid("padding_token_id"),
            add_bos_token=bool(add_bos) if add_bos is not None else model == "llama",
            add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=None if add_space is None else bool(add_space),
        )

    def token(self, token_id: int | None) -> str | None:
        """The text of a token id (None for None)."""
        return None if token_id is None else self.tokens[token_id]


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable unicode character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int] | None = None,
    *,
    pre: str | None = None,
    bos_token_id: int | None = None,
    add_bos_token: bool = False,
) -> tokenizers.Tokenizer:
    """Build a byte-level BPE ``tokenizers.Tokenizer`` from llama.cpp's ``gpt2`` vocabulary.

    Tokens spelled outside the byte alphabet are respelled byte by byte; CONTROL tokens become
    special added tokens, USER_DEFINED ones plain added tokens (both matched whole in the text).
    """
    types = list(token_types or [_NORMAL] * len(tokens))
    return backend_from_vocab(
        GGUFVocab(model="gpt2", tokens=list(tokens), token_types=types, merges=list(merges),
                  pre=pre, bos_token_id=bos_token_id, add_bos_token=add_bos_token)
    )


def backend_from_vocab(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` a GGUF vocabulary describes (as transformers builds it)."""
    # the special names transformers' tokenizer class for each marks special by default
    defaults: tuple[str, ...]
    if vocab.model == "gpt2":
        tok, defaults = _byte_level_model(vocab), ("<|endoftext|>",)
    elif vocab.architecture in _GEMMA_ARCHS:
        tok, defaults = _gemma_model(vocab), ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
    else:
        tok, defaults = _sentencepiece_model(vocab), ("<unk>", "<s>", "</s>")
    _add_vocab_tokens(tok, vocab, defaults)
    _set_post_processor(tok, vocab)
    return tok


def _byte_level_model(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    ids = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(vocab.tokens)
    }
    pairs = [_merge_pair(m) for m in vocab.merges or ()]
    tok = tokenizers.Tokenizer(
        BPE(vocab=ids, merges=pairs, dropout=None, continuing_subword_prefix="",
            end_of_word_suffix="", fuse_unk=False)
    )
    pre = vocab.pre or ""
    splits = (PRE_TOKENIZER_SPLITS[pre],) if pre in PRE_TOKENIZER_SPLITS else (
        PRE_TOKENIZER_SEQUENCES.get(pre))
    if splits is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise VocabError(f"merge {merge!r} is not two tokens separated by a space")
    return left, right


def merges_from_scores(
    ids: Mapping[str, int], scores: Mapping[str, float]
) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two
    tokens, best score first (transformers' ``generate_merges`` with scores)."""
    found: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in ids and piece[k:] in ids
        ]
        local.sort(key=lambda m: (ids[m[0]], ids[m[1]]))
        found.extend(local)
    # NOTE: a stable sort, as transformers' (equal keys keep the order found above).
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _spm_merges(vocab: GGUFVocab, tokens: Sequence[str],
                scores: Mapping[str, float]) -> list[tuple[str, str]]:
    if vocab.merges:
        return [_merge_pair(m) for m in vocab.merges]
    return merges_from_scores({t: i for i, t in enumerate(tokens)}, scores)


def _spm_decoder(strip_prefix: bool) -> decoders.Decoder:
    steps = [decoders.Replace(SPM, " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def _sentencepiece_model(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """transformers' LlamaTokenizer (Phi3's variant for phi3): Metaspace, byte fallback."""
    scores = dict(zip(vocab.tokens, vocab.scores or [0.0] * len(vocab.tokens), strict=True))
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    tok = tokenizers.Tokenizer(
        BPE(vocab=ids, merges=_spm_merges(vocab, vocab.tokens, scores), fuse_unk=True,
            byte_fallback=True, dropout=None)
    )
    # NOTE: transformers' GGUF path ignores tokenizer.ggml.add_space_prefix (it always prepends
    # "▁"); llama.cpp and the model's own HF tokenizer (add_prefix_space=false) honour it, so an
    # explicit false here means no prefix space.
    prefix = vocab.add_space_prefix is not False
    if vocab.architecture in _PHI3_ARCHS:
        replace = normalizers.Replace(" ", SPM)
        tok.normalizer = (
            normalizers.Sequence([normalizers.Prepend(SPM), replace]) if prefix else replace
        )
        tok.pre_tokenizer = None
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPM, prepend_scheme="first" if prefix else "never", split=False
        )
    tok.decoder = _spm_decoder(strip_prefix=prefix)
    return tok


def _gemma_model(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """transformers' GemmaTokenizer: spaces normalized to "▁", no prefix space, merges ranked
    by file order (Gemma's scores do not follow its merges), whitespace-run tokens (stored by
    llama.cpp as real spaces) respelled with "▁"."""
    tokens = [SPM * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]
    ids = {t: i for i, t in enumerate(tokens)}
    positions = {t: -float(i) for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(
        BPE(vocab=ids, merges=_spm_merges(vocab, tokens, positions), fuse_unk=True,
            # NOTE: transformers names "<unk>" whether or not the file has it; a file without
            # one relies on byte fallback alone.
            unk_token="<unk>" if "<unk>" in ids else None, dropout=None, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", SPM)
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    tok.decoder = _spm_decoder(strip_prefix=False)
    return tok


def _add_vocab_tokens(tok: tokenizers.Tokenizer, vocab: GGUFVocab,
                      default_specials: Sequence[str]) -> None:
    """CONTROL tokens -> special added tokens, USER_DEFINED -> plain added tokens, then the
    builder's default special names and the file's bos/eos/unk/pad as special ones.

    In a byte-level vocabulary a CONTROL token spelled outside the byte alphabet is a
    llama.cpp mislabel and is skipped, as transformers does. Unlike transformers, a special
    name missing from the vocabulary is not added under a new id (the model has no row for it).
    """
    alphabet = set(bytes_to_unicode().values()) if vocab.model == "gpt2" else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(vocab.tokens, vocab.token_types, strict=True)
        if ty == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        tok.add_special_tokens(control)
    known = tok.get_vocab(with_added_tokens=True)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(vocab.tokens, vocab.token_types, strict=True)
        if ty == _USER_DEFINED and t in known
    ]
    if user:
        tok.add_tokens(user)
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    named = [vocab.token(i) for i in (vocab.bos_token_id, vocab.eos_token_id,
                                      vocab.unk_token_id, vocab.pad_token_id)]
    extra = [
        AddedToken(t, normalized=False, special=True)
        for t in dict.fromkeys([*default_specials, *(n for n in named if n is not None)])
        if t not in added and t in known
    ]
    if extra:
        tok.add_special_tokens(extra)


def _set_post_processor(tok: tokenizers.Tokenizer, vocab: GGUFVocab) -> None:
    """BOS / EOS around every encoded text, as the file's add_bos/add_eos flags say."""
    bos = vocab.token(vocab.bos_token_id) if vocab.add_bos_token else None
    eos = vocab.token(vocab.eos_token_id) if vocab.add_eos_token else None
    if bos is None and eos is None:
        return
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1",
                     *([f"{eos}:1"] if eos else [])])
    special = list(dict.fromkeys(
        (t, i) for t, i in ((bos, vocab.bos_token_id), (eos, vocab.eos_token_id)) if t
    ))
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )
