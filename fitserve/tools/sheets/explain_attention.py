"""`plan explain fa2-vs-fa3`: why softmax's exponentials matter on Hopper, and which
FlashAttention-3 technique hides which stall.

One attention tile: Br query rows against Bc keys at head dim d (d_qk = d_v = d; MLA models
such as DeepSeek-V3 have d_qk = 192, d_v = 128 and the tile does 2 Br Bc (d_qk + d_v)).

           Bc keys                      S = Q K^T  : 2 x Br x Bc x d FLOPs (tensor cores)
        +---------+                     P = exp(S - m) : Br x Bc exponentials (MUFU)
    Br  |  S, P   |  x V (Bc x d)       O += P V   : 2 x Br x Bc x d FLOPs (tensor cores)
        +---------+
                                        matmul FLOPs per exponential = 4 d

Per SM, the tile's matmuls take 4 Br Bc d / (tensor FLOPs per clock) clocks and its
exponentials Br Bc / (MUFU results per clock): their ratio is

    exp time / matmul time = (peak matmul FLOP/s / exp/s) / (4 d)

FlashAttention-2 runs them one after the other in a warp; FlashAttention-3 (Shah et al.,
2024, arXiv 2407.08608) overlaps them.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.params import is_mla
from fitserve.ledger.units import fmt_bytes
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.sheets.explain_common import (
    hardware,
    line,
    model,
    opt_float,
    opt_int,
    opt_str,
    pct,
)
from fitserve.tools.sheets.explain_micro import (
    GpuMicro,
    clock_explain,
    clock_hz,
    gpu_micro,
    per_second,
)
from fitserve.tools.sheets.sheet import Sheet

FLAGS = ("gpu", "model", "head_dim", "tile", "latency_ns")
ACT_BYTES = 2  # bf16 Q, K, V tiles
WGMMA_ROWS = 64  # a Hopper warpgroup MMA (wgmma) computes 64 rows of the tile
WARPGROUP_THREADS = 128
_TILE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_tile(text: str) -> tuple[int, int]:
    """ "128x128" -> (Br, Bc); each a positive multiple of 16."""
    m = _TILE_RE.match(text)
    if m is None:
        raise PlanError(f"--tile: cannot read {text!r}; write BRxBC, e.g. 128x128")
    br, bc = int(m.group(1)), int(m.group(2))
    if br < 16 or bc < 16 or br % 16 or bc % 16:
        raise PlanError(f"--tile {text}: Br and Bc must be positive multiples of 16, got "
                        f"{br} x {bc}")
    return br, bc


@dataclass(frozen=True)
class Dims:
    """Head dims of one attention head: queries/keys and values."""

    qk: int
    v: int

    @property
    def flops_per_exp(self) -> int:
        """Matmul FLOPs per score: 2 d_qk (QK^T) + 2 d_v (PV)."""
        return 2 * (self.qk + self.v)

    def __str__(self) -> str:
        return f"d={self.qk}" if self.qk == self.v else f"d_qk={self.qk}, d_v={self.v}"


def head_dims(spec: ModelSpec) -> Dims:
    """The model's head dims (MLA: d_qk = nope + rope, d_v = v_head_dim)."""
    if is_mla(spec):
        return Dims(spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim)
    return Dims(spec.head_dim, spec.head_dim)


def build(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    m = gpu_micro(hw)
    entry = model(args)
    d = head_dims(entry.spec)
    if getattr(args, "head_dim", None) is not None:
        hd = opt_int(args, "head_dim", 128, lo=16, hi=512)
        d = Dims(hd, hd)
    br, bc = parse_tile(opt_str(args, "tile", "128x128"))
    latency = opt_float(args, "latency_ns", m.dram_latency_ns) * 1e-9
    rates = _rates_section(hw, m)
    tile = _tile_section(hw, m, br, bc, d)
    tech = _technique_section(hw, m, br, bc, d, latency)
    warnings: tuple[str, ...] = ()
    if m.arch != "sm90":
        warnings = (f"{hw.name} is {m.arch}: FA3's TMA, wgmma and warpgroup register "
                    f"reallocation are Hopper (sm90) features; the ratios hold, the "
                    f"technique lines describe what an sm90 kernel does",)
    share = _exp_share(hw, m, d)
    serial = 1 / (1 + share)
    verdict = (f"{hw.name}, {d}: exponentials take {pct(share)} of the matmul time per tile; "
               f"run back to back (FA2) the tensor cores reach at most {pct(serial)}, "
               f"overlapped (FA3 ping-pong) up to {pct(1 / max(1.0, share))}")
    return Sheet(f"FA2 vs FA3 on {hw.name}: exponentials vs matmuls, tile {br}x{bc}, {d}",
                 (rates, tile, tech), warnings, verdict,
                 data={"exp_per_s": per_second(hw, m, m.mufu_per_clk_sm),
                       "exp_share": share, "serial_ceiling": serial})


def _exp_share(hw: Hardware, m: GpuMicro, d: Dims, peak: float | None = None) -> float:
    """exp time / matmul time of a tile: (peak / exp rate) / (2 (d_qk + d_v))."""
    ratio = (peak or hw.bf16_flops) / per_second(hw, m, m.mufu_per_clk_sm)
    return ratio / d.flops_per_exp


def _rates_section(hw: Hardware, m: GpuMicro) -> Section:
    clk = clock_hz(hw, m)
    exp = per_second(hw, m, m.mufu_per_clk_sm)
    fp32 = 2 * per_second(hw, m, m.fp32_per_clk_sm)
    lines = [
        line("bf16 matmul peak (dense)", "catalog bf16_flops", hw.bf16_flops,
             f"{hw.bf16_flops / 1e12:,.1f} TFLOP/s", f"{hw.name} datasheet: {hw.bf16_flops:.4g}"),
        line("clock the peak implies", "bf16_flops / (SMs x FLOPs/clk/SM)", clk,
             f"{clk / 1e9:.3f} GHz", clock_explain(hw, m)),
        line("MUFU exponentials", f"{m.mufu_per_clk_sm} /clk/SM x SMs x clock", exp, f"{exp / 1e12:.3g} T exp/s",
             f"{m.mufu_per_clk_sm} x {m.sm_count} x {clk:.4g} Hz = {exp:.4g} /s"),
        line("matmul FLOP/s per exp/s", "bf16 peak / exp rate", hw.bf16_flops / exp,
             f"{hw.bf16_flops / exp:,.0f}", f"{hw.bf16_flops:.4g} / {exp:.4g} = "
                                            f"{hw.bf16_flops / exp:.1f}"),
        line("FP32 non-matmul peak", "2 x FP32 FMA/clk/SM x SMs x clock", fp32,
             f"{fp32 / 1e12:.3g} TFLOP/s", f"2 x {m.fp32_per_clk_sm} x {m.sm_count} x "
                                           f"{clk:.4g} = {fp32:.4g}; matmul / FP32 = "
                                           f"{hw.bf16_flops / fp32:.1f}x (FA2's reason to "
                                           f"cut non-matmul FLOPs)"),
    ]
    return Section(f"Throughputs on {hw.name} ({m.arch}, {m.sm_count} SMs)", tuple(lines),
                   (m.source,))


def _tile_section(hw: Hardware, m: GpuMicro, br: int, bc: int, d: Dims) -> Section:
    flops = br * bc * d.flops_per_exp
    exps = br * bc
    t_mm = flops / m.tensor_flops_per_clk_sm
    t_exp = exps / m.mufu_per_clk_sm
    share = t_exp / t_mm
    serial = t_mm / (t_mm + t_exp)
    exp_rate = per_second(hw, m, m.mufu_per_clk_sm)
    lines: list[Line] = [
        line("tile matmul FLOPs", "2 x Br x Bc x (d_qk + d_v)", flops, f"{flops:,}",
             f"QK^T 2 x {br} x {bc} x {d.qk} + PV 2 x {br} x {bc} x {d.v} = {flops:,}"),
        line("tile exponentials", "Br x Bc", exps, f"{exps:,}", f"{br} x {bc} = {exps:,}"),
        line("tile matmul FLOPs per exponential", "2 (d_qk + d_v) = 4 d", d.flops_per_exp,
             f"{d.flops_per_exp:,}", f"2 x ({d.qk} + {d.v}) = {d.flops_per_exp}"),
        line("matmul clocks per tile (one SM)", "tile FLOPs / tensor FLOPs/clk/SM", t_mm,
             f"{t_mm:,.0f} clk", f"{flops:,} / {m.tensor_flops_per_clk_sm:,} = {t_mm:,.0f}"),
        line("exp clocks per tile (one SM)", "Br Bc / MUFU/clk/SM", t_exp, f"{t_exp:,.0f} clk",
             f"{exps:,} / {m.mufu_per_clk_sm} = {t_exp:,.0f}"),
        line("exp time / matmul time", "(peak / exp rate) / (4 d)", share, pct(share),
             f"{t_exp:,.0f} / {t_mm:,.0f} = {share:.3f} = {hw.bf16_flops / exp_rate:.1f} / "
             f"{d.flops_per_exp}"),
        line("FA2 ceiling: softmax after GEMMs", "t_mm / (t_mm + t_exp)", serial,
             f"{pct(serial)} = {serial * hw.bf16_flops / 1e12:,.0f} TFLOP/s",
             f"{t_mm:,.0f} / ({t_mm:,.0f} + {t_exp:,.0f}) = {serial:.3f} of peak"),
        line("FA3 ceiling: softmax under GEMMs", "t_mm / max(t_mm, t_exp)",
             1 / max(1.0, share), pct(1 / max(1.0, share)),
             f"{t_mm:,.0f} / max({t_mm:,.0f}, {t_exp:,.0f}) = {1 / max(1.0, share):.3f}"),
    ]
    for hd in (64, 128):
        if Dims(hd, hd) != d:
            s = _exp_share(hw, m, Dims(hd, hd))
            lines.append(line(f"exp / matmul at d={hd}", "(peak / exp rate) / (4 d)", s, pct(s),
                              f"{hw.bf16_flops / exp_rate:.1f} / (4 x {hd}) = {s:.3f}"))
    if hw.fp8_flops:
        s8 = _exp_share(hw, m, d, hw.fp8_flops)
        lines.append(line(f"exp / matmul at {d}, fp8 GEMMs", "(fp8 peak / exp rate) / (4 d)",
                          s8, pct(s8), f"{hw.fp8_flops:.4g} / {exp_rate:.4g} / "
                                       f"{d.flops_per_exp} = {s8:.3f}: fp8 doubles the matmul "
                                       f"rate, not the exp rate"))
    return Section(f"One tile: Br={br} x Bc={bc}, {d}", tuple(lines),
                   ("the FA3 paper's figures (H100 SXM5): FA2 reaches about 35% of peak; FA3 "
                    "up to 740 TFLOP/s (75%) in bf16 and close to 1.2 PFLOP/s in fp8",))


def _technique_section(hw: Hardware, m: GpuMicro, br: int, bc: int, d: Dims,
                       latency: float) -> Section:
    clk = clock_hz(hw, m)
    t_mm = br * bc * d.flops_per_exp / m.tensor_flops_per_clk_sm
    t_exp = br * bc / m.mufu_per_clk_sm
    lat_clk = latency * clk
    stages = math.ceil(lat_clk / t_mm) + 1
    kv_tile = bc * (d.qk + d.v) * ACT_BYTES
    q_tile = br * d.qk * ACT_BYTES
    smem = q_tile + stages * kv_tile
    s_regs = WGMMA_ROWS * bc * 4 / WARPGROUP_THREADS / 4  # fp32 S slice per thread, registers
    lines = (
        line("warp specialization + TMA: hides load latency", "ceil(latency / t_mm) + 1",
             stages, f"{stages} K/V stages, {fmt_bytes(smem)} smem" + (
                 f" > {m.smem_per_sm_kib} KiB: too big" if smem > m.smem_per_sm_kib * 1024
                 else ""),
             f"producer warps issue TMA loads ahead: latency {latency * 1e9:.0f} ns x "
             f"{clk / 1e9:.3g} GHz = {lat_clk:,.0f} clk vs {t_mm:,.0f} clk of matmul per tile -> "
             f"ceil({lat_clk / t_mm:.2f}) + 1 = {stages} stages; Q {fmt_bytes(q_tile)} + "
             f"{stages} x K,V {fmt_bytes(kv_tile)} = {fmt_bytes(smem)} of "
             f"{m.smem_per_sm_kib} KiB per SM"),
        line("ping-pong (2 warpgroups): hides softmax", "(t_mm + t_exp) / max(t_mm, t_exp)",
             (t_mm + t_exp) / max(t_mm, t_exp), f"up to x{(t_mm + t_exp) / max(t_mm, t_exp):.2f}",
             f"warpgroup 1's softmax ({t_exp:,.0f} clk) runs while warpgroup 2's GEMMs "
             f"({t_mm:,.0f} clk) use the tensor cores (named barriers order them): "
             f"({t_mm:,.0f} + {t_exp:,.0f}) / {max(t_mm, t_exp):,.0f}"),
        line("intra-warpgroup pipelining: softmax j || QK^T j+1", "64 x Bc x 4 B / 128 threads",
             s_regs, f"+{s_regs:.0f} registers/thread",
             f"a warpgroup issues the next tile's QK^T (async wgmma) before the softmax of "
             f"this one; the second fp32 S slice costs {WGMMA_ROWS} x {bc} x 4 B / "
             f"{WARPGROUP_THREADS} threads = {s_regs * 4:.0f} B = {s_regs:.0f} registers of "
             f"255 per thread"),
        _hadamard_line(d.qk),
    )
    return Section("Which FA3 technique hides which stall (sm90 kernels)", lines)


def _hadamard_line(dqk: int) -> Line:
    name, formula = "fp8: block quantization + incoherent processing", "d x log2 d per row"
    if dqk & (dqk - 1):
        return line(name, formula, None, "d_qk not a power of 2",
                    f"the fast Hadamard transform needs a power-of-2 head dim, got {dqk}")
    had = dqk * int(math.log2(dqk))
    return line(name, formula, had, f"{had} add/sub per row",
                f"Q and K are multiplied by one random +-1 diagonal x Hadamard matrix M "
                f"(M M^T = I, so QK^T is unchanged) to spread outlier channels before fp8: "
                f"{dqk} x log2 {dqk} = {had} adds per row, fused with RoPE; the paper reports "
                f"2.6x lower error than baseline fp8 attention")
