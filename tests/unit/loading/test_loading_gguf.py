"""GGUF loading on small files written here with gguf.GGUFWriter: types, names, metadata, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from fitserve.config import RopeScaling
from fitserve.loading import (
    MissingTensorError,
    ModelLoadError,
    load_model,
)
from fitserve.loading.gguf import llama3_factors
from fitserve.loading.support import EngineCannotRunError
from fitserve.loading.tokenizer import bytes_to_unicode

# Sizes: every row length is a multiple of 256, so k-quant blocks fit.
H, FF, HEADS, KV, HD, VOCAB = 256, 256, 4, 2, 64, 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Special tokens, the 256 byte symbols, and a few merges (" t", "he", " the")."""
    byte_syms = list(bytes_to_unicode().values())
    merged = ["Ġt", "he", "Ġthe"]
    tokens = SPECIALS + byte_syms + merged
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    merges = ["Ġ t", "h e", "Ġt he"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute (HF halves -> interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((VOCAB, H)),
        "output_norm.weight": rng.uniform(0.5, 1.5, H),
    }
    if not tied:
        w["output.weight"] = rng.standard_normal((VOCAB, H))
    shapes = {
        "attn_q": (HEADS * HD, H),
        "attn_k": (KV * HD, H),
        "attn_v": (KV * HD, H),
        "attn_output": (H, HEADS * HD),
        "ffn_gate": (FF, H),
        "ffn_up": (FF, H),
        "ffn_down": (H, FF),
    }
    for name, shape in shapes.items():
        w[f"blk.0.{name}.weight"] = rng.standard_normal(shape)
    w["blk.0.attn_norm.weight"] = rng.uniform(0.5, 1.5, H)
    w["blk.0.ffn_norm.weight"] = rng.uniform(0.5, 1.5, H)
    if arch == "qwen2":
        for name, rows in (("attn_q", HEADS * HD), ("attn_k", KV * HD), ("attn_v", KV * HD)):
            w[f"blk.0.{name}.bias"] = rng.standard_normal(rows)
    if arch == "qwen3":
        w["blk.0.attn_q_norm.weight"] = rng.uniform(0.5, 1.5, HD)
        w["blk.0.attn_k_norm.weight"] = rng.uniform(0.5, 1.5, HD)
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_gguf(
    path: Path,
    arch: str = "llama",
    qtype: Q = Q.F32,
    tied: bool = False,
    omit: tuple[str, ...] = (),
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Write a one-layer model; 2-D weights stored as ``qtype``. Returns the (HF-layout) originals."""
    originals = hf_weights(arch, tied)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name((meta or {}).get("name", f"tiny-{arch}"))
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_key_length(HD)
    writer.add_rope_freq_base((meta or {}).get("theta", 10000.0))
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    if (meta or {}).get("sliding_window"):
        writer.add_sliding_window(meta["sliding_window"])
    tokens, merges, types = tiny_vocab()
    writer.add_tokenizer_model((meta or {}).get("tokenizer_model", "gpt2"))
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    for name, arr in originals.items():
        if name in omit:
            continue
        stored = arr
        if arch == "llama" and name.startswith("blk.0.attn_q.weight"):
            stored = permute(arr, HEADS)
        elif arch == "llama" and name.startswith("blk.0.attn_k.weight"):
            stored = permute(arr, KV)
        if raw and name in raw:
            data, rtype = raw[name]
            writer.add_tensor(name, data, raw_dtype=rtype)
        elif arr.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(name, quantize(stored, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, stored)
    if "rope_freqs" in (meta or {}):
        writer.add_tensor("rope_freqs.weight", meta["rope_freqs"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


HF_NAME = {
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    "token_embd.weight": "model.embed_tokens.weight",
}
QUANT_TOL = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 2e-2, Q.Q4_0: 0.3, Q.Q4_1: 0.3}  # x max|block|


@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name
)
def test_quantized_types_dequantize_like_gguf_and_near_original(tmp_path: Path, qtype: Q) -> None:
    try:
        quantize(np.zeros((1, 256), np.float32), qtype)
    except NotImplementedError:
        pytest.skip(f"gguf.quants cannot quantize {qtype.name} (see the raw-block test)")
    path = tmp_path / "m.gguf"
    originals = write_gguf(path, qtype=qtype)
    loaded = load_model(path)
    assert loaded.weight_format == qtype.name and loaded.file_format == "gguf"
    for gname, hname in HF_NAME.items():
        orig = originals[gname]
        n = HEADS if "attn_q" in gname else KV
        stored = permute(orig, n) if "attn_q" in gname or "attn_k" in gname else orig
        ref = dequantize(quantize(stored, qtype), qtype) if qtype != Q.F32 else stored
        if "attn_q" in gname or "attn_k" in gname:  # the loader undoes the permutation
            ref = ref.reshape(n, HD // 2, 2, H).swapaxes(1, 2).reshape(ref.shape)
        got = loaded.weights[hname].numpy()
        np.testing.assert_array_equal(got, ref)
        tol = QUANT_TOL.get(qtype, 0.0) * float(np.abs(orig).max())
        assert float(np.abs(got - orig).max()) <= tol, (qtype.name, gname)


def _random_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random k-quant blocks with sane float16 scales (bytes at fixed offsets per block)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    scales = (
        rng.uniform(0.001, 0.05, (rows, cols // block_size, 2)).astype(np.float16).view(np.uint8)
    )
    if qtype == Q.Q4_K:  # d, dmin (f16) lead the block
        blocks[..., 0:4] = scales.reshape(rows, cols // block_size, 4)
    else:  # Q6_K: d (f16) ends the block
        blocks[..., -2:] = scales[..., :2]
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_raw_blocks_dequantize_like_gguf(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(1)
    raw = {
        "blk.0.ffn_down.weight": (_random_k_blocks(qtype, H, FF, rng), qtype),
        "blk.0.attn_k.weight": (_random_k_blocks(qtype, KV * HD, H, rng), qtype),
    }
    path = tmp_path / "k.gguf"
    write_gguf(path, raw=raw)
    loaded = load_model(path)
    down = loaded.weights["model.layers.0.mlp.down_proj.weight"].numpy()
    np.testing.assert_array_equal(down, dequantize(raw["blk.0.ffn_down.weight"][0], qtype))
    k = dequantize(raw["blk.0.attn_k.weight"][0], qtype)
    k = k.reshape(KV, HD // 2, 2, H).swapaxes(1, 2).reshape(k.shape)
    np.testing.assert_array_equal(
        loaded.weights["model.layers.0.self_attn.k_proj.weight"].numpy(), k
    )
    assert np.isfinite(down).all() and down.std() > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_spec_names_and_permutation_per_arch(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    originals = write_gguf(path, arch=arch, tied=arch == "qwen2", meta={"theta": 1e6})
    loaded = load_model(path, dtype=torch.float32)
    spec = loaded.spec
    assert (spec.architecture, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (
        arch,
        1,
        HEADS,
        KV,
    )
    assert (spec.hidden_size, spec.intermediate_size, spec.head_dim, spec.vocab_size) == (
        H,
        FF,
        HD,
        VOCAB,
    )
    assert spec.rope_theta == 1e6 and spec.rms_norm_eps == pytest.approx(1e-6)
    assert (
        spec.max_position_embeddings == 512
        and spec.bos_token_id == 1
        and spec.eos_token_ids == (2,)
    )
    assert spec.tie_word_embeddings == (arch == "qwen2")
    assert spec.attention_bias == (arch == "qwen2") and spec.qk_norm == (arch == "qwen3")
    assert ("lm_head.weight" in loaded.weights) == (arch != "qwen2")
    w = loaded.weights
    # F32 storage: the loaded Q/K are exactly the HF-layout originals (permutation undone for llama)
    np.testing.assert_array_equal(
        w["model.layers.0.self_attn.q_proj.weight"].numpy(), originals["blk.0.attn_q.weight"]
    )
    np.testing.assert_array_equal(
        w["model.layers.0.self_attn.k_proj.weight"].numpy(), originals["blk.0.attn_k.weight"]
    )
    if arch == "qwen2":
        np.testing.assert_array_equal(
            w["model.layers.0.self_attn.q_proj.bias"].numpy(), originals["blk.0.attn_q.bias"]
        )
    if arch == "qwen3":
        np.testing.assert_array_equal(
            w["model.layers.0.self_attn.k_norm.weight"].numpy(),
            originals["blk.0.attn_k_norm.weight"],
        )
    assert (
        loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n"
    )
    bf = load_model(path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf.weights.values())


def test_tiny_tokenizer_merges_and_specials(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write_gguf(path)
    tok = load_model(path).tokenizer
    ids = tok.encode("<|im_start|> the")
    assert (
        ids[0] == 1
        and tok.decode(ids) == " the"
        and tok.decode(ids, skip_special_tokens=False) == "<|im_start|> the"
    )
    assert len(ids) == 2  # " the" merged into one token
    assert tok.eos_token_ids == (2,) and set(tok.all_special_ids) >= {0, 1, 2}


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path) -> None:
    rs = RopeScaling(
        "llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    factors = llama3_factors(500000.0, HD, rs)
    assert factors.min() == 1.0 and factors.max() == 32.0  # the test spans all three regions
    path = tmp_path / "l3.gguf"
    write_gguf(path, meta={"theta": 500000.0, "rope_freqs": factors})
    assert load_model(path).spec.rope_scaling == rs


@pytest.mark.parametrize(("theta", "head_dim", "factor", "low", "high", "orig"), [
    (500000.0, 16, 8.0, 1.0, 4.0, 32),  # no factor on the ramp (a tiny test model's config)
    (10000.0, 16, 2.0, 1.0, 4.0, 100),  # one factor on the ramp
    (500000.0, 128, 16.0, 0.7, 3.3, 3000),  # several, off the published grid
    (1e6, 64, 32.0, 2.0, 8.0, 1 << 20),
])
def test_llama3_rope_scaling_solved_from_any_rope_freqs(theta: float, head_dim: int,
                                                        factor: float, low: float, high: float,
                                                        orig: int) -> None:
    """llama.cpp's converter stores llama3 scaling only as the rope_freqs divisors. Parameters
    outside the published ones are solved for: the frequencies the engine then uses equal
    transformers' for the config the file was made from (they were refused before)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fitserve.loading.gguf_spec import infer_llama3
    from fitserve.model.layers import rope_inv_freq

    rs = RopeScaling("llama3", factor, low, high, orig)
    got = infer_llama3(llama3_factors(theta, head_dim, rs), theta, head_dim)
    assert got is not None
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                      rope_parameters={"rope_type": "llama3", "rope_theta": theta,
                                       "factor": factor, "low_freq_factor": low,
                                       "high_freq_factor": high,
                                       "original_max_position_embeddings": orig})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, got), want.float(), rtol=2e-6,
                               atol=0)


def test_rope_freqs_not_from_llama3_is_refused(tmp_path: Path) -> None:
    factors = np.array([1.0, 3.0, 2.0, 4.0] * (HD // 8), dtype=np.float32)  # not monotone
    path = tmp_path / "odd.gguf"
    write_gguf(path, meta={"theta": 500000.0, "rope_freqs": factors})
    with pytest.raises(EngineCannotRunError, match="rope_freqs tensor does not match"):
        load_model(path)


def test_mistral_named_llama_file_and_sliding_window(tmp_path: Path) -> None:
    path = tmp_path / "mistral.gguf"
    write_gguf(path, meta={"name": "Mistral 7B tiny", "sliding_window": 64})
    spec = load_model(path).spec
    assert spec.architecture == "mistral" and spec.sliding_window == 64


# ---------------------------------------------------------------- bad input


def test_missing_file_names_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        load_model(tmp_path / "nope.gguf")


def test_random_bytes_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match=r"junk\.gguf: not a GGUF file"):
        load_model(path)


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.97])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "cut.gguf"
    write_gguf(path, qtype=Q.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: .*(corrupt|truncated)"):
        load_model(path)


def test_tensor_type_unknown_to_gguf_py_is_named(tmp_path: Path) -> None:
    """A ggml type id newer than the installed gguf-py (llama.cpp adds types: Q2_0 is 42) is
    reported with the tensor and the id, not as a corrupt file."""
    path = tmp_path / "newer.gguf"
    write_gguf(path, qtype=Q.Q8_0)
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name)  # then: n_dims u32, n_dims x u64, the type id u32
    n_dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * n_dims
    assert int.from_bytes(data[at:at + 4], "little") == Q.Q8_0
    data[at:at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"newer\.gguf: tensor 'blk\.0\.ffn_up\.weight' "
                       r"has ggml type 250, which the gguf library \(gguf-py .*\) does not know"):
        load_model(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    write_gguf(path, arch="gemma")
    with pytest.raises(
        EngineCannotRunError, match=r"'gemma'.*supported: llama, mistral, qwen2, qwen3"
    ):
        load_model(path)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    """Q8_K (llama.cpp's activation type) is a ggml type gguf-py does not dequantize."""
    path = tmp_path / "q8k.gguf"
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_K]
    data = np.zeros((FF, H // block_size * type_size), np.uint8)
    write_gguf(path, raw={"blk.0.ffn_up.weight": (data, Q.Q8_K)})
    with pytest.raises(EngineCannotRunError,
                       match=r"Q8_K \(1 tensor, e\.g\. 'blk\.0\.ffn_up\.weight'; supported: .*Q5_0.*Q3_K.*IQ4_XS"):
        load_model(path)


def test_missing_tensor(tmp_path: Path) -> None:
    path = tmp_path / "hole.gguf"
    write_gguf(path, omit=("blk.0.ffn_up.weight",))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_model(path)


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    path = tmp_path / "rwkv.gguf"
    write_gguf(path, meta={"tokenizer_model": "rwkv"})
    with pytest.raises(ModelLoadError, match=r"rwkv\.gguf: the engine cannot run this model "
                       r"\(tokenizer model 'rwkv'.*supported: gpt2, llama"):
        load_model(path)


def test_unknown_model_name() -> None:
    with pytest.raises(ModelLoadError, match="not a known model name"):
        load_model("no-such-model-xyz")
