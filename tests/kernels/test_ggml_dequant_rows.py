"""ggml_dequant_rows (a GGUF token embedding's lookup in C++) against gguf-py's dequantization,
bit for bit: every kernel type on random valid blocks (every code, negative and zero scales),
ids repeated and in any shape, float32 / bfloat16 / float16 out (one rounding, as .to()); bad
ids and arguments raise; GgmlEmbedding's kernel and torch paths give the same tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from fitserve.kernels.cpu.ggml_blocks import (
    GGML_KERNEL_TYPES,
    ggml_dequant_rows,
    ggml_kernel_available,
)
from fitserve.model import ggml_linear
from fitserve.model.ggml_linear import GgmlEmbedding
from fitserve.quant.ggml_blocks import GgmlBlockWeight
from tests.ggml_random_blocks import random_blocks

if not ggml_kernel_available("Q4_K"):
    pytest.skip("the ggml_blocks C++ extension could not be built here", allow_module_level=True)

N_ROWS, K_BLOCKS = 64, 8


def table(qtype: Q, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(raw blocks uint8 [N, row bytes], gguf-py's float32 [N, K], K)."""
    k = K_BLOCKS * GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(np.random.default_rng(seed), qtype, (N_ROWS, k))
    ref = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32).reshape(N_ROWS, k)
    return torch.from_numpy(raw.copy()), torch.from_numpy(ref), k


@pytest.mark.parametrize("name", GGML_KERNEL_TYPES)
def test_rows_are_gguf_bit_for_bit(name: str) -> None:
    qtype = Q[name]
    blocks, ref, k = table(qtype, int(qtype))
    assert (ref < 0).any() and (ref > 0).any() and (ref == 0).any()
    ids = torch.tensor([[5, 63, 0, 5], [17, 17, 2, 40]])
    got = ggml_dequant_rows(blocks, ids, name, k, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (2, 4, k)
    assert torch.equal(got.view(torch.int32), ref[ids].view(torch.int32)), name
    every = torch.arange(N_ROWS)
    assert torch.equal(ggml_dequant_rows(blocks, every, name, k, torch.float32).view(torch.int32),
                       ref.view(torch.int32))
    for dtype in (torch.bfloat16, torch.float16):
        out = ggml_dequant_rows(blocks, ids, name, k, dtype)
        want = ref[ids].to(dtype)
        assert out.dtype == dtype and torch.equal(out.view(torch.int16), want.view(torch.int16))
    # a wrong row would be caught: the neighbouring row differs
    assert not torch.equal(got, ref[(ids + 1) % N_ROWS])


def test_bad_ids_and_arguments_raise() -> None:
    blocks, _, k = table(Q.Q4_K, 1)
    for bad in ([N_ROWS], [-1]):
        with pytest.raises(IndexError, match="out of bounds"):
            ggml_dequant_rows(blocks, torch.tensor(bad), "Q4_K", k, torch.float32)
    with pytest.raises(RuntimeError, match="ggml_dequant_rows: no kernel for GGML type"):
        ggml_dequant_rows(blocks, torch.tensor([0]), "Q2_K", k, torch.float32)
    with pytest.raises(RuntimeError, match="blocks must be contiguous uint8"):
        ggml_dequant_rows(blocks, torch.tensor([0]), "Q4_K", k + 256, torch.float32)
    with pytest.raises(RuntimeError, match="dtype must be"):
        ggml_dequant_rows(blocks, torch.tensor([0]), "Q4_K", k, torch.float64)
    empty = ggml_dequant_rows(blocks, torch.zeros(0, dtype=torch.long), "Q4_K", k, torch.bfloat16)
    assert empty.shape == (0, k)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0", "IQ4_XS"])
def test_embedding_kernel_and_torch_paths_agree(name: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    blocks, ref, k = table(Q[name], 7)
    emb = GgmlEmbedding(GgmlBlockWeight(name, N_ROWS, k, blocks), torch.bfloat16)
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]], dtype=torch.int32)
    fast = emb(ids)
    monkeypatch.setattr(ggml_linear, "ggml_kernel_available", lambda t: False)
    slow = emb(ids)
    assert fast.shape == slow.shape == (2, 3, k)
    assert torch.equal(fast, slow) and torch.equal(fast, ref[ids.long()].to(torch.bfloat16))
