"""MXFP4 (e2m1 codes, one e8m0 exponent per 32) held as ggml blocks: the block dequantization
against gguf-py's, bit for bit over every exponent byte; transformers' checkpoint layout
(``*_blocks`` / ``*_scales``) converted to ggml blocks against transformers' own CPU
dequantization, bit for bit; GgmlLinear on MXFP4 against float64 F.linear; the ledger's 4.25
bits per weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from fitserve.ledger.formats import weight_format
from fitserve.loading.mxfp4 import hf_mxfp4_to_ggml
from fitserve.model.ggml_linear import GgmlLinear
from fitserve.quant.ggml_blocks import GgmlBlockWeight, dequantize_blocks


def every_exponent_blocks(rng: np.random.Generator) -> np.ndarray:
    """256 random blocks whose exponent bytes are 0..255 (subnormal to 2^127 scales)."""
    raw = rng.integers(0, 256, (256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    return raw


def ggml_to_hf(ggml: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 rows [..., G * 17] -> transformers' (blocks [..., G, 16], scales [..., G]):
    the inverse nibble move, written out independently of fitserve's."""
    g = ggml.reshape(*ggml.shape[:-1], -1, 17)
    qs = g[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element j (< 16) low, j + 16 high
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), g[..., 0].copy()


def test_dequantize_is_gguf_py_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 256)) * np.exp(rng.uniform(-20, 20, (4, 1)))).astype(np.float32)
    for raw in (gguf_quantize(x, Q.MXFP4), every_exponent_blocks(rng)):
        with np.errstate(over="ignore"):
            want = np.asarray(gguf_dequantize(raw, Q.MXFP4), np.float32).reshape(raw.shape[0], -1)
        ours = dequantize_blocks(torch.from_numpy(raw.copy()), "MXFP4").numpy()
        assert np.array_equal(ours.view(np.uint32), want.view(np.uint32))


def test_checkpoint_layout_is_transformers_dequantization() -> None:
    """[E, N, K/32, 16] blocks + [E, N, K/32] scales -> ggml rows whose dequantization is
    transformers' convert_moe_packed_tensors (its result is [E, K, N]: x @ W)."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(1)
    e, n, k = 2, 6, 64
    raw = every_exponent_blocks(rng)[rng.permutation(256)[: e * n * k // 32]]
    raw[:, 0] = rng.integers(100, 150, raw.shape[0])  # exponents fp32 holds without overflow
    blocks, scales = ggml_to_hf(raw.reshape(e, n, k // 32 * 17))
    ggml = hf_mxfp4_to_ggml(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert np.array_equal(ggml.numpy().reshape(-1, 17), raw)
    ref = mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                           dtype=torch.float32)  # [E, K, N]
    ours = dequantize_blocks(ggml.reshape(e * n, -1), "MXFP4").reshape(e, n, k)
    assert torch.equal(ours.transpose(1, 2), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_equals_float64_reference(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 96)).astype(np.float32) * 0.1
    raw = gguf_quantize(w, Q.MXFP4)
    ref = torch.from_numpy(np.asarray(gguf_dequantize(raw, Q.MXFP4), np.float32).reshape(24, 96))
    held = GgmlBlockWeight("MXFP4", 24, 96, torch.from_numpy(raw.copy()))
    assert held.nbytes * 8 == 24 * 96 * 4.25 == 24 * 96 * weight_format("MXFP4").bits_per_weight
    bias = torch.randn(24)
    lin = GgmlLinear(held, bias.to(dtype))
    x = torch.randn(3, 96).to(dtype)
    want = x.double() @ ref.double().T + bias.to(dtype).double()
    tol = 1e-5 if dtype == torch.float32 else 0.03
    torch.testing.assert_close(lin(x).double(), want, rtol=tol, atol=tol * float(want.abs().max()))
