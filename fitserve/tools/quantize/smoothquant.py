"""SmoothQuant-style W8A8: migrate activation outliers into the weights, then simulate int8
activations x int8 weights on an exact integer GEMM.

W8A8 here: activations per token (row i) dynamic int8, weights per output channel (row k)::

    x_ij ~= a_ij * sx_i          a int8, sx_i = max_j |x_ij| / 127
    w_kj ~= b_kj * sw_k          b int8, sw_k = max_j |w_kj| / 127
    y_ik  = sum_j x_ij w_kj ~= sx_i * sw_k * (sum_j a_ij b_kj)       (an int32 GEMM, then an
                                                                       outer-product rescale)

Why per-INPUT-channel activation scales cannot run on an integer GEMM: with ``x_ij = a_ij sx_j``,

    y_ik = sum_j (a_ij sx_j)(b_kj sw_k) = sw_k * sum_j sx_j a_ij b_kj

``sx_j`` varies with the summed index j, so it sits inside the sum: no factor of i and k
multiplies the integer product ``G_ik = sum_j a_ij b_kj`` into y (``per_channel_rescale_error``
shows even the least-squares best ``r_i c_k G_ik`` stays far off, while dequantize-then-float is
exact). A per-token scale (a factor of i) and a per-channel weight scale (a factor of k) come out
of the sum; that is all an integer GEMM's epilogue can undo.

SmoothQuant (Xiao et al. 2022) moves the difficulty instead: ``y = (x / s) (s * W)^T`` for any
``s_j > 0``; with ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (alpha 0.5) the outlier input
channels shrink and the matching weight columns grow, so per-token int8 of ``x / s`` keeps the
small channels. ``x / s`` costs nothing at run time: it is folded into the preceding RMSNorm's
weight (``RMSNorm(x) * g / s``), ``s`` into the weight's columns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

_QMAX = 127


@functools.cache
def int_mm_available() -> bool:
    """Whether ``torch._int_mm`` (int8 x int8 -> int32) runs here and is exact on a small case
    with an odd row count."""
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, (3, 64), dtype=torch.int8, generator=g)
        b = torch.randint(-127, 128, (64, 40), dtype=torch.int8, generator=g)
        return bool(torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long()))
    except Exception:  # not built for this device: the float64 path runs
        return False


def int_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact integer product ``a [M, K] @ b [N, K].T`` of int8 codes, int64 ``[M, N]``.

    ``torch._int_mm`` (int32 accumulation) where it runs, else float64 of the codes.
    NOTE: float64 is exact here: every partial sum is an integer below K * 127^2 < 2^53 for
    K < 5.5e11, and int32 holds the sum for K < 133,000 (checked).
    """
    if a.shape[1] >= 2**31 // _QMAX**2:
        raise ValueError(f"K = {a.shape[1]} overflows an int32 accumulator")
    if int_mm_available() and a.device.type == "cpu":
        return torch._int_mm(a.contiguous(), b.t().contiguous()).long()
    return (a.to(torch.float64) @ b.to(torch.float64).t()).long()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (codes int8 ``[R, C]``, float32 scales ``[R]``), ``x ~= q * s``,
    ``s = max|row| / 127`` (1 for an all-zero row); rounding in float64."""
    x64 = x.to(torch.float64)
    amax = x64.abs().amax(dim=1)
    s = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax)).to(torch.float32)
    q = torch.round(x64 / s.to(torch.float64).unsqueeze(1)).clamp(-_QMAX, _QMAX)
    return q.to(torch.int8), s


def w8a8_matmul(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """W8A8 ``x [M, K] @ W.T``: x quantized per token, the integer GEMM with int8 weight codes
    ``wq [N, K]``, then rescaled by ``outer(sx, sw)``; float64 ``[M, N]``."""
    xq, sx = quantize_rows(x)
    acc = int_gemm(xq, wq).to(torch.float64)
    return acc * torch.outer(sx.to(torch.float64), sw.to(torch.float64))


@dataclass(frozen=True, slots=True)
class RescaleProof:
    """Relative errors (Frobenius, vs the quantized product ``y_q``) of running per-input-channel
    int8 activations: ``dequant_float`` dequantizes and runs a float32 GEMM; ``best_rescale``
    is the least-squares best ``r_i c_k G_ik`` on the integer GEMM; ``naive_rescale`` uses
    ``c_k = sw_k * mean_j(sx_j)``, r = 1."""

    dequant_float: float
    best_rescale: float
    naive_rescale: float


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def best_rank1_rescale(g: torch.Tensor, y: torch.Tensor, iters: int = 100) -> torch.Tensor:
    """``outer(r, c) * g`` closest to ``y`` in least squares (alternating closed-form steps for
    r and c from c = 1; each step cannot raise the error)."""
    g, y = g.to(torch.float64), y.to(torch.float64)
    c = torch.ones(g.shape[1], dtype=torch.float64)
    r = torch.ones(g.shape[0], dtype=torch.float64)
    for _ in range(iters):
        gc = g * c
        r = (y * gc).sum(1) / (gc * gc).sum(1).clamp(min=1e-300)
        gr = g * r.unsqueeze(1)
        c = (y * gr).sum(0) / (gr * gr).sum(0).clamp(min=1e-300)
    return torch.outer(r, c) * g


def per_channel_rescale_error(x: torch.Tensor, w: torch.Tensor) -> RescaleProof:
    """Quantize ``x [M, K]`` per INPUT channel (``sx_j``) and ``w [N, K]`` per output channel,
    then try to recover ``y_q = sum_j (a_ij sx_j)(b_kj sw_k)`` (float64, the definition) from the
    integer GEMM ``G = a @ b.T`` (see the module docstring for why no rescale can)."""
    xt, sx = quantize_rows(x.t())  # rows of x.T = input channels of x
    a = xt.t()
    b, sw = quantize_rows(w)
    sx64, sw64 = sx.to(torch.float64), sw.to(torch.float64)
    y_q = torch.einsum("ij,j,kj,k->ik", a.to(torch.float64), sx64, b.to(torch.float64), sw64)
    deq = (a.float() * sx) @ (b.float() * sw.unsqueeze(1)).t()
    g = int_gemm(a, b)
    naive = g.to(torch.float64) * (sw64 * sx64.mean()).unsqueeze(0)
    return RescaleProof(_rel(deq.to(torch.float64), y_q), _rel(best_rank1_rescale(g, y_q), y_q),
                        _rel(naive, y_q))


class W8A8Linear(nn.Module):
    """Simulated W8A8 linear: per-output-channel int8 weights (``qweight``, float32
    ``wscale``), per-token dynamic int8 activations, exact integer GEMM; y in x's dtype."""

    qweight: torch.Tensor
    wscale: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        q, s = quantize_rows(weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("wscale", s)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> W8A8Linear:
        """The W8A8 simulation of a dense linear layer."""
        return cls(lin.weight, lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = w8a8_matmul(x2, self.qweight, self.wscale)
        if self.bias is not None:
            y = y + self.bias.to(torch.float64)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def to_w8a8_(model: nn.Module, skip: Sequence[str] = ("lm_head",)) -> int:
    """Replace every ``nn.Linear`` under ``model`` (names ending in ``skip`` excepted) by its
    W8A8Linear simulation, in place; returns how many were replaced."""
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and not n.endswith(tuple(skip))]
    for name in names:
        lin = model.get_submodule(name)
        assert isinstance(lin, nn.Linear)
        model.set_submodule(name, W8A8Linear.from_linear(lin))
    return len(names)


def smoothing_factors(act_amax: torch.Tensor, weight_amax: torch.Tensor,
                      alpha: float = 0.5, eps: float = 1e-5) -> torch.Tensor:
    """``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` per input channel j (float64); maxima
    below ``eps`` are raised to it (a dead channel gets a finite s)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    a = act_amax.to(torch.float64).clamp(min=eps)
    w = weight_amax.to(torch.float64).clamp(min=eps)
    return a.pow(alpha) / w.pow(1.0 - alpha)


def smooth_(norm_weight: torch.Tensor, weights: Iterable[torch.Tensor], act_amax: torch.Tensor,
            alpha: float = 0.5) -> torch.Tensor:
    """Fold SmoothQuant factors in place: ``norm_weight /= s``, each ``W[:, j] *= s_j``; the
    linears are every consumer of the norm's output (q/k/v, or gate/up). Returns s.

    NOTE: s is computed over the weights' stacked columns (one s for all consumers: they share
    the one normalized input, so they must share its division by s).
    """
    ws = list(weights)
    w_amax = torch.stack([w.detach().abs().amax(dim=0) for w in ws]).amax(dim=0)
    s = smoothing_factors(act_amax, w_amax, alpha)
    with torch.no_grad():
        norm_weight.copy_((norm_weight.to(torch.float64) / s).to(norm_weight.dtype))
        for w in ws:
            w.copy_((w.to(torch.float64) * s).to(w.dtype))
    return s


@dataclass(frozen=True, slots=True)
class NormGroup:
    """An RMSNorm and the linear layers that read its output (a decoder layer has two)."""

    name: str
    norm: nn.Module
    linears: tuple[nn.Linear, ...]


def _weight(module: nn.Module) -> torch.Tensor:
    w = module.weight
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is not a tensor")
    return w


def _linears(parent: nn.Module, fused: str, parts: Sequence[str]) -> tuple[nn.Linear, ...]:
    if hasattr(parent, fused):
        return (getattr(parent, fused),)
    return tuple(getattr(parent, p) for p in parts)


def norm_groups(model: nn.Module) -> list[NormGroup]:
    """The (norm, consumers) pairs of every Llama-style decoder layer under ``model``: fitserve's
    (fused qkv_proj / gate_up_proj) or transformers' (q/k/v_proj, gate/up_proj) naming."""
    out: list[NormGroup] = []
    for name, layer in model.named_modules():
        if not all(hasattr(layer, a) for a in ("input_layernorm", "self_attn", "mlp",
                                                "post_attention_layernorm")):
            continue
        attn = _linears(layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        mlp = _linears(layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        out.append(NormGroup(f"{name}.attn", layer.input_layernorm, attn))
        out.append(NormGroup(f"{name}.mlp", layer.post_attention_layernorm, mlp))
    return out


def calibrate_amax(model: nn.Module, run: Callable[[], object]) -> dict[str, torch.Tensor]:
    """max |x_j| per input channel of each norm group's input to its linears (the norm's
    output), over whatever ``run()`` feeds the model; keyed by ``NormGroup.name``."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for g in norm_groups(model):
        def hook(mod: nn.Module, args: tuple[torch.Tensor, ...], key: str = g.name) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0)
            amax[key] = x if key not in amax else torch.maximum(amax[key], x)
        hooks.append(g.linears[0].register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return amax


def smooth_model_(model: nn.Module, act_amax: dict[str, torch.Tensor],
                  alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """Smooth every norm group of ``model`` in place with calibrated maxima; returns s by group.

    o_proj and down_proj are left alone (no norm precedes them; their s would fold into v_proj /
    up_proj rows, which GQA's shared v heads constrain)."""
    return {g.name: smooth_(_weight(g.norm), [lin.weight for lin in g.linears],
                            act_amax[g.name], alpha)
            for g in norm_groups(model)}


def inject_outliers_(model: nn.Module, channels: Sequence[int], factors: Sequence[float]) -> None:
    """Make activation outlier channels without changing the float function: each norm's
    weight ``g_j *= f_j``, its consumers' columns ``W[:, j] /= f_j`` (in place)."""
    groups = norm_groups(model)
    f = torch.ones(_weight(groups[0].norm).shape[0], dtype=torch.float64)
    f[list(channels)] = torch.tensor(list(factors), dtype=torch.float64)
    with torch.no_grad():
        for g in groups:
            gw = _weight(g.norm)
            gw.copy_((gw.to(torch.float64) * f).to(gw.dtype))
            for lin in g.linears:
                lin.weight.copy_((lin.weight.to(torch.float64) / f).to(lin.weight.dtype))
