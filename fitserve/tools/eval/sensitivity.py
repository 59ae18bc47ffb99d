"""Per-matrix sensitivity sweep: quantize one unit at a time, rank the units by the KL it costs.

    result = run_sweep(model, spec, tokens, granularity="matrix")   # a dense float CausalLM
    result.ranked[0].unit.name, result.ranked[0].kl                 # the most damaging unit
    result.mixes[0].kl_mix.mean vs result.mixes[0].kl_sum           # a mix is not the sum

A unit is one matrix of one layer ("matrix": ``L3.down_proj``), every matrix of one layer
("layer": ``L3``), or one matrix kind in every layer ("type": ``down_proj``). Its weights are
RTN-quantized (default ``int4-g128-asym``) and dequantized back into the dense model in place,
so the damage is measured with the same forward pass and restored exactly afterwards:

    qkv_proj rows: [ q: 0 .. q_size | k: .. + kv_size | v: .. + kv_size ]   (fused, one Linear)
    gate_up rows:  [ gate: 0 .. I | up: I .. 2I ]

RTN works row by row (groups run along a row), so quantizing q's rows inside the fused weight
is the same as quantizing q_proj alone.

NOTE: the default format is g128, not the engine's ``--weights int4`` (int4-g32-asym): the
default model's file is GGUF Q4_1, i.e. already on an int4-g32-asym grid, and RTN onto the same
grid gives back (almost exactly) the same weights: no damage to rank.

Price: one reference pass plus one pass per unit (and per mix), each over the same tokens; the
FLOPs are the ledger's prefill FLOPs (plan.flops.prefill_flops, logits at every position), and
a big model's GPU-hours are its FLOPs / (the accelerator's dense bf16 peak x an assumed MFU).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from fitserve.config import ModelSpec
from fitserve.model.llama import CausalLM
from fitserve.quant.packed import dequantize
from fitserve.quant.rtn import quantize
from fitserve.tools.eval.eval import (
    DEFAULT_BOOTSTRAP,
    BootstrapConfig,
    Comparison,
    Interval,
    TokenStats,
    mean_ci,
    paired_verdict,
    token_stats,
)
from fitserve.tools.eval.eval_run import DEFAULT_CHUNK, DEFAULT_WINDOW, iter_logits

MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GRANULARITIES = ("matrix", "layer", "type")
DEFAULT_FORMAT = "int4-g128-asym"
DEFAULT_MIX_SIZES = (2, 4, 8)
DEFAULT_BIG_MODEL = "Llama-3.3-70B"
DEFAULT_GPU = "h100"
# NOTE: teacher-forced scoring is prefill (large GEMMs, compute-bound); 40% of the dense bf16
# peak is a typical prefill MFU for a tuned engine. An assumption, printed with the price.
DEFAULT_MFU = 0.4


@dataclass(frozen=True, slots=True)
class Unit:
    """What one sweep step quantizes: (layer, matrix) pairs."""

    name: str
    parts: tuple[tuple[int, str], ...]


def sweep_units(num_layers: int, granularity: str) -> list[Unit]:
    """The units of a sweep: ``num_layers * 7`` (matrix), ``num_layers`` (layer) or 7 (type)."""
    if granularity == "matrix":
        return [Unit(f"L{i}.{m}", ((i, m),)) for i in range(num_layers) for m in MATRICES]
    if granularity == "layer":
        return [Unit(f"L{i}", tuple((i, m) for m in MATRICES)) for i in range(num_layers)]
    if granularity == "type":
        return [Unit(m, tuple((i, m) for i in range(num_layers))) for m in MATRICES]
    raise ValueError(f"unknown sweep granularity {granularity!r}; known: {', '.join(GRANULARITIES)}")


def matrix_rows(spec: ModelSpec, matrix: str) -> tuple[str, int, int | None]:
    """(module path inside a layer, first row, end row or None = all) of ``matrix``."""
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    table: dict[str, tuple[str, int, int | None]] = {
        "q_proj": ("self_attn.qkv_proj", 0, q), "k_proj": ("self_attn.qkv_proj", q, q + kv),
        "v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "o_proj": ("self_attn.o_proj", 0, None), "gate_proj": ("mlp.gate_up_proj", 0, inter),
        "up_proj": ("mlp.gate_up_proj", inter, 2 * inter), "down_proj": ("mlp.down_proj", 0, None)}
    if matrix not in table:
        raise ValueError(f"unknown matrix {matrix!r}; known: {', '.join(MATRICES)}")
    return table[matrix]


def _weight(model: CausalLM, layer: int, path: str) -> torch.Tensor:
    module = model.layers[layer].get_submodule(path)
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError(f"layer {layer} {path} is not held dense (the sweep quantizes dense "
                         "float weights: load the model with --weights float32 or bf16)")
    return w


@contextmanager
def quantized(model: CausalLM, parts: tuple[tuple[int, str], ...], fmt: str = DEFAULT_FORMAT
              ) -> Iterator[int]:
    """Inside the block, the matrices of ``parts`` hold their RTN ``fmt`` weights dequantized
    (in place); the original values come back on exit. Yields the number of weights changed."""
    saved: list[tuple[torch.Tensor, int, int | None, torch.Tensor]] = []
    changed = 0
    try:
        for layer, matrix in parts:
            path, r0, r1 = matrix_rows(model.spec, matrix)
            w = _weight(model, layer, path)
            rows = w.data[r0:r1]
            saved.append((w, r0, r1, rows.clone()))
            rows.copy_(dequantize(quantize(rows.float(), fmt), w.dtype))
            changed += rows.numel()
        yield changed
    finally:
        for w, r0, r1, orig in reversed(saved):
            w.data[r0:r1].copy_(orig)


@dataclass(frozen=True, slots=True)
class UnitDamage:
    """One unit quantized alone: its KL and flip rate against the unquantized model."""

    unit: Unit
    kl: Interval
    flip_rate: Interval
    weights: int  # weights quantized
    kl_tokens: torch.Tensor = field(repr=False)  # per-position KL (for the mixes)


@dataclass(frozen=True, slots=True)
class MixResult:
    """The top-k units quantized together, against the sum of their single damages."""

    units: tuple[str, ...]
    kl_mix: Interval
    kl_sum: float  # sum of the units' single mean KLs
    diff: Comparison  # per position: mix KL - sum of single KLs (paired bootstrap)
    # mean over positions of |mix KL - sum of single KLs|, over the mean sum: how far from
    # additive position by position, even where the means nearly agree
    rel_abs_dev: float


@dataclass(frozen=True, slots=True)
class SweepCost:
    """Forward passes and FLOPs of a sweep here, and what the same sweep costs a big model."""

    granularity: str
    units: int
    passes: int  # 1 reference + units + mixes
    tokens: int  # tokens per pass
    flops: float  # this model, all passes (the ledger)
    seconds: float  # measured wall time here (0: priced only)
    big_model: str
    big_units: int
    big_passes: int
    big_flops: float
    gpu: str
    gpu_peak_flops: float
    mfu: float
    big_gpu_hours: float

    @property
    def big_gpu_hours_per_mtok(self) -> float:
        """The big model's GPU-hours for a sweep over one million tokens of text."""
        return self.big_gpu_hours * 1e6 / self.tokens


@dataclass(slots=True)
class SweepResult:
    """A sweep: units ranked by damage (largest KL first), the mixes, and the price."""

    granularity: str
    fmt: str
    num_positions: int
    ranked: list[UnitDamage]
    mixes: list[MixResult]
    cost: SweepCost


def pass_flops(spec: ModelSpec, tokens: int, window: int) -> int:
    """Ledger FLOPs of one teacher-forced pass: windows of ``window`` tokens, each a prefill
    with logits at every position."""
    from fitserve.ledger.flops import prefill_flops

    total = 0
    for w0 in range(0, tokens, window):
        n = min(window, tokens - w0)
        total += prefill_flops(spec, n, logit_positions=n).total
    return total


def price_sweep(spec: ModelSpec, granularity: str, tokens: int, *, window: int = DEFAULT_WINDOW,
                num_mixes: int = 0, seconds: float = 0.0, big_model: str = DEFAULT_BIG_MODEL,
                gpu: str = DEFAULT_GPU, mfu: float = DEFAULT_MFU) -> SweepCost:
    """The sweep's passes x tokens, its FLOPs here, and the GPU-hours of the same sweep (same
    tokens, same granularity) on ``big_model`` (a catalog model) at ``mfu`` of ``gpu``'s peak."""
    from fitserve.ledger.hardware import get_hardware
    from fitserve.tools.planner.model_source import catalog_entry

    if not 0 < mfu <= 1:
        raise ValueError(f"MFU must be in (0, 1], got {mfu}")
    big = catalog_entry(big_model).spec
    hw = get_hardware(gpu)
    units = len(sweep_units(spec.num_layers, granularity))
    big_units = len(sweep_units(big.num_layers, granularity))
    passes, big_passes = 1 + units + num_mixes, 1 + big_units + num_mixes
    big_flops = float(big_passes * pass_flops(big, tokens, window))
    return SweepCost(granularity, units, passes, tokens,
                     float(passes * pass_flops(spec, tokens, window)), seconds, big.name or
                     big_model, big_units, big_passes, big_flops, hw.name, hw.bf16_flops, mfu,
                     big_flops / (hw.bf16_flops * mfu) / 3600.0)


def _measure(model: CausalLM, tokens: list[int], ref: list[tuple[int, torch.Tensor]],
             window: int, chunk_size: int) -> TokenStats:
    """Stats of the model as it is now against the stored reference logits."""
    parts = []
    chunks = iter_logits(model, model.spec, tokens, window=window, chunk_size=chunk_size)
    for (off, logits), (_, r) in zip(chunks, ref, strict=True):
        targets = torch.tensor(tokens[off + 1:off + 1 + r.shape[0]])
        parts.append(token_stats(r, logits, targets))
    return TokenStats.cat(parts)


def _mixes(model: CausalLM, ranked: list[UnitDamage], sizes: tuple[int, ...],
           measure: Callable[[], TokenStats], fmt: str, cfg: BootstrapConfig) -> list[MixResult]:
    out = []
    for k in sorted({k for k in sizes if 2 <= k <= len(ranked)}):
        top = ranked[:k]
        with quantized(model, tuple(p for d in top for p in d.unit.parts), fmt):
            stats = measure()
        singles = torch.stack([d.kl_tokens for d in top]).sum(0)
        dev = float((stats.kl - singles).abs().mean() / singles.mean().clamp_min(1e-30))
        out.append(MixResult(tuple(d.unit.name for d in top), mean_ci(stats.kl, cfg),
                             sum(d.kl.mean for d in top),
                             paired_verdict(stats.kl, singles, cfg, "kl_mix-sum"), dev))
    return out


def run_sweep(model: CausalLM, spec: ModelSpec, tokens: list[int], *,
              granularity: str = "matrix", fmt: str = DEFAULT_FORMAT,
              window: int = DEFAULT_WINDOW, chunk_size: int = DEFAULT_CHUNK,
              mix_sizes: tuple[int, ...] = DEFAULT_MIX_SIZES,
              cfg: BootstrapConfig = DEFAULT_BOOTSTRAP,
              progress: Callable[[int, int, str], None] | None = None,
              **price: object) -> SweepResult:
    """Quantize each unit alone, measure KL and flips against the unquantized ``model`` on
    ``tokens``, rank by mean KL; then quantize the top-k together for each k of ``mix_sizes``.
    ``price`` goes to :func:`price_sweep` (big_model, gpu, mfu)."""
    t0 = time.perf_counter()
    units = sweep_units(spec.num_layers, granularity)
    ref = list(iter_logits(model, spec, tokens, window=window, chunk_size=chunk_size))

    def measure() -> TokenStats:
        return _measure(model, tokens, ref, window, chunk_size)

    damages = []
    for i, unit in enumerate(units):
        if progress is not None:
            progress(i, len(units), unit.name)
        with quantized(model, unit.parts, fmt) as n:
            stats = measure()
        damages.append(UnitDamage(unit, mean_ci(stats.kl, cfg), mean_ci(stats.flip, cfg), n,
                                  stats.kl))
    ranked = sorted(damages, key=lambda d: d.kl.mean, reverse=True)
    mixes = _mixes(model, ranked, mix_sizes, measure, fmt, cfg)
    cost = price_sweep(spec, granularity, len(tokens), window=window, num_mixes=len(mixes),
                       seconds=time.perf_counter() - t0, **price)  # type: ignore[arg-type]
    return SweepResult(granularity, fmt, len(tokens) - 1, ranked, mixes, cost)


def sweep_dict(result: SweepResult, top: int | None = None) -> dict[str, object]:
    """JSON-ready: the ranking (``top`` first units, all when None), the mixes and the price."""
    return {
        "granularity": result.granularity, "format": result.fmt,
        "num_positions": result.num_positions,
        "ranked": [{"rank": i + 1, "unit": d.unit.name, "weights": d.weights,
                    "kl": d.kl.as_dict(), "flip_rate": d.flip_rate.as_dict()}
                   for i, d in enumerate(result.ranked[:top])],
        "mixes": [{"units": list(m.units), "kl_mix": m.kl_mix.as_dict(), "kl_sum_singles":
                   m.kl_sum, "mix_minus_sum": m.diff.as_dict(),
                   "relative_abs_deviation": m.rel_abs_dev} for m in result.mixes],
        "cost": {**asdict(result.cost),
                 "big_gpu_hours_per_mtok": result.cost.big_gpu_hours_per_mtok},
    }


def format_sweep(result: SweepResult, top: int = 10) -> str:
    """The ranking, the mixes and the price as readable text."""
    c = result.cost
    lines = [f"sensitivity sweep: one {result.granularity} at a time in {result.fmt} (RTN, "
             f"dequantized), KL vs the unquantized model on {result.num_positions} positions",
             f"{'rank':>4}  {'unit':<16} {'KL nats/token':<30} {'top-1 flip':<24}"]
    for i, d in enumerate(result.ranked[:top]):
        lines.append(f"{i + 1:>4}  {d.unit.name:<16} {_iv(d.kl, '.5f'):<30} "
                     f"{_iv(d.flip_rate, '.2%'):<24}")
    if len(result.ranked) > top:
        lines.append(f"      ... {len(result.ranked) - top} more units (--json lists all)")
    for m in result.mixes:
        ratio = m.kl_mix.mean / m.kl_sum if m.kl_sum > 0 else float("nan")
        names = ", ".join(m.units[:8]) + (f", ... ({len(m.units)})" if len(m.units) > 8 else "")
        lines.append(f"mix of top {len(m.units)} ({names}): KL {_iv(m.kl_mix, '.5f')} vs sum of "
                     f"singles {m.kl_sum:.5f} (x{ratio:.2f}; mix - sum "
                     f"{_iv(m.diff.diff, '+.5f')}: {m.diff.verdict}; per position "
                     f"|mix - sum| = {m.rel_abs_dev:.0%} of the sum)")
    lines.append(
        f"price: {c.passes} passes (1 reference + {c.units} units + {c.passes - 1 - c.units} "
        f"mixes) x {c.tokens} tokens = {c.passes * c.tokens:,} tokens, {c.flops:.3g} FLOPs here "
        f"({c.seconds:.0f} s); the same {result.granularity} sweep of {c.big_model}: "
        f"{c.big_passes} passes, {c.big_flops:.3g} FLOPs = {c.big_gpu_hours:.3g} {c.gpu} GPU-hours "
        f"at {c.mfu:.0%} MFU of {c.gpu_peak_flops / 1e12:.0f} TFLOP/s dense bf16 "
        f"({c.big_gpu_hours_per_mtok:.3g} GPU-hours per 1M tokens of text)")
    return "\n".join(lines)


def _iv(iv: Interval, fmt: str) -> str:
    return f"{iv.mean:{fmt}} [{iv.lo:{fmt}}, {iv.hi:{fmt}}]"
