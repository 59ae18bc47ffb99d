"""Packed int4 / int8 weights: the layout shared by the quantizers, the GGUF loader, the C++
kernels and the model's linear layers (the contract: /work/notes/contract_packed.md).

Logical weight ``W [N out, K in]``, ``y = x @ W.T``, in groups of ``G`` columns along a row.
``K_padded = ceil(K / G) * G``: the weight is zero-padded to ``K_padded`` columns before it is
quantized, and the activations are zero-padded at run time, so padded columns add exactly 0.

int4 ``qweight`` uint8 ``[N, K_padded // 2]``, nibbles in GGUF Q4_0/Q4_1 ``qs`` order per group::

    group g (columns g*G .. g*G+G-1) owns bytes g*G/2 .. g*G/2 + G/2 - 1
    byte g*G/2 + i  =  [ high nibble: column g*G + i + G/2 | low nibble: column g*G + i ]

    asymmetric (``mins`` present):  w = scale * q + min       q in [0, 15]   (GGUF Q4_1)
    symmetric  (``mins`` None):     w = scale * (q - 8)       q in [0, 15]   (GGUF Q4_0)

int8 ``qweight`` int8 ``[N, K_padded]``, ``w = scale * q`` (GGUF Q8_0 is G = 32); per output
channel means ``G = K_padded`` (one scale per row). ``scales``/``mins`` are float16
``[N, K_padded // G]``. Dequantization is float32 arithmetic on the float16 values, in the gguf
package's order (``(d * q) + m``), so it equals ``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fitserve.ledger.formats import packed_format_name
from fitserve.quant.held import HeldWeight

# NOTE: per-channel int8 still pads K to a multiple of 32: the kernels quantize activations in
# blocks of 32 columns, and the contract wants every G to be a multiple of 32.
CHANNEL_PAD = 32


def padded_k(k: int, group_size: int) -> int:
    """``K_padded = ceil(K / G) * G``."""
    return -(-k // group_size) * group_size


def channel_group(k: int) -> int:
    """The group size of per-channel int8 for ``K`` columns: K rounded up to 32."""
    return padded_k(k, CHANNEL_PAD)


@dataclass(frozen=True, slots=True)
class PackedCodes:
    """What tells int4 from int8 codes: how they pack into ``qweight`` and what they mean.

    ``zero``: the code of 0.0 in a symmetric layout (int4: 8, ``w = scale * (q - 8)``; int8:
    0, ``w = q * scale``); asymmetric layouts (int4 only) keep an f16 min instead.
    """

    kind: str
    bits: int
    dtype: torch.dtype  # of qweight
    lo: int  # code range
    hi: int
    zero: int

    @property
    def per_byte(self) -> int:
        """Columns per qweight byte."""
        return 8 // self.bits

    def pack(self, q: torch.Tensor, group_size: int) -> torch.Tensor:
        """Codes ``q [N, K_padded]`` -> qweight; ValueError for a code out of range."""
        if self.bits == 4:
            return pack_int4(q, group_size)
        if q.numel() and (int(q.min()) < self.lo or int(q.max()) > self.hi):
            raise ValueError(f"{self.kind} codes must be in [{self.lo}, {self.hi}]")
        return q.to(self.dtype).contiguous()

    def unpack(self, qweight: torch.Tensor, group_size: int) -> torch.Tensor:
        """qweight -> codes ``[N, K_padded]`` (int4 as uint8 0..15, int8 as they are)."""
        return unpack_int4(qweight, group_size) if self.bits == 4 else qweight

    def dequantize(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                   group_size: int) -> torch.Tensor:
        """float32 ``[R, K_padded]`` from codes ``q [R, K_padded]`` and their f16 scales/mins.

        NOTE: the operations are the gguf package's, in its order: Q4_1 ``(d * q) + m``, Q4_0
        ``d * (q - 8)``, Q8_0 ``q * d``; two separate float32 roundings, never a fused
        multiply-add, so the result equals ``gguf.quants.dequantize`` exactly.
        """
        r, kp = q.shape
        codes = q.reshape(r, kp // group_size, group_size).to(torch.float32)
        s = scales.to(torch.float32).unsqueeze(-1)
        if mins is not None:
            out = (s * codes) + mins.to(torch.float32).unsqueeze(-1)
        elif self.zero:
            out = s * (codes - float(self.zero))
        else:
            out = codes * s
        return out.reshape(r, kp)


CODES: dict[str, PackedCodes] = {
    "int4": PackedCodes("int4", 4, torch.uint8, 0, 15, 8),
    "int8": PackedCodes("int8", 8, torch.int8, -128, 127, 0),
}
KINDS = tuple(CODES)


@dataclass(frozen=True, slots=True)
class PackedWeight(HeldWeight):
    """One quantized weight matrix ``[N, K]`` in the packed layout (see the module docstring).

    Immutable record; the tensors are owned by whoever built it (the model registers them as
    buffers). ``mins`` is present only for asymmetric int4.
    """

    kind: str
    N: int
    K: int
    K_padded: int
    group_size: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_packed(self)

    @property
    def shape(self) -> tuple[int, int]:
        """The logical shape ``(N, K)`` (as a dense weight's ``.shape``)."""
        return (self.N, self.K)

    @property
    def codes(self) -> PackedCodes:
        """The codes' packing and meaning (int4 or int8)."""
        return CODES[self.kind]

    @property
    def num_groups(self) -> int:
        return self.K_padded // self.group_size

    @property
    def symmetric(self) -> bool:
        """No zero point: int8 always, int4 when ``mins`` is None."""
        return self.mins is None

    @property
    def per_channel(self) -> bool:
        """One scale per output row (int8 with ``G = K_padded``)."""
        return self.kind == "int8" and self.num_groups == 1 and self.group_size == channel_group(
            self.K)

    @property
    def format(self) -> str:
        """The name of this layout in the formats table (``fitserve.ledger.formats``)."""
        return packed_format_name(self.kind, self.group_size, symmetric=self.symmetric,
                                  per_channel=self.per_channel)

    @property
    def nbytes(self) -> int:
        """Bytes held: qweight + scales (+ mins)."""
        tensors = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def column_block(self) -> int:
        """Columns split at group bounds (per-channel int8: at the 32-column activation block)."""
        return CHANNEL_PAD if self.per_channel else self.group_size

    def to(self, device: torch.device | str) -> PackedWeight:
        return PackedWeight(self.kind, self.N, self.K, self.K_padded, self.group_size,
                            self.qweight.to(device), self.scales.to(device),
                            None if self.mins is None else self.mins.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def fuse(self, rest: Sequence[HeldWeight]) -> PackedWeight | None:
        """Stacked by ``cat_rows`` where kind, K, group size and symmetry agree."""
        parts = [self, *(p for p in rest if isinstance(p, PackedWeight))]
        return cat_rows(parts) if len(parts) == len(rest) + 1 and can_fuse(parts) else None

    def shard(self, dim: int, start: int, stop: int) -> PackedWeight:
        """Rows move as they are; columns split at group bounds (``column_block``), and
        per-channel int8 keeps each row's scale on every column slice."""
        if dim == 0:
            return self.select_rows(torch.arange(start, stop))
        k = stop - start
        if self.per_channel:  # one scale per row: every column slice keeps it
            g = channel_group(k)
            q = torch.zeros((self.N, g), dtype=torch.int8)
            q[:, :k] = self.qweight[:, start:stop]
            return PackedWeight("int8", self.N, k, g, g, q, self.scales.clone())
        g, b = self.group_size, self.codes.per_byte
        if start % g or stop % g or stop > self.K:
            raise ValueError(f"columns {start}..{stop} do not split at its groups of {g}")
        mins = None if self.mins is None else self.mins[:, start // g:stop // g].clone()
        return PackedWeight(self.kind, self.N, k, k, g, self.qweight[:, start // b:stop // b].clone(),
                            self.scales[:, start // g:stop // g].clone(), mins)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The packed tensors by buffer name (``qweight``, ``scales`` and maybe ``mins``)."""
        out = {"qweight": self.qweight, "scales": self.scales}
        if self.mins is not None:
            out["mins"] = self.mins
        return out

    def select_rows(self, index: torch.Tensor) -> PackedWeight:
        """The weight with its output rows reordered/selected by ``index`` (exact: rows of the
        packed tensors move as they are)."""
        mins = None if self.mins is None else self.mins[index].contiguous()
        return PackedWeight(self.kind, int(index.numel()), self.K, self.K_padded, self.group_size,
                            self.qweight[index].contiguous(), self.scales[index].contiguous(), mins)


def check_packed(pw: PackedWeight) -> None:
    """Raise ValueError unless the tensors have the contract's shapes and dtypes."""
    if pw.kind not in KINDS:
        raise ValueError(f"packed kind must be one of {KINDS}, got {pw.kind!r}")
    g = pw.group_size
    if g <= 0 or g % 32:
        raise ValueError(f"group size must be a positive multiple of 32, got {g}")
    if pw.K_padded != padded_k(pw.K, g) or pw.K <= 0 or pw.N <= 0:
        raise ValueError(f"K={pw.K}, K_padded={pw.K_padded} and G={g} disagree "
                         f"(K_padded must be ceil(K / G) * G, N and K positive)")
    codes = pw.codes
    expect = {"qweight": ((pw.N, pw.K_padded // codes.per_byte), codes.dtype),
              "scales": ((pw.N, pw.num_groups), torch.float16)}
    if pw.mins is not None:
        if not codes.zero:
            raise ValueError(f"{pw.kind} has no mins (it is symmetric)")
        expect["mins"] = ((pw.N, pw.num_groups), torch.float16)
    for name, (shape, dt) in expect.items():
        t = getattr(pw, name)
        if tuple(t.shape) != shape or t.dtype != dt:
            raise ValueError(f"{pw.kind} {name} must be {dt} {list(shape)}, got {t.dtype} "
                             f"{list(t.shape)}")


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes ``q`` (integers 0..15, ``[N, K_padded]``) -> qweight uint8 ``[N, K_padded // 2]``."""
    n, kp = q.shape
    if kp % group_size:
        raise ValueError(f"width {kp} is not a multiple of the group size {group_size}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("int4 codes must be in [0, 15]")
    halves = q.to(torch.uint8).reshape(n, kp // group_size, 2, group_size // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, kp // 2)


def unpack_int4(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """qweight uint8 ``[N, K_padded // 2]`` -> codes uint8 ``[N, K_padded]`` (0..15)."""
    n, half = qweight.shape
    kp = half * 2
    if kp % group_size:
        raise ValueError(f"width {kp} is not a multiple of the group size {group_size}")
    b = qweight.reshape(n, kp // group_size, 1, group_size // 2)
    out = torch.empty(n, kp // group_size, 2, group_size // 2, dtype=torch.uint8,
                      device=qweight.device)
    torch.bitwise_and(b, 0x0F, out=out[:, :, :1])  # NOTE: written in place: 2x faster than cat
    torch.bitwise_right_shift(b, 4, out=out[:, :, 1:])
    return out.reshape(n, kp)


def pack(kind: str, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
         group_size: int, k: int) -> PackedWeight:
    """A PackedWeight from codes ``q [N, K_padded]`` (int4: 0..15; int8: -128..127), float16
    ``scales`` (and ``mins``) ``[N, K_padded // G]``, for a logical width ``k``."""
    if kind not in CODES:
        raise ValueError(f"packed kind must be one of {KINDS}, got {kind!r}")
    n, kp = q.shape
    qweight = CODES[kind].pack(q, group_size)
    return PackedWeight(kind, n, k, kp, group_size, qweight, scales.to(torch.float16).contiguous(),
                        None if mins is None else mins.to(torch.float16).contiguous())


def unpack(pw: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes ``[N, K_padded]``, scales, mins): int4 codes as uint8 0..15, int8 as int8."""
    return pw.codes.unpack(pw.qweight, pw.group_size), pw.scales, pw.mins


def dequantize(pw: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``[N, K]`` (padding dropped), computed in float32, then cast to ``dtype``."""
    q, scales, mins = unpack(pw)
    w = pw.codes.dequantize(q, scales, mins, pw.group_size)[:, : pw.K]
    return w.to(dtype) if dtype != torch.float32 else w.contiguous()


def gather_rows(pw: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the dequantized weight ``[len(ids), K]`` without dequantizing the rest
    (the packed embedding: gather the packed rows, then dequantize them)."""
    mins = None if pw.mins is None else pw.mins.index_select(0, ids)
    return dequantize_rows(pw.kind, pw.K, pw.group_size, pw.qweight.index_select(0, ids),
                           pw.scales.index_select(0, ids), mins, dtype)


def dequantize_rows(kind: str, k: int, group_size: int, qrows: torch.Tensor,
                    scales: torch.Tensor, mins: torch.Tensor | None, dtype: torch.dtype
                    ) -> torch.Tensor:
    """Packed rows (codes, scales, mins of ``kind``) dequantized to ``[rows, k]`` in ``dtype``
    (the codes' padding past ``k`` dropped)."""
    codes = CODES[kind]
    w = codes.dequantize(codes.unpack(qrows, group_size), scales, mins, group_size)
    w = w[:, :k] if w.shape[1] != k else w
    return w.to(dtype)


def cat_rows(parts: Sequence[PackedWeight]) -> PackedWeight:
    """Stack packed weights along the output rows (fused q/k/v, gate/up); all parts must share
    kind, K, group size and symmetry, else ValueError."""
    first = parts[0]
    for p in parts[1:]:
        if (p.kind, p.K, p.group_size, p.symmetric) != (first.kind, first.K, first.group_size,
                                                        first.symmetric):
            raise ValueError(f"cannot fuse {p.format} (K={p.K}) with {first.format} "
                             f"(K={first.K})")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])  # type: ignore[misc]
    return PackedWeight(first.kind, sum(p.N for p in parts), first.K, first.K_padded,
                        first.group_size, torch.cat([p.qweight for p in parts]),
                        torch.cat([p.scales for p in parts]), mins)


def can_fuse(parts: Sequence[PackedWeight]) -> bool:
    """Whether ``cat_rows(parts)`` is exact (same kind, K, group size and symmetry)."""
    keys = {(p.kind, p.K, p.group_size, p.symmetric) for p in parts}
    return len(keys) == 1
