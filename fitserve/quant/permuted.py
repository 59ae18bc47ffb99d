"""A weight whose input columns are stored in another order: GPTQ act-order (``desc_act``).

GPTQ with act-order quantizes the columns of ``W [N, K]`` in order of decreasing Hessian
diagonal, so group ``g`` (one f16 scale and zero) holds the G columns ``{k : g_idx[k] = g}``,
scattered over the row. The engine's packed layouts want each group to be G adjacent columns,
so the columns are sorted by group (``perm = argsort(g_idx)``, stable) and the activation is
gathered the same way at run time::

    y = x @ W.T = x[:, perm] @ W[:, perm].T        W[:, perm]: groups of G adjacent columns

NOTE: the permutation is kept (not undone): undoing it would put columns of different groups,
with different scales, into one engine group, which no requantization does exactly. The codes,
scales and zero points are the checkpoint's, exactly; the price is one gather of x (K values
per row) before the linear and an int32 index of K entries per weight, which the ledger counts
(the ``-perm`` formats of ``fitserve.ledger.formats``: 4 bytes per input column).

NOTE: q/k/v (gate/up) are not fused although GPTQ gives them one order (their input's): the
ledger counts one index per weight, and a fused weight would hold one for all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fitserve.ledger.formats import PERM_SUFFIX
from fitserve.quant.held import HeldWeight
from fitserve.quant.packed import PackedWeight


@dataclass(frozen=True, slots=True)
class InputPermutedWeight(HeldWeight):
    """``W[:, perm]`` held packed (``inner``) and ``perm``: ``W = inner`` with column ``j`` of
    ``inner`` being column ``perm[j]`` of ``W``."""

    inner: PackedWeight
    perm: torch.Tensor  # int64 [K]

    def __post_init__(self) -> None:
        k = self.inner.K
        if self.perm.shape != (k,) or not torch.equal(torch.sort(self.perm).values,
                                                       torch.arange(k, device=self.perm.device)):
            raise ValueError(f"perm must be a permutation of the {k} input columns")

    @property
    def shape(self) -> tuple[int, int]:
        return self.inner.shape

    @property
    def format(self) -> str:
        return self.inner.format + PERM_SUFFIX

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + 4 * self.inner.K  # the int32 column order

    @property
    def column_block(self) -> int:
        return self.inner.K  # NOTE: a column split would need its own gather: not split

    def to(self, device: torch.device | str) -> InputPermutedWeight:
        return InputPermutedWeight(self.inner.to(device), self.perm.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.inner.dequantize(torch.float32)
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out.to(dtype)

    def fuse(self, rest: Sequence[HeldWeight]) -> None:
        """Never fused (see the module's NOTE): q/k/v run as parts, each with its gather."""
        return None

    def shard(self, dim: int, start: int, stop: int) -> InputPermutedWeight:
        if dim != 0:
            raise ValueError("an act-order (input-permuted) weight is not split by columns")
        return InputPermutedWeight(self.inner.shard(0, start, stop), self.perm)
