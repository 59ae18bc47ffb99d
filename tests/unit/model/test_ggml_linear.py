"""GgmlLinear / GgmlEmbedding over raw ggml blocks against the plain algorithm on gguf-py's
dequantization: F.linear in float64 (bias included, any leading shape, float32 and bfloat16
x, y in x's dtype), row gathers of the dequantized table, the tied lm_head sharing the
embedding's buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from fitserve.model import ggml_linear
from fitserve.model.ggml_linear import GgmlEmbedding, GgmlLinear, torch_matmul
from fitserve.quant.ggml_blocks import GgmlBlockWeight
from tests.ggml_random_blocks import random_blocks


def held(qtype: Q, n: int, k: int, seed: int = 0) -> tuple[GgmlBlockWeight, torch.Tensor]:
    raw = random_blocks(np.random.default_rng(seed), qtype, (n, k), scale=0.1)
    ref = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), np.float32).reshape(n, k))
    return GgmlBlockWeight(qtype.name, n, k, torch.from_numpy(raw.copy())), ref


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_1], ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_equals_float64_reference(qtype: Q, dtype: torch.dtype) -> None:
    w, ref = held(qtype, 40, 512)
    bias = torch.randn(40)
    lin = GgmlLinear(w, bias.to(dtype))
    lin.force_torch = True
    x = torch.randn(2, 3, 512).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (2, 3, 40)
    want = x.double() @ ref.double().T + bias.to(dtype).double()
    tol = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    assert lin.blocks.data_ptr() == w.blocks.data_ptr()  # no copy of the blocks


def test_torch_path_chunks_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row chunks (of 3 rows here: 4 dequantizations) give the result of one chunk."""
    w, ref = held(Q.Q4_K, 10, 256)
    x = torch.randn(4, 256)
    whole = torch_matmul(x, w.blocks, "Q4_K", 10, 256)
    calls: list[int] = []
    real = ggml_linear.dequantize_blocks

    def counted(blocks: torch.Tensor, ggml_type: str) -> torch.Tensor:
        calls.append(blocks.shape[0])
        return real(blocks, ggml_type)

    monkeypatch.setattr(ggml_linear, "_TORCH_CHUNK_ELEMENTS", 3 * 256)
    monkeypatch.setattr(ggml_linear, "dequantize_blocks", counted)
    chunked = torch_matmul(x, w.blocks, "Q4_K", 10, 256)
    assert calls == [3, 3, 3, 1]
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(whole, x @ ref.T)


def test_embedding_gathers_exact_rows_and_ties_the_lm_head() -> None:
    w, ref = held(Q.Q6_K, 50, 256)
    emb = GgmlEmbedding(w, torch.bfloat16)
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    out = emb(ids)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 256)
    assert torch.equal(out, ref[ids].to(torch.bfloat16))
    head = emb.tied_linear()
    assert head.blocks is emb.blocks
    head.force_torch = True  # exact path; the kernel path is checked below
    x = torch.randn(1, 256)
    torch.testing.assert_close(head(x), x @ ref.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda q: q.name)
def test_kernel_path_when_built(qtype: Q) -> None:
    """With the C++ build, the module runs ggml_matmul (int8 activations, as llama.cpp): the
    result is the float64 reference within the activation rounding (|x| max / 127 / 2 per
    element, summed against |w|) and the bf16 output's rounding."""
    w, ref = held(qtype, 24, 512, seed=3)
    lin = GgmlLinear(w)
    assert not lin.uses_kernel(torch.float32)  # a float32 model computes exactly
    if not lin.uses_kernel(torch.bfloat16):
        pytest.skip("the C++ ggml kernels are not built here")
    x = torch.randn(3, 512).to(torch.bfloat16)
    want = x.double() @ ref.double().T
    bound = (x.abs().max(dim=1).values.double() / 127 / 2)[:, None] * ref.double().abs().sum(1)
    # + the bf16 rounding of the float32 result
    got = lin(x).double()
    assert bool(((got - want).abs() <= bound + want.abs() / 128 + 1e-3).all())


@pytest.mark.skipif(not ggml_linear.kernel_available("Q4_K", torch.bfloat16),
                    reason="the ggml_blocks C++ kernel is not built")
def test_kernel_rows_in_bounded_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 x of more rows than ``output_staging_rows`` (7 here) runs in equal pieces (23 rows:
    6, 6, 6, 5), each the bits of one whole call, and the call holds no more than the bf16
    output plus one piece's float32 rows (the ledger's "output staging")."""
    from tests.memory_events import peak_extra

    n, k, m = 40, 512, 23
    w, _ = held(Q.Q4_K, n, k)
    lin = GgmlLinear(w)
    x = torch.randn(m, k).to(torch.bfloat16)
    whole = ggml_linear.ggml_matmul(x, w.blocks, "Q4_K", n, k).to(torch.bfloat16)
    calls: list[int] = []
    real = ggml_linear.ggml_matmul

    def counted(x2: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x2.shape[0])
        return real(x2, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ggml_linear, "output_staging_rows", lambda out_features: 7)
    monkeypatch.setattr(ggml_linear, "ggml_matmul", counted)
    assert torch.equal(lin(x), whole)
    assert calls == [6, 6, 6, 5]
    assert peak_extra(lambda: lin(x)) == m * n * 2 + 6 * n * 4
    calls.clear()
    assert torch.equal(lin(x[:7]), whole[:7]) and calls == [7]  # within the bound: one call
