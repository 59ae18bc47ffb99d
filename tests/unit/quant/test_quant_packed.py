"""Packed int4/int8 weights and the RTN quantizers, against float64 references written here.

- pack -> unpack round trips are exact (any N, K odd or not a multiple of G, G = 32/64/128);
- the nibble order is the contract's (checked on a hand-written byte example and against the
  gguf package's own Q4_0 block bytes);
- int8 codes keep their sign;
- RTN: |w - w_hat| <= scale / 2 element by element (float64 arithmetic on the stored f16
  scale/min), and asymmetric int4 covers w: min <= w <= min + 15 * scale;
- dequantize() (float32 math) is the float64 value rounded once to float32;
- a PackedWeight's bytes are the formats table's bytes for its format.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from fitserve.ledger.formats import weight_bytes, weight_format
from fitserve.quant import (
    PackedWeight,
    cat_rows,
    dequantize,
    gather_rows,
    pack,
    pack_int4,
    quantize,
    quantize_int4,
    quantize_int8,
    unpack,
    unpack_int4,
)
from fitserve.quant.rtn import f16_round_down, f16_round_up

GROUPS = (32, 64, 128)
shapes = st.tuples(st.integers(1, 9), st.integers(1, 300))


def ref_codes_int4(qweight: np.ndarray, group: int) -> np.ndarray:
    """The contract's nibble order, byte by byte in plain Python (independent of unpack_int4)."""
    n, half = qweight.shape
    out = np.zeros((n, half * 2), np.int64)
    for r in range(n):
        for b in range(half):
            g, i = divmod(b, group // 2)
            out[r, g * group + i] = int(qweight[r, b]) & 0x0F
            out[r, g * group + i + group // 2] = int(qweight[r, b]) >> 4
    return out


def ref_dequant64(pw: PackedWeight) -> np.ndarray:
    """float64 dequantization from the stored tensors (exact: f16 x small integers fits)."""
    q = (ref_codes_int4(pw.qweight.numpy(), pw.group_size) if pw.kind == "int4"
         else pw.qweight.numpy().astype(np.int64))
    s = np.repeat(pw.scales.numpy().astype(np.float64), pw.group_size, axis=1)
    if pw.kind == "int8":
        w = s * q
    elif pw.mins is None:
        w = s * (q - 8)
    else:
        w = s * q + np.repeat(pw.mins.numpy().astype(np.float64), pw.group_size, axis=1)
    return w[:, : pw.K]


def scale_per_element(pw: PackedWeight) -> np.ndarray:
    return np.repeat(pw.scales.numpy().astype(np.float64), pw.group_size, axis=1)[:, : pw.K]


# -- packing ---------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(shape=shapes, group=st.sampled_from(GROUPS), seed=st.integers(0, 2**31 - 1))
def test_int4_pack_unpack_round_trip(shape: tuple[int, int], group: int, seed: int) -> None:
    n, k = shape
    kp = -(-k // group) * group
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, kp), generator=g, dtype=torch.uint8)
    qweight = pack_int4(q, group)
    assert qweight.shape == (n, kp // 2) and qweight.dtype == torch.uint8
    assert torch.equal(unpack_int4(qweight, group), q)
    assert np.array_equal(ref_codes_int4(qweight.numpy(), group), q.numpy())
    scales = torch.rand(n, kp // group, generator=g).half()
    mins = -torch.rand(n, kp // group, generator=g).half()
    for m in (mins, None):
        pw = pack("int4", q, scales, m, group, k)
        q2, s2, m2 = unpack(pw)
        assert torch.equal(q2, q) and torch.equal(s2, scales)
        assert (m2 is None) == (m is None) and (m is None or torch.equal(m2, m))  # type: ignore[arg-type]
        assert pw.format == f"int4-g{group}-{'sym' if m is None else 'asym'}"


@settings(max_examples=40, deadline=None)
@given(shape=shapes, group=st.sampled_from((*GROUPS, None)), seed=st.integers(0, 2**31 - 1))
def test_int8_pack_unpack_round_trip_keeps_signs(shape: tuple[int, int], group: int | None,
                                                 seed: int) -> None:
    n, k = shape
    g = group or -(-k // 32) * 32  # None: per channel (K rounded up to 32)
    kp = -(-k // g) * g
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, kp), generator=gen, dtype=torch.int16)
    q[0, 0] = -128
    scales = (torch.rand(n, kp // g, generator=gen) + 0.5).half()
    pw = pack("int8", q, scales, None, g, k)
    assert pw.qweight.dtype == torch.int8 and torch.equal(unpack(pw)[0].to(torch.int16), q)
    # per channel is the layout G = K rounded up to 32 (a wider single group is int8-g<G>)
    assert pw.per_channel == (g == -(-k // 32) * 32)
    w = dequantize(pw).double().numpy()
    ref = q.double().numpy()[:, :k] * scale_per_element(pw)
    assert np.array_equal(w, ref)
    assert w[0, 0] == -128 * float(scales[0, 0])  # the sign survives


def test_nibble_order_hand_written() -> None:
    # G = 32: byte i holds column i (low nibble) and column i + 16 (high nibble).
    q = torch.zeros(1, 64, dtype=torch.uint8)
    q[0, 0], q[0, 16], q[0, 15], q[0, 31] = 1, 2, 0xF, 3
    q[0, 32], q[0, 48] = 4, 5  # second group: byte 16 = columns 32 (low) and 48 (high)
    packed = pack_int4(q, 32)[0].tolist()
    assert packed[0] == 0x21 and packed[15] == 0x3F and packed[16] == 0x54
    assert sum(packed) == 0x21 + 0x3F + 0x54
    # G = 64: byte i holds column i and column i + 32; the next group starts at byte 32.
    q = torch.zeros(1, 128, dtype=torch.uint8)
    q[0, 1], q[0, 33], q[0, 64], q[0, 96] = 7, 9, 0xA, 0xB
    packed = pack_int4(q, 64)[0].tolist()
    assert packed[1] == 0x97 and packed[32] == 0xBA and sum(packed) == 0x97 + 0xBA


def test_g32_nibble_order_is_gguf_q4_0_qs() -> None:
    """Independent reference: the gguf package's Q4_0 block (f16 d, then 16 bytes of qs)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 64)).astype(np.float32)
    blocks = gguf_quantize(w, Q.Q4_0).reshape(3, 2, 18)
    qs = blocks[:, :, 2:].reshape(3, 32)
    # codes the way ggml's dequantize_row_q4_0 reads them
    codes = np.zeros((3, 64), np.uint8)
    for b in range(2):
        for i in range(16):
            codes[:, b * 32 + i] = qs[:, b * 16 + i] & 0x0F
            codes[:, b * 32 + i + 16] = qs[:, b * 16 + i] >> 4
    assert np.array_equal(pack_int4(torch.from_numpy(codes), 32).numpy(), qs)


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.full((1, 32), 16), 32)
    with pytest.raises(ValueError, match="multiple"):
        PackedWeight("int4", 1, 40, 40, 40, torch.zeros(1, 20, dtype=torch.uint8),
                     torch.zeros(1, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="scales must be"):
        PackedWeight("int4", 1, 32, 32, 32, torch.zeros(1, 16, dtype=torch.uint8),
                     torch.zeros(1, 1, dtype=torch.float32))
    with pytest.raises(ValueError, match="K_padded"):
        PackedWeight("int8", 1, 33, 33, 32, torch.zeros(1, 33, dtype=torch.int8),
                     torch.zeros(1, 1, dtype=torch.float16))


# -- RTN -------------------------------------------------------------------------------------
def weights(seed: int, n: int, k: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, k, generator=g)
    if kind == "skewed":  # all positive, far from 0: the min matters
        return 3.0 + torch.rand(n, k, generator=g) * 0.01
    if kind == "tiny":  # scales below float16's normal range (underflow guard)
        return torch.randn(n, k, generator=g) * 1e-7
    if kind == "mixed":  # a few rows constant or zero, some huge outliers
        w = torch.randn(n, k, generator=g)
        w[0] = 0.0
        if n > 1:
            w[1] = 0.123456
        w[-1, 0] = 300.0
        return w
    raise AssertionError(kind)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, group=st.sampled_from(GROUPS), symmetric=st.booleans(),
       kind=st.sampled_from(["normal", "skewed", "tiny", "mixed"]), seed=st.integers(0, 10**6))
def test_int4_rtn_error_bound(shape: tuple[int, int], group: int, symmetric: bool, kind: str,
                              seed: int) -> None:
    n, k = shape
    w = weights(seed, n, k, kind)
    pw = quantize_int4(w, group, symmetric=symmetric)
    assert (pw.N, pw.K, pw.K_padded, pw.group_size) == (n, k, -(-k // group) * group, group)
    w64, hat = w.double().numpy(), ref_dequant64(pw)
    s = scale_per_element(pw)
    assert np.all(s >= 0) and np.all(np.isfinite(s))
    # the bound, with the scale that is stored (float64 slack for the float64 code choice)
    assert np.all(np.abs(w64 - hat) <= s / 2 * (1 + 1e-12) + 1e-300), np.max(np.abs(w64 - hat) / s)
    if not symmetric:
        m = np.repeat(pw.mins.numpy().astype(np.float64), group, axis=1)[:, :k]  # type: ignore[union-attr]
        assert np.all(hat >= m) and np.all(hat <= m + 15 * s)
        assert np.all(w64 >= m) and np.all(w64 <= m + 15 * s * (1 + 1e-12))
    # dequantize() in float32 is the exact float64 value rounded once
    assert torch.equal(dequantize(pw), torch.from_numpy(hat).float())
    # not vacuous: the error is real, and stays far below a coarser quantizer's
    if kind == "normal" and k >= 32:
        err = np.abs(w64 - hat).max()
        assert 0 < err < np.abs(w64).max() / 4


@settings(max_examples=40, deadline=None)
@given(shape=shapes, group=st.sampled_from((*GROUPS, None)),
       kind=st.sampled_from(["normal", "tiny", "mixed"]), seed=st.integers(0, 10**6))
def test_int8_rtn_error_bound(shape: tuple[int, int], group: int | None, kind: str,
                              seed: int) -> None:
    n, k = shape
    w = weights(seed, n, k, kind)
    pw = quantize_int8(w, group)
    w64, hat, s = w.double().numpy(), ref_dequant64(pw), scale_per_element(pw)
    assert np.all(np.abs(w64 - hat) <= s / 2 * (1 + 1e-12) + 1e-300)
    assert int(pw.qweight.abs().max()) <= 127  # RTN codes are symmetric: [-127, 127]
    assert torch.equal(dequantize(pw), torch.from_numpy(hat).float())
    neg = w64 < -s  # clearly negative weights stay negative
    assert np.all(hat[neg] < 0)


def test_rtn_exact_cases_and_errors() -> None:
    zero = torch.zeros(2, 64)
    for pw in (quantize_int4(zero, 32), quantize_int4(zero, 32, symmetric=True),
               quantize_int8(zero), quantize_int8(zero, 32)):
        assert torch.equal(dequantize(pw), zero), pw.format
    const = torch.full((1, 32), 0.5)  # representable in f16: min = 0.5, scale 0, exact
    assert torch.equal(dequantize(quantize_int4(const, 32)), const)
    with pytest.raises(ValueError, match="inf/nan"):
        quantize_int8(torch.tensor([[float("nan")] * 32]))
    with pytest.raises(ValueError, match="float16"):
        quantize_int4(torch.full((1, 32), 40000.0), 32)
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.zeros(1, 32), 48)


def test_f16_rounding_directions() -> None:
    x = torch.tensor([1e-10, 1e-5, 0.1, 1 / 3, 1.0, 1000.3, 2.0**-24], dtype=torch.float64)
    up, down = f16_round_up(x), f16_round_down(x)
    assert torch.all(up.double() >= x) and torch.all(down.double() <= x)
    assert up[0] == 2.0**-24  # a positive scale never underflows to 0
    inf16 = torch.full_like(up, float("inf"))
    # tight: the next float16 below `up` is already below x (and above `down`, above x)
    assert torch.all(torch.nextafter(up, -inf16).double() < x)
    assert torch.all(torch.nextafter(down, inf16).double() > x)


def test_quantize_by_format_name_and_cat_rows() -> None:
    w = torch.randn(40, 70)
    for fmt in ("int4-g32-asym", "int4-g64-sym", "int4-g128-asym", "int8-g32", "int8-ch"):
        pw = quantize(w, fmt)
        assert pw.format == fmt
    a, b = quantize_int4(w[:16], 32), quantize_int4(w[16:], 32)
    both = cat_rows([a, b])
    assert torch.equal(dequantize(both), torch.cat([dequantize(a), dequantize(b)]))
    with pytest.raises(ValueError, match="cannot fuse"):
        cat_rows([a, quantize_int4(w[16:], 64)])
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(gather_rows(both, ids, torch.float32), dequantize(both)[ids])


@settings(max_examples=30, deadline=None)
@given(shape=shapes, fmt=st.sampled_from(["int4-g32-asym", "int4-g32-sym", "int4-g64-asym",
                                          "int4-g128-sym", "int8-g32", "int8-g64", "int8-ch"]))
def test_bytes_are_the_format_tables(shape: tuple[int, int], fmt: str) -> None:
    """One table: the bytes a PackedWeight holds = formats.weight_bytes for its format."""
    n, k = shape
    pw = quantize(torch.randn(n, k), fmt)
    assert pw.nbytes == weight_bytes(n * k, fmt, rows=n)
    f = weight_format(fmt)
    if k % f.block_elements == 0:  # whole groups: bits per weight as the table says
        assert math.isclose(pw.nbytes * 8 / (n * k), f.bits_per_weight + 8 * f.row_scale_bytes / k)


def test_format_table_bits_per_weight() -> None:
    bpw = {name: weight_format(name).bits_per_weight for name in (
        "int4-g32-asym", "int4-g64-asym", "int4-g128-asym", "int4-g32-sym", "int4-g64-sym",
        "int4-g128-sym", "int8-g32", "int8-ch", "bf16", "f32", "Q4_0", "Q4_1", "Q8_0")}
    assert bpw == {"int4-g32-asym": 5.0, "int4-g64-asym": 4.5, "int4-g128-asym": 4.25,
                   "int4-g32-sym": 4.5, "int4-g64-sym": 4.25, "int4-g128-sym": 4.125,
                   "int8-g32": 8.5, "int8-ch": 8.0, "bf16": 16.0, "f32": 32.0,
                   "Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5}
    # the GGUF blocks held as stored take exactly the engine layout's bytes
    for gguf_type, packed in (("Q4_0", "int4-g32-sym"), ("Q4_1", "int4-g32-asym"),
                              ("Q8_0", "int8-g32")):
        assert weight_bytes(576 * 1536, gguf_type) == weight_bytes(576 * 1536, packed, rows=576)
