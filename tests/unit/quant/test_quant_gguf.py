"""GGUF weights held as stored: each packed tensor dequantized in fp32 equals the gguf package's
own ``gguf.quants.dequantize`` of the file's blocks, exactly (torch.equal), tensor by tensor.

For GGUF files written here (GGUFWriter + gguf.quants.quantize for Q4_0, Q4_1 and Q8_0, with
llama.cpp's Q/K row permutation applied as its converter does) and for every tensor of the
real SmolLM2 Q4_1 file. K-quants, Q5_0/Q5_1 and IQ4 are held as their raw ggml blocks
(GgmlBlockWeight, fitserve.ledger.formats.GGML_HELD_TYPES) and dequantize exactly too; the other
quantized types (Q2_K, IQ2_*, IQ3_*) and float tensors are dequantized to the model dtype; Q3_K
is held as Q6_K blocks and TQ1_0 / TQ2_0 as packed Q4_0, converted exactly at load.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from fitserve.loading.gguf import read_gguf
from fitserve.loading.gguf_spec import hf_tensor_name, open_gguf
from fitserve.loading.tokenizer import bytes_to_unicode
from fitserve.quant import PackedWeight, dequantize
from fitserve.quant.ggml_blocks import GgmlBlockWeight
from fitserve.quant.gguf_map import packed_from_gguf
from tests.ggml_random_blocks import F16_FIELDS, random_blocks

H, FF, HEADS, KV, HD = 256, 96, 4, 2, 32  # rows of 256: k-quant blocks fit
LLAMA_PERMUTED = {"attn_q": HEADS, "attn_k": KV}
TOKENS = ["<|endoftext|>", *bytes_to_unicode().values(), "he"]
VOCAB = len(TOKENS)  # 258: the embedding's rows are not a multiple of anything


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF split halves -> interleaved pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


K_QUANTS = tuple(F16_FIELDS)  # written as random valid blocks (gguf.quants cannot quantize them)


def write_model(path: Path, types: dict[str, Q], seed: int = 0) -> dict[str, Q]:
    """A one-layer llama GGUF; each 2-D tensor stored as ``types.get(stem, Q8_0)``."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd": (VOCAB, H), "attn_q": (HEADS * HD, H), "attn_k": (KV * HD, H),
              "attn_v": (KV * HD, H), "attn_output": (H, HEADS * HD), "ffn_gate": (FF, H),
              "ffn_up": (FF, H), "ffn_down": (H, FF)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-packed")
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", H),
                       ("feed_forward_length", FF), ("head_count", HEADS),
                       ("head_count_kv", KV), ("key_length", HD), ("vocab_size", VOCAB)):
        getattr(w, f"add_{key}")(value)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_merges(["h e"])
    w.add_token_types([3] + [1] * (VOCAB - 1))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    stored: dict[str, Q] = {}
    for stem, shape in shapes.items():
        name = stem + ".weight" if stem == "token_embd" else f"blk.0.{stem}.weight"
        arr = (rng.standard_normal(shape) * rng.uniform(0.01, 2.0, (shape[0], 1))).astype(
            np.float32)
        arr[0, :32] += 5.0  # a skewed block: the Q4_1 min is far from 0
        if stem in LLAMA_PERMUTED:
            arr = llama_cpp_permute(arr, LLAMA_PERMUTED[stem])
        qtype = types.get(stem, Q.Q8_0)
        stored[name] = qtype
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            w.add_tensor(name, gguf_quantize(arr, qtype), raw_dtype=qtype)
        elif qtype in K_QUANTS:
            w.add_tensor(name, random_blocks(rng, qtype, shape), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf_quantize(arr, qtype), raw_dtype=qtype)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, rng.uniform(0.5, 1.5, H).astype(np.float32))
        stored[name] = Q.F32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def reference(reader: gguf.GGUFReader, name: str, n_heads: dict[str, int]) -> torch.Tensor:
    """gguf's own fp32 dequantization, rows put back into HF order (llama.cpp's permute undone
    by its explicit inverse, independent of the loader's)."""
    t = next(t for t in reader.tensors if t.name == name)
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    arr = np.asarray(gguf_dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    stem = name.split(".")[-2]
    if stem in n_heads:
        n = n_heads[stem]
        arr = arr.reshape(n, shape[0] // n // 2, 2, shape[1]).swapaxes(1, 2).reshape(shape)
    return torch.from_numpy(np.array(arr, order="C"))


def check_every_tensor(path: Path, n_heads: dict[str, int]) -> dict[str, str]:
    """Load as stored (fp32 model dtype) and compare every tensor; return name -> format."""
    spec, held, *_ = read_gguf(path, torch.float32, weights="as-stored")
    reader = open_gguf(path)  # gguf's GGUFReader over a plain array view (3x faster to slice)
    formats = {}
    for t in reader.tensors:
        hf = hf_tensor_name(t.name)
        assert hf is not None
        if hf not in held:  # a tied lm_head is dropped
            continue
        got = held[hf]
        ref = reference(reader, t.name, n_heads)
        if isinstance(got, PackedWeight):
            formats[hf] = got.format
            assert torch.equal(dequantize(got, torch.float32), ref), t.name
        elif isinstance(got, GgmlBlockWeight):
            formats[hf] = got.format
            assert torch.equal(got.dequantize(torch.float32), ref), t.name
        else:
            formats[hf] = str(got.dtype)
            assert got.dtype == torch.float32 and torch.equal(got, ref), t.name
    return formats


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_written_files_held_as_stored_dequantize_exactly(tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / "m.gguf"
    stems = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    write_model(path, {s: qtype for s in stems})
    formats = check_every_tensor(path, LLAMA_PERMUTED)
    want = {Q.Q4_0: "int4-g32-sym", Q.Q4_1: "int4-g32-asym", Q.Q8_0: "int8-g32"}[qtype]
    assert formats["model.layers.0.self_attn.q_proj.weight"] == want
    assert formats["model.layers.0.mlp.down_proj.weight"] == want
    assert formats["model.embed_tokens.weight"] == "int8-g32"
    assert formats["model.norm.weight"] == "torch.float32"


def test_mixed_types_and_k_quants_held_as_blocks(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    write_model(path, {"attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "ffn_up": Q.Q4_K,
                       "ffn_gate": Q.Q6_K, "attn_output": Q.F32, "token_embd": Q.Q4_0})
    formats = check_every_tensor(path, LLAMA_PERMUTED)
    assert formats["model.layers.0.self_attn.k_proj.weight"] == "int4-g32-sym"
    # k-quants as their raw blocks, F32 dense: each equal to gguf's dequantization
    assert formats["model.layers.0.mlp.up_proj.weight"] == "Q4_K"
    assert formats["model.layers.0.mlp.gate_proj.weight"] == "Q6_K"
    assert formats["model.layers.0.self_attn.o_proj.weight"] == "torch.float32"
    assert formats["model.embed_tokens.weight"] == "int4-g32-sym"


@pytest.mark.parametrize(("types", "want"), [
    ({"attn_q": Q.Q5_K, "attn_k": Q.Q5_0, "attn_v": Q.Q5_1, "ffn_up": Q.IQ4_XS,
      "ffn_gate": Q.IQ4_NL, "token_embd": Q.Q6_K},
     {"q_proj": "Q5_K", "k_proj": "Q5_0", "v_proj": "Q5_1", "up_proj": "IQ4_XS",
      "gate_proj": "IQ4_NL", "embed_tokens": "Q6_K"}),
    ({"attn_q": Q.Q3_K, "attn_k": Q.Q2_K, "attn_v": Q.IQ2_XXS, "ffn_up": Q.TQ2_0,
      "ffn_gate": Q.IQ3_S, "token_embd": Q.Q3_K},
     {**dict.fromkeys(["k_proj", "v_proj", "gate_proj"], "torch.float32"),
      "q_proj": "Q6_K", "embed_tokens": "Q6_K",  # Q3_K: Q6_K blocks (ggml_repack)
      "up_proj": "int4-g32-sym"}),  # TQ2_0: Q4_0 blocks, packed
], ids=["held-as-blocks", "dequantized-or-repacked-at-load"])
def test_every_gguf_type_loads_exactly(tmp_path: Path, types: dict[str, Q],
                                       want: dict[str, str]) -> None:
    """Held as blocks (the permuted Q/K rows moved whole) or dequantized at load: every tensor
    equals gguf's own dequantization with llama.cpp's permutation undone independently."""
    path = tmp_path / "m.gguf"
    write_model(path, types)
    formats = check_every_tensor(path, LLAMA_PERMUTED)
    for hf, fmt in formats.items():
        stem = hf.split(".")[-2]
        if stem in want:
            assert fmt == want[stem], hf


def test_row_order_permutes_packed_rows_exactly() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((HEADS * HD, 64)).astype(np.float32)
    blocks = gguf_quantize(llama_cpp_permute(w, HEADS), Q.Q4_1)
    order = llama_cpp_permute(np.arange(HEADS * HD), HEADS)  # where each HF row went
    inverse = np.argsort(order)
    pw = packed_from_gguf(blocks, "Q4_1", (HEADS * HD, 64), inverse)
    ref = gguf_dequantize(gguf_quantize(w, Q.Q4_1), Q.Q4_1)  # per-row blocks: same values
    assert torch.equal(dequantize(pw), torch.from_numpy(ref.reshape(w.shape)))
    with pytest.raises(ValueError, match="bytes"):
        packed_from_gguf(blocks[:-1], "Q4_1", (HEADS * HD, 64))
    with pytest.raises(ValueError, match="no packed layout"):
        packed_from_gguf(blocks, "Q4_K", (HEADS * HD, 64))


@pytest.mark.slow
def test_smollm2_every_tensor_as_stored(smollm2_path: Path) -> None:
    """The real default model: 211 packed tensors (Q4_1 blocks, Q8_0 token_embd) and 61 F32."""
    formats = check_every_tensor(smollm2_path, {"attn_q": 9, "attn_k": 3})
    counts: dict[str, int] = {}
    for f in formats.values():
        counts[f] = counts.get(f, 0) + 1
    assert counts == {"int4-g32-asym": 210, "int8-g32": 1, "torch.float32": 61}
