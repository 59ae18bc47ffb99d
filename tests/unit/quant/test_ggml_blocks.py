"""GgmlBlockWeight: the torch dequantization of raw ggml blocks equals gguf.quants.dequantize bit
for bit (random valid blocks: every code, every 6-bit scale and min code, negative and zero
super-block scales), and fuse / shard / to move whole rows or whole blocks exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from fitserve.quant.ggml_blocks import (
    GGML_BLOCK_TYPES,
    GgmlBlockWeight,
    _scale_min_k4,
    ggml_from_gguf,
)
from tests.ggml_random_blocks import random_blocks

TYPES = [Q[name] for name in GGML_BLOCK_TYPES]
N_ROWS, K_BLOCKS = 64, 16  # 1024 blocks per type: every 6-bit code at every position


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def weight(rng: np.random.Generator, qtype: Q, n: int, k: int) -> tuple[GgmlBlockWeight,
                                                                          np.ndarray]:
    raw = random_blocks(rng, qtype, (n, k))
    return GgmlBlockWeight(qtype.name, n, k, torch.from_numpy(raw.copy())), raw


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_is_gguf_bit_for_bit(qtype: Q) -> None:
    n, k = N_ROWS, K_BLOCKS * GGML_QUANT_SIZES[qtype][0]
    w, raw = weight(np.random.default_rng(int(qtype)), qtype, n, k)
    ref = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)).reshape(n, k)
    got = w.dequantize()
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(bits(got), bits(ref))
    assert (ref < 0).any() and (ref > 0).any() and (ref == 0).any()
    assert torch.equal(bits(w.dequantize_rows(5, 9)), bits(ref[5:9]))
    assert torch.equal(w.dequantize(torch.bfloat16), ref.to(torch.bfloat16))


def test_every_packed_scale_and_min_code_is_exercised() -> None:
    """The 12-byte 6-bit field of Q4_K/Q5_K: over the random blocks of the test above, every
    scale and min code 0..63 occurs at every one of the 8 positions (so every bit path runs),
    and the unpacking matches gguf's own Q4_K.get_scale_min."""
    from gguf.quants import Q4_K

    raw = random_blocks(np.random.default_rng(int(Q.Q4_K)), Q.Q4_K, (N_ROWS, K_BLOCKS * 256))
    scales = raw.reshape(-1, 144)[:, 4:16]
    sc, mn = _scale_min_k4(torch.from_numpy(scales.copy()))
    ref_sc, ref_mn = Q4_K.get_scale_min(scales.copy())
    assert np.array_equal(sc.numpy(), ref_sc) and np.array_equal(mn.numpy(), ref_mn)
    for codes in (sc, mn):
        for j in range(8):
            assert set(codes[:, j].tolist()) == set(range(64)), j


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda q: q.name)
def test_fuse_shard_to(qtype: Q) -> None:
    rng = np.random.default_rng(1)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    k = 2 * 256
    a, _ = weight(rng, qtype, 8, k)
    b, _ = weight(rng, qtype, 4, k)
    fused = a.fuse([b])
    assert fused is not None and fused.shape == (12, k)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert a.nbytes == 8 * k // block_size * type_size and a.format == qtype.name
    assert a.column_block == block_size
    other = Q.Q6_K if qtype != Q.Q6_K else Q.Q4_K
    assert a.fuse([weight(rng, other, 4, k)[0]]) is None  # mixed types: ConcatLinear
    assert a.fuse([weight(rng, qtype, 4, 2 * k)[0]]) is None
    rows = a.shard(0, 3, 7)
    assert torch.equal(rows.dequantize(), a.dequantize()[3:7])
    cols = a.shard(1, block_size, k)
    assert torch.equal(cols.dequantize(), a.dequantize()[:, block_size:])
    with pytest.raises(ValueError, match="multiples of its block"):
        a.shard(1, 0, block_size + 16)
    with pytest.raises(ValueError, match="outside"):
        a.shard(0, 0, 9)
    assert torch.equal(a.to("cpu").blocks, a.blocks)


def test_bad_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="needs uint8 blocks"):
        GgmlBlockWeight("Q4_K", 2, 256, torch.zeros(2, 143, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole blocks"):
        GgmlBlockWeight("Q4_K", 2, 128, torch.zeros(2, 72, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cannot be held"):
        GgmlBlockWeight("Q3_K", 1, 256, torch.zeros(1, 110, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown ggml type"):
        GgmlBlockWeight("Q9_K", 1, 256, torch.zeros(1, 110, dtype=torch.uint8))
    with pytest.raises(ValueError, match="needs 288 bytes"):
        ggml_from_gguf(np.zeros(200, np.uint8), "Q4_K", (2, 256))


def test_from_gguf_moves_whole_rows() -> None:
    rng = np.random.default_rng(2)
    raw = random_blocks(rng, Q.Q5_K, (6, 512))
    order = np.array([1, 0, 3, 2, 5, 4])
    w = ggml_from_gguf(raw, "Q5_K", (6, 512), order)
    ref = np.asarray(gguf_dequantize(raw, Q.Q5_K)).reshape(6, 512)[order]
    assert torch.equal(w.dequantize(), torch.from_numpy(np.ascontiguousarray(ref)))
