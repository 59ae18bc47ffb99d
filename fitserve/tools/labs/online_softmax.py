"""Online softmax state (running max, running sum, rescaled accumulator) and exact LSE merges.

For one query row and key tiles S_1, S_2, ... (scores already scaled and masked to -inf):

    m_new = max(m_old, rowmax(S_j))
    P_j   = exp(S_j - m_new)
    l_new = exp(m_old - m_new) * l_old + rowsum(P_j)
    O_new = diag(exp(m_old - m_new)) @ O_old + P_j @ V_j
    finally O = O / l,  LSE = m + log(l)

The NaN trap: a row whose keys so far are all masked has m_old = m_new = -inf, and
exp(m_old - m_new) = exp(-inf - (-inf)) = exp(nan) = nan; likewise exp(S_j - m_new) with
S_j = -inf. The guard replaces m_new by 0 *only inside the exponentials* when it is -inf: every
exp then sees -inf - 0 = -inf and returns 0, the row's state stays (m=-inf, l=0, O=0), and the
finalisation returns O = 0, LSE = -inf. All state is fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

ACC_DTYPE = torch.float32  # NOTE: accumulators are fp32 always; a bf16 sum stalls at 256.


def _guard(m: Tensor) -> Tensor:
    """Replace -inf maxima by 0 for use inside exp(); see the module docstring."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


class OnlineSoftmax:
    """Running (m, l, O) for a block of query rows; rows may carry any leading batch dims.

    Args:
        rows_shape: shape of the row index (e.g. [heads, block_m]).
        head_dim_v: value head dimension.
        device: where the state lives.
    """

    __slots__ = ("m", "l", "acc")

    def __init__(self, rows_shape: tuple[int, ...], head_dim_v: int,
                 device: torch.device | None = None) -> None:
        self.m = torch.full(rows_shape, float("-inf"), dtype=ACC_DTYPE, device=device)
        self.l = torch.zeros(rows_shape, dtype=ACC_DTYPE, device=device)
        self.acc = torch.zeros((*rows_shape, head_dim_v), dtype=ACC_DTYPE, device=device)

    def update(self, scores: Tensor, v: Tensor) -> None:
        """Fold one key tile in. ``scores`` [..., rows, n] fp32 (masked = -inf); ``v`` [..., n, dv]."""
        m_new = torch.maximum(self.m, scores.amax(dim=-1))
        m_safe = _guard(m_new)
        alpha = torch.exp(self.m - m_safe)                  # 0 when m_old = -inf, never NaN
        p = torch.exp(scores - m_safe.unsqueeze(-1))        # 0 at masked entries, never NaN
        self.l = self.l * alpha + p.sum(dim=-1)
        self.acc = self.acc * alpha.unsqueeze(-1) + torch.matmul(p, v.to(ACC_DTYPE))
        self.m = m_new

    def finalize(self) -> tuple[Tensor, Tensor]:
        """Return (O fp32 [..., rows, dv], LSE fp32 [..., rows]); empty rows give (0, -inf)."""
        empty = self.l == 0
        l_safe = torch.where(empty, torch.ones_like(self.l), self.l)
        out = self.acc / l_safe.unsqueeze(-1)
        lse = torch.where(empty, torch.full_like(self.l, float("-inf")), self.m + torch.log(l_safe))
        return out, lse


def unguarded_update(m: Tensor, row_sum: Tensor, acc: Tensor, scores: Tensor, v: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """The textbook recurrence *without* the guard; kept to show (in tests) where NaN comes from."""
    m_new = torch.maximum(m, scores.amax(dim=-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new.unsqueeze(-1))
    return m_new, row_sum * alpha + p.sum(-1), acc * alpha.unsqueeze(-1) + p @ v


def merge_lse(outs: Tensor, lses: Tensor, dim: int = 0) -> tuple[Tensor, Tensor]:
    """Exactly merge partial attention results computed over disjoint key sets.

    ``outs`` [..., P (at ``dim``), ..., dv] normalised partial outputs, ``lses`` the matching
    log-sum-exps (-inf for an empty part). Returns (out, lse) over the union of the key sets:

        lse = log(sum_p exp(lse_p)),   out = sum_p exp(lse_p - lse) * out_p

    Parts with lse_p = -inf get weight 0; if every part is empty the result is (0, -inf).
    """
    if dim < 0:
        raise ValueError("dim must be a non-negative index into lses")
    lses = lses.to(ACC_DTYPE)
    m = lses.amax(dim=dim, keepdim=True)
    m_safe = _guard(m)
    sum_exp = torch.exp(lses - m_safe).sum(dim=dim, keepdim=True)
    empty = sum_exp == 0
    lse = torch.where(empty, torch.full_like(m, float("-inf")),
                      m_safe + torch.log(torch.where(empty, torch.ones_like(sum_exp), sum_exp)))
    weights = torch.exp(lses - _guard(lse))  # 0 for empty parts and for fully empty rows
    out = (weights.unsqueeze(-1) * outs.to(ACC_DTYPE)).sum(dim=dim)
    return out, lse.squeeze(dim)
