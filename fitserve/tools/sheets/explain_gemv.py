"""`plan explain gemv-littles-law`: how many bytes a GPU must keep in flight to stream at full
bandwidth, and which decode GEMVs of a model are too small to get there.

Little's law: bytes in flight = bandwidth x latency. A batch-1 decode GEMV multiplies one
activation vector by a rows x cols (N x K) weight matrix, its S bytes split over the SMs:

      K (cols, input)                    each SM streams S / SMs bytes; to run at full
    +-----------------+                  bandwidth it must keep (bandwidth x latency) / SMs
    | SM 0 rows       |  N (rows,        bytes in flight. A matrix whose whole share per SM is
    | SM 1 rows       |   outputs)       smaller than that is read in about one latency: it
    | ...             |                  cannot fill the pipe.
    +-----------------+

Time model of one GEMV kernel (the pipe fills once, then streams):

    t = latency + S / bandwidth        efficiency = (S / bandwidth) / t = S / (S + bandwidth x latency)

so a matrix of S = bandwidth x latency bytes reaches half the bandwidth.
"""

from __future__ import annotations

import argparse
import math

from fitserve.config import ModelSpec
from fitserve.ledger.formats import weight_bytes, weight_format
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.params import Tensor, tensors
from fitserve.ledger.units import fmt_bytes, fmt_seconds
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.sheets.explain_common import (
    hardware,
    line,
    model,
    model_name,
    opt_float,
    opt_str,
    pct,
)
from fitserve.tools.sheets.explain_micro import GpuMicro, clock_hz, gpu_micro
from fitserve.tools.sheets.sheet import Sheet

FLAGS = ("gpu", "model", "weights", "latency_ns")
EFFICIENCY = "S / (S + bandwidth x latency)"
LOAD_BYTES = 16  # one ld.global.v4 (128-bit) per thread
# NOTE: engines fuse the projections that share an input into one GEMV (vLLM's QKVParallel-
# Linear and MergedColumnParallelLinear); their bytes add up, which is why fusing helps.
FUSED = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up")}


def build(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    m = gpu_micro(hw)
    entry = model(args)
    spec = entry.spec
    fmt = weight_format(opt_str(args, "weights", "bf16")).name
    latency = opt_float(args, "latency_ns", m.dram_latency_ns) * 1e-9
    warnings = (f"WHAT-IF: DRAM latency {latency * 1e9:g} ns (--latency-ns)",) if getattr(
        args, "latency_ns", None) else ()
    in_flight = hw.mem_bytes_per_s * latency
    law = _law_section(hw, m, latency)
    gemvs = [*_size_lines(fmt, in_flight), *_gemv_lines(spec, fmt, hw, m, latency)]
    shapes = [ln for ln in gemvs if ln.formula == EFFICIENCY]
    small = [ln for ln in shapes if isinstance(ln.value, float) and ln.value < 0.5]
    step = _step_line(spec, fmt, hw, latency)
    sec = Section(f"Batch-1 decode GEMVs of {model_name(entry)} in {fmt} on {hw.name}",
                  (*gemvs, step),
                  (f"value = share of {hw.name}'s bandwidth one GEMV kernel reaches: "
                   f"S / (S + {fmt_bytes(in_flight)}); below 50% the matrix is smaller than "
                   f"the bytes in flight",
                   "MoE experts: one expert's matrix per GEMV (a grouped kernel over the "
                   "experts a token picks adds their bytes)"))
    names = ", ".join(ln.name.split(" ")[0] for ln in small)
    verdict = (f"{len(small)} of {len(shapes)} GEMV shapes of {model_name(entry)} ({fmt}) are "
               f"smaller than {hw.name}'s {fmt_bytes(in_flight)} in flight: {names or 'none'}")
    return Sheet(f"GEMV bytes in flight (Little's law): {model_name(entry)} on {hw.name}",
                 (law, sec), warnings,
                 verdict, data={"bytes_in_flight": in_flight,
                                "bytes_in_flight_per_sm": in_flight / m.sm_count,
                                "small_gemvs": [ln.name for ln in small]})


def _law_section(hw: Hardware, m: GpuMicro, latency: float) -> Section:
    bw, sms = hw.mem_bytes_per_s, m.sm_count
    in_flight = bw * latency
    per_sm = in_flight / sms
    loads = per_sm / LOAD_BYTES
    clk = clock_hz(hw, m)
    lines = (
        line("memory bandwidth", "catalog mem_bytes_per_s", bw, f"{bw / 1e12:.3g} TB/s",
             f"{hw.name} datasheet: {bw:.4g} B/s"),
        line("DRAM latency (loaded)", "gpu_micro dram_latency_ns", latency * 1e9,
             f"{latency * 1e9:.0f} ns", f"{latency * 1e9:.0f} ns = {latency * clk:.0f} clocks "
             f"at {clk / 1e9:.3g} GHz"),
        line("bytes in flight (whole GPU)", "bandwidth x latency", in_flight,
             fmt_bytes(in_flight), f"{bw:.4g} B/s x {latency * 1e9:.0f}e-9 s = "
             f"{in_flight:,.0f} B"),
        line("SMs", "gpu_micro sm_count", sms, str(sms), f"{m.arch}: {sms} SMs"),
        line("bytes in flight per SM", "bandwidth x latency / SMs", per_sm, fmt_bytes(per_sm),
             f"{in_flight:,.0f} B / {sms} SMs = {per_sm:,.0f} B"),
        line("16-B loads in flight per SM", "bytes in flight per SM / 16", loads,
             f"{loads:,.0f}", f"{per_sm:,.0f} B / {LOAD_BYTES} B per ld.global.v4 = "
                              f"{loads:,.0f} outstanding loads"),
        line("16-B loads in flight per thread", "loads per SM / max threads per SM",
             loads / m.max_threads_per_sm, f"{loads / m.max_threads_per_sm:.2f}",
             f"{loads:,.0f} / {m.max_threads_per_sm:,} threads (full occupancy) = "
             f"{loads / m.max_threads_per_sm:.3f}: fewer resident threads need more each"),
        line("bandwidth per SM per clock", "bandwidth / SMs / clock", bw / sms / clk,
             f"{bw / sms / clk:.1f} B/clk", f"{bw:.4g} / {sms} / {clk:.4g} Hz = "
                                           f"{bw / sms / clk:.2f} B per clock per SM"),
    )
    return Section(f"Little's law on {hw.name}", lines, (m.source,))


def _gemv_line(label: str, rows: int, cols: int, nbytes: int, hw: Hardware, m: GpuMicro,
               latency: float) -> Line:
    bw = hw.mem_bytes_per_s
    in_flight = bw * latency
    t_stream = nbytes / bw
    eff = nbytes / (nbytes + in_flight)
    return line(f"{label} {rows}x{cols}", EFFICIENCY, eff,
                f"{pct(eff)} ({fmt_bytes(nbytes)})",
                f"S = {nbytes:,} B ({nbytes / m.sm_count:,.0f} B per SM vs "
                f"{in_flight / m.sm_count:,.0f} in flight per SM); t = {latency * 1e9:.0f} ns + "
                f"{t_stream * 1e9:,.0f} ns = {fmt_seconds(latency + t_stream)}; "
                f"{t_stream * 1e9:,.0f} / {(latency + t_stream) * 1e9:,.0f} = {pct(eff)}")


def _size_lines(fmt: str, in_flight: float) -> list[Line]:
    """The matrix sizes that reach 50% and 90% of bandwidth: S = B L x share / (1 - share)."""
    bits = weight_format(fmt).bits_per_weight
    out = []
    for share in (0.5, 0.9):
        s = in_flight * share / (1 - share)
        w = s * 8 / bits
        out.append(line(f"matrix size for {pct(share)} of bandwidth", "B L x share / (1 - share)",
                        s, f"{fmt_bytes(s)} = {w / 1e6:.3g} M weights",
                        f"{in_flight:,.0f} B x {share:g} / {1 - share:.1g} = {s:,.0f} B = "
                        f"{w:,.0f} {fmt} weights (a {math.isqrt(int(w)):,}-square matrix)"))
    return out


def _matrices(spec: ModelSpec) -> list[Tensor]:
    return [t for t in tensors(spec) if t.kind == "matmul"]


def _one_copy_bytes(t: Tensor, fmt: str) -> int:
    return weight_bytes(t.elements, fmt, rows=t.rows)


def _gemv_lines(spec: ModelSpec, fmt: str, hw: Hardware, m: GpuMicro,
                latency: float) -> list[Line]:
    mats = _matrices(spec)
    out = [_gemv_line(t.name, t.rows, t.cols, _one_copy_bytes(t, fmt), hw, m, latency)
           for t in mats]
    by_name = {t.name: t for t in mats}
    for fused, parts in FUSED.items():
        if all(p in by_name for p in parts):
            rows = sum(by_name[p].rows for p in parts)
            cols = by_name[parts[0]].cols
            nbytes = sum(_one_copy_bytes(by_name[p], fmt) for p in parts)
            out.append(_gemv_line(f"{fused} (fused)", rows, cols, nbytes, hw, m, latency))
    return out


def _step_line(spec: ModelSpec, fmt: str, hw: Hardware, latency: float) -> Line:
    """All GEMVs of one decode step, one kernel per matrix copy (no fusion, no overlap)."""
    bw = hw.mem_bytes_per_s
    kernels = 0
    total = 0
    for t in _matrices(spec):
        copies = t.layers * (t.per_layer if t.active_per_layer < 0 else t.active_per_layer)
        kernels += copies
        total += copies * _one_copy_bytes(t, fmt)
    t_step = kernels * latency + total / bw
    eff = (total / bw) / t_step
    return line("decode step, one kernel per matrix", "sum S / bandwidth / sum t", eff,
                f"{pct(eff)} ({kernels:,} GEMVs)",
                f"{kernels:,} GEMVs x {latency * 1e9:.0f} ns + {total:,} B / {bw:.4g} B/s = "
                f"{fmt_seconds(t_step)} vs {fmt_seconds(total / bw)} streaming: {pct(eff)} "
                f"(consecutive kernels that overlap their tails do better)")
