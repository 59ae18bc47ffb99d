"""Test helper: write small random-weight GGUF files with gguf's own GGUFWriter.

Any shape the engine runs (head_dim != hidden / heads, one KV head, odd vocabularies, several
layers), any of the tensor types gguf.quants can write (F32, F16, Q8_0, Q4_0 ...) and random
valid blocks of those it cannot (K-quants, IQ4: tests.ggml_random_blocks), with a
byte-level BPE tokenizer in the metadata so the engine can load the file as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from fitserve.loading.tokenizer import bytes_to_unicode
from tests.ggml_random_blocks import random_blocks

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QUANTIZABLE = (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.TQ1_0, Q.TQ2_0)


@dataclass(frozen=True)
class TinyGGUF:
    """What to write; the defaults are a 2-layer llama of 64 hidden, 4 heads, 2 KV heads."""

    arch: str = "llama"
    name: str = ""
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int | list[int] = 2  # a list: per layer (llama.cpp writes such arrays)
    head_dim: int | None = None  # None: hidden // heads (no key_length key written)
    ff: int = 96
    vocab: int = 320
    context: int = 256
    qtype: Q = Q.F32  # the type of every 2-D tensor (vectors stay F32)
    embd_qtype: Q | None = None  # token_embd / output type (None: qtype)
    types: dict[str, Q] = field(default_factory=dict)  # per stem ("attn_v", "ffn_down"): a mix
    std: float = 0.5  # of the random weights (and the size of random blocks' weights)
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    theta: float = 10000.0
    rope_freqs: np.ndarray | None = None
    tokenizer: bool = True
    meta: dict[str, Any] = field(default_factory=dict)  # "key" (without arch.) -> value
    edit: Callable[[gguf.GGUFWriter], None] | None = None  # more metadata


def tiny_vocab(vocab: int) -> tuple[list[str], list[str], list[int]]:
    """Special tokens, the 256 byte symbols, a few merges, padding up to ``vocab`` tokens."""
    tokens = SPECIALS + list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} < {len(tokens)} base tokens")
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, ["Ġ t", "h e", "Ġt he"], types


def tensor_shapes(c: TinyGGUF) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (rows first) of every tensor written."""
    d = c.head_dim or c.hidden // c.heads
    q = c.heads * d
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab, c.hidden),
                                          "output_norm.weight": (c.hidden,)}
    if not c.tied:
        shapes["output.weight"] = (c.vocab, c.hidden)
    for i in range(c.layers):
        b = f"blk.{i}."
        kv = (c.kv_heads[i] if isinstance(c.kv_heads, list) else c.kv_heads) * d
        shapes |= {b + "attn_norm.weight": (c.hidden,), b + "ffn_norm.weight": (c.hidden,),
                   b + "attn_q.weight": (q, c.hidden), b + "attn_k.weight": (kv, c.hidden),
                   b + "attn_v.weight": (kv, c.hidden), b + "attn_output.weight": (c.hidden, q),
                   b + "ffn_gate.weight": (c.ff, c.hidden), b + "ffn_up.weight": (c.ff, c.hidden),
                   b + "ffn_down.weight": (c.hidden, c.ff)}
        if c.qkv_bias:
            shapes |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        if c.qk_norm:
            shapes |= {b + "attn_q_norm.weight": (d,), b + "attn_k_norm.weight": (d,)}
    return shapes


def add_tiny_vocab(w: gguf.GGUFWriter, vocab: int, model: str = "gpt2") -> None:
    """The tiny byte-level vocabulary's metadata (bos 1, eos 2, no automatic BOS), under
    tokenizer model ``model``."""
    tokens, merges, types = tiny_vocab(vocab)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


def write_tiny_gguf(path: Path, c: TinyGGUF, seed: int = 0) -> Path:
    """Write the model ``c`` describes to ``path`` (random weights) and return ``path``."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), c.arch)
    w.add_name(c.name or f"tiny-{c.arch}")
    w.add_block_count(c.layers)
    w.add_context_length(c.context)
    w.add_embedding_length(c.hidden)
    w.add_feed_forward_length(c.ff)
    w.add_head_count(c.heads)
    w.add_head_count_kv(c.kv_heads)
    if c.head_dim is not None:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(c.vocab)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    for key, value in c.meta.items():
        if isinstance(value, list):
            w.add_array(f"{c.arch}.{key}", value)
        elif isinstance(value, str):
            w.add_string(f"{c.arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{c.arch}.{key}", value)
        else:
            w.add_uint32(f"{c.arch}.{key}", int(value))
    if c.edit is not None:
        c.edit(w)
    if c.tokenizer:
        add_tiny_vocab(w, c.vocab)
    for name, shape in tensor_shapes(c).items():
        arr = (rng.standard_normal(shape) * c.std).astype(np.float32)
        if len(shape) == 1:
            arr = np.abs(arr) + 0.5 if "norm" in name else arr
            w.add_tensor(name, arr)
            continue
        qtype = c.embd_qtype if c.embd_qtype is not None and name.startswith(
            ("token_embd", "output.")) else c.qtype
        qtype = c.types.get(name.split(".")[-2], qtype)
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype in QUANTIZABLE:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
        else:  # gguf.quants cannot quantize it: random valid blocks of weights around std
            blocks = random_blocks(rng, qtype, (shape[0], shape[1]), scale=c.std)
            w.add_tensor(name, blocks, raw_dtype=qtype)
    if c.rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", c.rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
