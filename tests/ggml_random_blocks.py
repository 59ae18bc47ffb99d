"""Test helper: random but valid raw ggml blocks of any type gguf.quants cannot quantize.

Every code, packed scale and high bit is a random byte; only the float16 super-block scales
(d, dmin, m) are set to bounded values (no inf / NaN), of either sign where the type allows a
sign (a negative dmin is a positive min), with some exactly zero. ``scale`` sets their size so
that dequantized weights stay around ``scale`` (a usable random model).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# type -> byte offsets of its f16 scales and the typical |code x sub-scale| they multiply
F16_FIELDS: dict[Q, tuple[tuple[int, ...], float]] = {
    Q.Q4_K: ((0, 2), 31 * 7.5), Q.Q5_K: ((0, 2), 31 * 15.5), Q.Q6_K: ((208,), 64 * 32),
    Q.Q5_0: ((0,), 16.0), Q.Q5_1: ((0, 2), 15.5), Q.Q2_K: ((80, 82), 7.5 * 1.5),
    Q.Q3_K: ((108,), 32 * 4.0), Q.IQ4_NL: ((0,), 64.0), Q.IQ4_XS: ((0,), 32 * 64.0),
    Q.IQ2_XXS: ((0,), 100.0), Q.IQ3_S: ((0,), 64.0), Q.Q4_0: ((0,), 8.0), Q.Q4_1: ((0, 2), 7.5), Q.Q8_0: ((0,), 64.0),
}


def random_blocks(rng: np.random.Generator, qtype: Q, shape: tuple[int, int],
                  scale: float = 1.0, zero_every: int = 7) -> np.ndarray:
    """uint8 ``[rows, cols / block_size * type_size]``: ``shape`` weights as random blocks.

    Every ``zero_every``-th block has all its f16 scales exactly 0 (a zero super-block), and
    every 11th its first one only (a zero d beside a non-zero min).
    """
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    if cols % block_size:
        raise ValueError(f"{qtype.name} needs columns in multiples of {block_size}, got {cols}")
    nb = rows * cols // block_size
    blocks = rng.integers(0, 256, (nb, type_size), dtype=np.uint8)
    if qtype == Q.MXFP4:  # an e8m0 exponent byte, no f16: 2^(e - 128) x codes up to 12
        center = 128 + int(np.round(np.log2(scale / 6.0)))
        blocks[:, 0] = rng.integers(center - 3, center + 4, nb)
        return blocks.reshape(rows, -1)
    offsets, typical = F16_FIELDS[qtype]
    for i, at in enumerate(offsets):
        mag = rng.uniform(0.2, 1.8, nb) * scale / typical
        sign = rng.choice([-1.0, 1.0], nb)  # negative d and negative dmin (= positive mins)
        d = (mag * sign).astype(np.float16)
        d[::zero_every] = 0
        if i == 0:
            d[::11] = 0
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)
