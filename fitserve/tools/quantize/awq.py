"""AWQ-style activation-aware scaling (Lin et al., 2023): protect the input channels that carry
large activations by scaling them up in the weight before round-to-nearest, and down in the op
that produces the input, so the float model computes the same function::

    y = x W^T = (x / s) (W diag(s))^T          s [K] > 0, one factor per input channel

    s = abs_mean^alpha / sqrt(max * min)        alpha on a grid 0, 1/grid, ... (grid-1)/grid

For each alpha the RTN of ``W diag(s)`` (the engine's quantizer, same bits and group) is tried
on the calibration sample and the alpha with the least output error
``|| (X / s) Q(W diag(s))^T - X W^T ||^2`` wins (alpha = 0 is plain RTN, so AWQ never does
worse than RTN on the sample). As AutoAWQ / llm-awq, per decoder layer:

    input_layernorm          -> q_proj, k_proj, v_proj   (the norm's weight divided by s)
    v_proj (its output rows) -> o_proj                   only without GQA (see below)
    post_attention_layernorm -> gate_proj, up_proj
    up_proj (its output rows)-> down_proj                (silu(gate) * up is linear in up)

NOTE: o_proj's input channel ``h * D + d`` is v's channel ``kv(h) * D + d``; with grouped-query
attention several heads read one v channel, so o_proj's scales could not be folded into v_proj
unless they agreed across the group: o_proj is left unscaled then (AutoAWQ does the same: it
scales v -> o only when the two weights have the same shape).

All scales are searched on the original weights with statistics from one pass of the float
model (fitserve.tools.quantize.calibration), then applied; the result is float32 weights, and RTN of
them is "AWQ". AutoAWQ's optional weight-clipping search is not done (it changes the float
function; the transform here keeps it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fitserve.quant.rtn import f16_round_down, f16_round_up

if TYPE_CHECKING:
    from fitserve.config import ModelSpec
    from fitserve.tools.quantize.stats import LinearStats


def fake_rtn(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool) -> torch.Tensor:
    """The engine's RTN then dequantization of ``w [N, K]``, in float32 without packing: the
    scales/mins rounded to float16 the same way as ``fitserve.quant.rtn`` (the codes are
    rounded in float32, so an exact .5 tie can land the other way: a search-loss helper)."""
    return fake_rtn_(w.float().clone(), bits, group_size, symmetric)


def fake_rtn_(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool
              ) -> torch.Tensor:
    """:func:`fake_rtn` in place on a contiguous float32 ``w`` (returned).

    NOTE: no zero-padded copy: the full groups are a strided view, the short last group is
    quantized on its own with 0 joined to its min/max (what RTN's zero padding amounts to).
    """
    n, k = w.shape
    g = (-(-k // 32) * 32) if group_size is None else group_size
    full = k // g * g
    if full:
        _fake_groups_(w[:, :full].view(n, full // g, g), bits, symmetric, False)
    if full < k:
        _fake_groups_(w[:, full:].unsqueeze(1), bits, symmetric, True)
    return w


def _fake_groups_(grp: torch.Tensor, bits: int, symmetric: bool, padded: bool) -> None:
    """RTN + dequantization in place of groups ``grp [N, groups, G]`` (a view of the weight);
    ``padded``: the group stands for a zero-padded one (0 joins its min and max)."""
    # NOTE: the per-group scale/min in float64 as rtn.py does (a float32 (hi - m) / 15 can
    # land just past a float16 value and round up one step more); only the codes are float32.
    # (amin and amax apart: 3x faster than torch.aminmax over a short last dimension)
    lo = grp.amin(-1, keepdim=True).double()
    hi = grp.amax(-1, keepdim=True).double()
    if padded:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    m: torch.Tensor | None = None
    if bits == 8:
        s = f16_round_up(torch.maximum(-lo, hi) / 127).float()
        lo_q, hi_q = -127.0, 127.0
    elif symmetric:
        s = f16_round_up(torch.maximum(lo.neg().clamp(min=0) / 8, hi.clamp(min=0) / 7)).float()
        lo_q, hi_q = -8.0, 7.0
    else:
        m16 = f16_round_down(lo)
        s = f16_round_up((hi - m16.double()) / 15).float()
        lo_q, hi_q, m = 0.0, 15.0, m16.float()
    if m is not None:
        grp.sub_(m)
    grp.div_(torch.where(s > 0, s, 1.0)).round_().clamp_(lo_q, hi_q).mul_(s)
    if m is not None:
        grp.add_(m)


def candidate_scales(abs_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """AutoAWQ's ``s = abs_mean^alpha`` (floored at 1e-4), divided by ``sqrt(max s * min s)``
    so the scales straddle 1 (then weights and the folded op stay in range)."""
    s = abs_mean.float().pow(alpha).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def awq_search_scale(w: torch.Tensor, sample: torch.Tensor, abs_mean: torch.Tensor, *,
                     bits: int, group_size: int | None, symmetric: bool, grid: int = 20
                     ) -> tuple[torch.Tensor, float, float]:
    """(best s [K] float32, its output error, the error at s = 1 i.e. RTN) for the weights
    ``w [N, K]`` (all linears reading one input, stacked) on the input rows ``sample [S, K]``.
    Errors are mean squared output differences on the sample."""
    if grid <= 0:
        raise ValueError(f"grid must be positive, got {grid}")
    w = w.float().contiguous()
    x = sample.float()
    ref = x @ w.T
    # NOTE: the scratch is allocated once: fresh large tensors per grid point cost as much as
    # the arithmetic (page faults), so the scaled weight and the output are reused in place.
    ws = torch.empty_like(w)
    out = torch.empty_like(ref)
    best_s = torch.ones(w.shape[1])
    best = rtn_loss = float("inf")
    for i in range(grid):
        s = candidate_scales(abs_mean, i / grid)
        fake_rtn_(torch.mul(w, s, out=ws), bits, group_size, symmetric)
        torch.mm(x / s, ws.T, out=out)
        loss = float(torch.linalg.vector_norm(out.sub_(ref))) ** 2 / max(out.numel(), 1)
        if i == 0:
            rtn_loss = loss
        if loss < best:
            best, best_s = loss, s
    return best_s, best, rtn_loss


def _scale_sets(spec: ModelSpec, layer: int) -> list[tuple[str, str, list[str]]]:
    """(kind of the op before, its weight name, the linears reading its output) of one layer:
    kind "norm" divides a norm's weight by s, "rows" divides a linear's output rows (and bias)."""
    p = f"model.layers.{layer}."
    a, m = p + "self_attn.", p + "mlp."
    sets = [("norm", p + "input_layernorm.weight",
             [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])]
    if spec.num_heads == spec.num_kv_heads:  # v channel c is o_proj's input channel c
        sets.append(("rows", a + "v_proj.weight", [a + "o_proj.weight"]))
    sets.append(("norm", p + "post_attention_layernorm.weight",
                 [m + "gate_proj.weight", m + "up_proj.weight"]))
    sets.append(("rows", m + "up_proj.weight", [m + "down_proj.weight"]))
    return sets


def awq_transform(weights: dict[str, torch.Tensor], spec: ModelSpec,
                  stats: dict[str, LinearStats], *, bits: int, group_size: int | None,
                  symmetric: bool, grid: int = 20) -> dict[str, torch.Tensor]:
    """All of ``weights`` (HF names, same keys) as float32, with every decoder layer's AWQ
    scales searched (``awq_search_scale``) and folded in: linears' columns times s, the op
    before divided by s. RTN of the result is AWQ; the float function is unchanged.

    A set of linears without stats, or o_proj under grouped-query attention, is left as is.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    out = {name: t.detach().float().clone() for name, t in weights.items()}
    for layer in range(spec.num_layers):
        found: list[tuple[str, str, list[str], torch.Tensor]] = []
        for kind, before, linears in _scale_sets(spec, layer):
            st = stats.get(linears[0])
            if st is None or before not in out or st.sample.shape[0] == 0:
                continue
            w = torch.cat([out[n] for n in linears])
            s, _, _ = awq_search_scale(w, st.sample, st.abs_mean, bits=bits,
                                       group_size=group_size, symmetric=symmetric, grid=grid)
            found.append((kind, before, linears, s))
        # NOTE: every set of a layer is searched on its original weights, then all are applied
        # (AutoAWQ's order): up_proj's rows divided for down_proj scale a whole row, which
        # RTN follows exactly but for float16 rounding of the row's scales.
        for kind, before, linears, s in found:
            for n in linears:
                out[n] = out[n] * s
            if kind == "norm":
                out[before] = out[before] / s
            else:
                out[before] = out[before] / s.unsqueeze(1)
                bias = before.removesuffix(".weight") + ".bias"
                if bias in out:
                    out[bias] = out[bias] / s
    return out
