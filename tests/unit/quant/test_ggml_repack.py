"""Q3_K blocks rewritten as Q6_K blocks (fitserve.quant.ggml_repack) hold the same values: the
gguf package's own dequantization of the new blocks equals its dequantization of the file's,
bit for bit, for random blocks (every code, high bit and packed 6-bit scale a random byte),
every scale and code value at its extremes, zero / negative / subnormal / non-finite d."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from fitserve.quant.ggml_repack import Q3K_BYTES, q3k_as_q6k, q3k_fields, repacked
from tests.ggml_random_blocks import random_blocks


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                          np.asarray(b, np.float32).view(np.uint32))


def test_random_blocks_repack_exactly() -> None:
    rng = np.random.default_rng(0)
    q3 = random_blocks(rng, Q.Q3_K, (48, 768))
    q6 = q3k_as_q6k(q3)
    assert q6.shape == (48, 3 * 210) and q6.dtype == np.uint8
    assert same_bits(dequantize(q6, Q.Q6_K), dequantize(q3, Q.Q3_K))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf * 0 in gguf's own dequantization
def test_every_field_at_its_extremes() -> None:
    rng = np.random.default_rng(1)
    n = 64
    blocks = rng.integers(0, 256, (n, Q3K_BYTES), dtype=np.uint8)
    blocks[0, :96] = 0x00  # every code -4 (no high bits, low bits 0)
    blocks[1, :96] = 0xFF  # every code 3
    blocks[2, 96:108] = 0x00  # every scale -32
    blocks[3, 96:108] = 0xFF  # every scale 31
    d = rng.standard_normal(n).astype(np.float16)
    d[4:8] = [0.0, -0.0, np.float16(6e-8), np.float16(-6e-8)]  # zeros and f16 subnormals
    d[8:11] = [np.inf, -np.inf, np.nan]
    d[11:13] = [np.float16(65504), np.float16(-65504)]
    blocks[:, 108:110] = d.view(np.uint8).reshape(n, 2)
    _, scales, codes = q3k_fields(blocks)
    assert scales.min() == -32 and scales.max() == 31 and codes.min() == -4 and codes.max() == 3
    assert same_bits(dequantize(q3k_as_q6k(blocks), Q.Q6_K), dequantize(blocks, Q.Q3_K))


def test_bad_sizes_are_refused() -> None:
    q3 = random_blocks(np.random.default_rng(2), Q.Q3_K, (4, 256))
    assert repacked(q3, "Q3_K", "Q6_K", (4, 256)).shape == (4, 210)
    with pytest.raises(ValueError, match="Q3_K tensor \\[4, 256\\] needs 440 bytes"):
        repacked(q3[:, :-1], "Q3_K", "Q6_K", (4, 256))
    with pytest.raises(ValueError, match="repacked as Q6_K, not Q4_K"):
        repacked(q3, "Q3_K", "Q4_K", (4, 256))
    with pytest.raises(ValueError, match="uint8"):
        q3k_as_q6k(q3.astype(np.int16))


@pytest.mark.parametrize("qtype", [Q.TQ1_0, Q.TQ2_0])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf * 0 in gguf's own dequantization
def test_ternary_blocks_repack_as_q4_0_exactly(qtype: Q) -> None:
    """Random TQ blocks (every code byte random: TQ2_0's code 3 is t = 2, TQ1_0's base-3 bytes
    past 242 decode as gguf reads them) with d random, zero, -0, subnormal, +-inf, NaN."""
    from gguf import GGML_QUANT_SIZES

    from fitserve.quant.ggml_repack import ternary_as_q4_0

    rng = np.random.default_rng(3)
    _, nbytes = GGML_QUANT_SIZES[qtype]
    rows, k = 12, 512
    blocks = rng.integers(0, 256, (rows * k // 256, nbytes), dtype=np.uint8)
    d = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16)
    d[:7] = [0.0, -0.0, np.float16(6e-8), np.inf, -np.inf, np.nan, np.float16(-65504)]
    blocks[:, -2:] = d.view(np.uint8).reshape(-1, 2)
    data = blocks.reshape(rows, -1)
    q4 = ternary_as_q4_0(data, qtype.name)
    assert q4.shape == (rows, k // 32 * 18)
    assert same_bits(dequantize(q4, Q.Q4_0), dequantize(data, qtype))
    assert repacked(data, qtype.name, "Q4_0", (rows, k)).shape == q4.shape
