"""The held-weight interface: one class per way the engine holds a weight matrix.

Logical weight ``W [N out, K in]``, ``y = x @ W.T``. Every format the engine holds implements
``HeldWeight`` (vLLM's quantize method and llama.cpp's type traits in one small record):

    class            format (fitserve.ledger.formats)       module that runs it (model.linear)
    DenseWeight      f32 / bf16 / f16 (any torch tensor)     DenseLinear
    PackedWeight     int4-g*-asym|sym, int8-g*, int8-ch      PackedLinear   (quant.packed)
    Fp8Weight        fp8, fp8-ch, fp8-block, fp8_e5m2-ch     Fp8Linear      (quant.fp8)
    GgmlBlockWeight  Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_*     GgmlLinear     (quant.ggml_blocks)

A new format is one class here (its tensors, ``fuse``, ``shard``, ``dequantize``), its kernel
module in ``fitserve.model`` (registered in ``model.linear.LINEAR_MODULES``) and its row in
the formats table. Loaders hand dense tensors around as plain ``torch.Tensor`` (norms,
biases, dense matrices: ``HeldTensor``); ``as_held`` wraps one at the boundary of code that
works through this interface, ``as_stored`` unwraps it again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


class HeldWeight(ABC):
    """A weight as the engine holds it; rows (dim 0) are output features."""

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]:
        """The logical shape, ``(N, K)`` for a matrix (as a dense weight's ``.shape``)."""

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    @abstractmethod
    def format(self) -> str:
        """This layout's name in the formats table (``fitserve.ledger.formats``)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held (codes, scales and any zero points)."""

    @property
    def column_block(self) -> int:
        """Input columns a column split must fall on multiples of (1: anywhere)."""
        return 1

    @abstractmethod
    def to(self, device: torch.device | str) -> HeldWeight:
        """The same weight with its tensors on ``device``."""

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense tensor of ``dtype`` (padding dropped)."""

    @abstractmethod
    def fuse(self, rest: Sequence[HeldWeight]) -> HeldWeight | None:
        """This weight with ``rest`` stacked after it along the output rows (fused q/k/v,
        gate/up), exactly; None when the parts cannot share one tensor of this format."""

    @abstractmethod
    def shard(self, dim: int, start: int, stop: int) -> HeldWeight:
        """Rows (``dim`` 0) or input columns (``dim`` 1) ``start:stop`` as a weight of its own
        (tensor parallelism), exact; ValueError where this format cannot split there."""


@dataclass(frozen=True, slots=True)
class DenseWeight(HeldWeight):
    """A plain tensor (any dtype, any rank: biases and norms too)."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def format(self) -> str:
        return _DTYPE_NAMES.get(self.tensor.dtype, str(self.tensor.dtype).removeprefix("torch."))

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def to(self, device: torch.device | str) -> DenseWeight:
        return DenseWeight(self.tensor.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.tensor.to(dtype)

    def fuse(self, rest: Sequence[HeldWeight]) -> DenseWeight | None:
        dense = [p for p in rest if isinstance(p, DenseWeight)]
        if len(dense) != len(rest):
            return None
        return DenseWeight(torch.cat([self.tensor, *(p.tensor for p in dense)]))

    def shard(self, dim: int, start: int, stop: int) -> DenseWeight:
        return DenseWeight(self.tensor.narrow(dim, start, stop - start).clone())


HeldTensor = torch.Tensor | HeldWeight


def as_held(t: HeldTensor) -> HeldWeight:
    """``t`` through the interface: a plain tensor becomes a DenseWeight."""
    return t if isinstance(t, HeldWeight) else DenseWeight(t)


def as_stored(w: HeldWeight) -> HeldTensor:
    """The inverse of ``as_held``: a DenseWeight's tensor, any other weight as it is."""
    return w.tensor if isinstance(w, DenseWeight) else w


def dtype_table_name(dtype: torch.dtype) -> str:
    """The formats table's name of a float dtype ("f32", "bf16", "f16")."""
    return _DTYPE_NAMES[dtype]


def table_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dense table name ("f32", "bf16", "f16"); ValueError otherwise."""
    for dtype, n in _DTYPE_NAMES.items():
        if n == name:
            return dtype
    raise ValueError(f"{name} is not a dense float format")
