"""Test helper: GGUF files whose vocabularies are trained here and written the way llama.cpp's
convert_hf_to_gguf.py writes them (tokens, scores, token types, special ids, add_* flags), on a
tiny random-weight model (tests/tiny_gguf.py) so both fitserve and transformers open them.

- SentencePiece (``tokenizer.ggml.model = "llama"``): a BPE model with byte fallback trained with
  the ``sentencepiece`` package; token types from its processor as llama.cpp's
  ``_create_vocab_sentencepiece`` sets them, added tokens as llama.cpp sets them from
  ``added_tokens.json`` / ``tokenizer_config.json`` (CONTROL for special ones, USER_DEFINED with
  "▁" written as real spaces for the others).
- Byte-level BPE (``"gpt2"``): trained with ``tokenizers``' own BPE trainer.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from fitserve.loading.gguf_vocab import SPM
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

# Code, whitespace runs (spaces, tabs, newlines, CRLF), emoji (with ZWJ and skin tone), CJK,
# accents, digits, contractions, special and user-defined tokens, leading spaces, empty text.
CORPUS: tuple[str, ...] = (
    "Hello world! The quick brown fox jumps over the lazy dog.",
    'def main(argv):\n    for i in range(10):\n\t\tprint(f"{i:>3}")  # tabs\n    return 0\n',
    "Spaces:    four, then two  and one; trailing   ",
    "\n\nNewlines\r\nand CRLF\n\n\n\t \t",
    "Emoji 😀🎉👍🏽 and family 👨‍👩‍👧 end",
    "中文分词测试，你好世界。日本語のテキスト、한국어 텍스트",
    "Accents: café, naïve, Ångström, São Paulo, Zürich, façade, œuvre, ñandú",
    "Combining marks: cafe\u0301 nai\u0308ve, नमस्ते दुनिया",
    "Numbers 1234567 3.14159 and 0x1F; don't won't I'm we'll they've HE'S",
    "Numerals ١٢٣ Ⅻ x²",
    "CamelCaseWords and snake_case_words/paths/to/file.py",
    " leading space",
    "   three leading",
    "x",
    "",
)
# Training text: the corpus (so its words get merges) and some more of the same kinds.
TRAINING: tuple[str, ...] = CORPUS * 3 + (
    "the cat sat on the mat and the dog ate the bone",
    "import numpy as np\nx = np.zeros((3, 4))\nprint(x.shape)\n",
    "    if x == 1:\n        return None\n    else:\n        return x + 1\n",
    "Über café naïve résumé déjà vu",
) * 5


@dataclass
class Vocab:
    """What llama.cpp writes under ``tokenizer.ggml.*``."""

    model: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = "default"
    ids: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad -> id
    flags: dict[str, bool] = field(default_factory=dict)  # add_bos/add_eos/add_space_prefix


def add_vocab(w: gguf.GGUFWriter, vocab: Vocab) -> None:
    """Write ``vocab`` under ``tokenizer.ggml.*`` as llama.cpp's converter does."""
    w.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.token_types)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    for key, token_id in vocab.ids.items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)
    for key, value in vocab.flags.items():
        w.add_bool(f"tokenizer.ggml.{key}", value)


def write_vocab_gguf(path: Path, vocab: Vocab, arch: str = "llama") -> Path:
    """A one-layer random-weight model of ``arch`` with ``vocab`` in its metadata."""
    config = TinyGGUF(arch=arch, layers=1, hidden=64, vocab=len(vocab.tokens), tokenizer=False,
                      edit=lambda w: add_vocab(w, vocab))
    return write_tiny_gguf(path, config)


def train_sentencepiece(*, gemma: bool, dummy_prefix: bool = True,
                        sentences: Sequence[str] = TRAINING, **options: Any) -> Any:
    """A SentencePiece BPE model with byte fallback, Llama-2-like or Gemma-like, trained on
    ``sentences``."""
    import sentencepiece as spm

    kw: dict[str, Any] = dict(
        model_type="bpe", vocab_size=720, byte_fallback=True, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=0.98, hard_vocab_limit=False,
        add_dummy_prefix=dummy_prefix and not gemma, minloglevel=2,
    )
    if gemma:  # Gemma's ids and names; whitespace runs and turn markers as user-defined pieces
        kw.update(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                  bos_piece="<bos>", control_symbols=["<mask>"],
                  user_defined_symbols=["<start_of_turn>", "<end_of_turn>", SPM * 2, SPM * 4])
    else:  # Llama-2 ids; Mistral v0.3's control tokens
        kw.update(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, control_symbols=["[INST]", "[/INST]"])
    kw.update(options)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=buf, **kw)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def sentencepiece_vocab(sp: Any, *, special: Sequence[str] = (), user: Sequence[str] = (),
                        added: Sequence[str] = ()) -> Vocab:
    """llama.cpp's ``_create_vocab_sentencepiece``: the processor's pieces and types; pieces in
    ``special`` (tokenizer_config's special added tokens) become CONTROL, pieces in ``user``
    USER_DEFINED with real spaces; ``added`` (added_tokens.json) appended as USER_DEFINED."""
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = gguf.TokenType.NORMAL
        if sp.IsUnknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif sp.IsControl(i):
            kind = gguf.TokenType.CONTROL
        elif sp.IsUnused(i):
            kind = gguf.TokenType.UNUSED
        elif sp.IsByte(i):
            kind = gguf.TokenType.BYTE
        piece, score = sp.IdToPiece(i), sp.GetScore(i)
        if piece in special:
            kind, score = gguf.TokenType.CONTROL, -1000.0
        elif piece in user:
            kind, score, piece = gguf.TokenType.USER_DEFINED, -1000.0, piece.replace(SPM, " ")
        tokens.append(piece)
        scores.append(score)
        types.append(int(kind))
    for piece in added:
        tokens.append(piece)
        scores.append(-1000.0)
        types.append(int(gguf.TokenType.USER_DEFINED))
    return Vocab("llama", tokens, types, scores=scores)


# Phi-3's added tokens (its tokenizer_config's added_tokens_decoder, ids 32000.. after Llama-2's
# 32000 pieces), all special.
PHI3_ADDED = ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>",
              "<|placeholder3|>", "<|placeholder4|>", "<|system|>", "<|end|>",
              "<|placeholder5|>", "<|placeholder6|>", "<|user|>")


def phi3_vocab(sp: Any, vocab_size: int) -> Vocab:
    """Phi-3's vocabulary as llama.cpp's converter writes it (Phi3MiniModel.set_vocab): the
    SentencePiece pieces, Phi-3's added tokens as CONTROL right after them, "[PAD{id}]" UNUSED
    tokens up to the model's ``vocab_size`` (32064 for 32011 real ones); bos <s>, eos and pad
    <|endoftext|>, unk <unk>, no automatic BOS / EOS."""
    vocab = sentencepiece_vocab(sp, added=PHI3_ADDED)
    first = sp.vocab_size()
    for i in range(first, first + len(PHI3_ADDED)):
        vocab.token_types[i] = int(gguf.TokenType.CONTROL)
        assert vocab.scores is not None
        vocab.scores[i] = 0.0
    if len(vocab.tokens) > vocab_size:
        raise ValueError(f"{len(vocab.tokens)} tokens do not fit a vocabulary of {vocab_size}")
    for i in range(len(vocab.tokens), vocab_size):
        vocab.tokens.append(f"[PAD{i}]")
        vocab.token_types.append(int(gguf.TokenType.UNUSED))
        assert vocab.scores is not None
        vocab.scores.append(-10000.0)
    vocab.ids = {"bos": sp.bos_id(), "eos": first, "unknown": sp.unk_id(), "padding": first}
    vocab.flags = {"add_bos_token": False, "add_eos_token": False}
    return vocab


def train_byte_level_bpe(specials: Sequence[str], user: Sequence[str] = ()) -> Vocab:
    """A byte-level BPE vocabulary whose merges cross word, digit and whitespace boundaries
    (trained on whole lines), so the split regex a file names changes its ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900, special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(TRAINING, trainer)
    spec = tok.get_vocab()
    tokens = [t for t, _ in sorted(spec.items(), key=lambda kv: kv[1])] + list(user)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    types = [int(gguf.TokenType.CONTROL if t in specials else gguf.TokenType.USER_DEFINED
                 if t in user else gguf.TokenType.NORMAL) for t in tokens]
    return Vocab("gpt2", tokens, types, merges=merges)


def hf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of the GGUF file (the reference)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.cache
def default_hf_tokenizer(path: Path) -> Any:
    """``hf_tokenizer`` of a file no test rewrites (the default model's), read once per process.

    NOTE: transformers converts a GGUF vocabulary in ~5 s; fifteen fixtures each read the default
    model's, so every pytest worker paid ~75 s for the same tokenizer. Nothing mutates it."""
    return hf_tokenizer(path)
