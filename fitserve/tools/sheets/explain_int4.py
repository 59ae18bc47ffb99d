"""`plan explain int4-dequant`: how many instructions a GPU can spend per int4 weight while it
streams weights at full bandwidth, and the magic-number conversion that fits the budget.

    weights/s arriving = bandwidth x 8 / bits per weight      (int4 codes alone: 2 x bandwidth)
    budget per weight  = instruction issue rate / weights/s    (per pipe: that pipe's rate)

The magic number: an fp16 whose exponent makes its mantissa step exactly 1.

    0x6400 = 0 11001 0000000000 = 2^(25-15) x 1.0 = 1024.0     mantissa ulp = 2^(10-10) = 1
    0x6400 | n = 1024 + n  (n < 1024)      so      (0x6400 | n) - 1024.0 = n

One LOP3 ((q & 0x000F000F) | 0x64006400) puts two nibbles into two fp16 halves and one HSUB2
(or an HFMA2 that also applies the scale) takes the magic back off: 2 instructions per pair,
no int-to-float convert (converts run at 16 per clock per SM, 1/8 of the issue rate).
"""

from __future__ import annotations

import argparse
import struct

from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import weight_format
from fitserve.ledger.hardware import Hardware
from fitserve.tools.planner.report import Section
from fitserve.tools.sheets.explain_common import fmt_rate, hardware, line, opt_int, opt_str, pct
from fitserve.tools.sheets.explain_micro import GpuMicro, clock_hz, gpu_micro, per_second
from fitserve.tools.sheets.sheet import Sheet

FLAGS = ("gpu", "weights", "value")
FP16_MAGIC = 0x6400  # 1024.0
FP32_MAGIC = 0x4B000000  # 8388608.0 = 2^23
LOP3_AND_OR = 0xEA  # immLut of (a & b) | c: (0xF0 & 0xCC) | 0xAA
# Instruction counts per weight (NOTE: as a Marlin/FasterTransformer-style kernel spends them):
# naive: shift, and (extract), I2F, FFMA (scale, zero), F2F.F16 = 5, two of them conversions;
# magic: per 8 nibbles of a 32-bit word, 4 LOP3 + 1 shift + 4 HSUB2/HFMA2 = 9 (zero folded
# into the magic), then 1 HMUL2 per pair for the group scale.
NAIVE_INSTR, NAIVE_CVT = 5.0, 2.0
MAGIC_INSTR, MAGIC_INT = 9 / 8 + 1 / 2, 5 / 8
GEMV_FMA = 0.5  # batch 1: one HFMA2 per 2 weights
INT4_FORMATS = ("Q4_0", "Q4_1", "Q4_K")


def half(bits: int) -> float:
    """The fp16 value of 16 bits."""
    v: float = struct.unpack("<e", (bits & 0xFFFF).to_bytes(2, "little"))[0]
    return v


def single(bits: int) -> float:
    """The fp32 value of 32 bits."""
    v: float = struct.unpack("<f", (bits & 0xFFFFFFFF).to_bytes(4, "little"))[0]
    return v


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX lop3.b32: bit i of the result is bit (a_i b_i c_i) of ``lut`` (a = 0xF0 ...)."""
    out = 0
    for i in range(32):
        idx = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def _int4_format(name: str) -> tuple[str, float]:
    f = weight_format(name)
    if not (f.name.startswith("int4") or f.name in INT4_FORMATS):
        raise PlanError(f"--weights {name}: int4-dequant needs a 4-bit integer format "
                        f"(int4-g<N>[-sym|-asym], {', '.join(INT4_FORMATS)}), got {f.name}")
    return f.name, f.bits_per_weight


def build(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    m = gpu_micro(hw)
    fmt, bpw = _int4_format(opt_str(args, "weights", "int4-g128"))
    v = opt_int(args, "value", 11, lo=0, hi=15)
    budget = _budget_section(hw, m, fmt, bpw)
    magic = _magic_section(v)
    weights_s = hw.mem_bytes_per_s * 8 / bpw
    issue = per_second(hw, m, m.issue_per_clk_sm)
    naive = min(1.0, issue / weights_s / (NAIVE_INSTR + GEMV_FMA),
                per_second(hw, m, m.cvt_per_clk_sm) / weights_s / NAIVE_CVT)
    fast = min(1.0, issue / weights_s / (MAGIC_INSTR + GEMV_FMA),
               per_second(hw, m, m.int_per_clk_sm) / weights_s / MAGIC_INT)
    verdict = (f"{hw.name}: {issue / weights_s:.2f} instructions per {fmt} weight at full "
               f"bandwidth; converts cap a naive dequant at {pct(naive)} of bandwidth, the "
               f"magic-number path reaches {pct(fast)}")
    return Sheet(f"int4 dequant budget on {hw.name} ({fmt}, {bpw:.4g} bits/weight)",
                 (budget, magic), (), verdict,
                 data={"instructions_per_weight": issue / weights_s, "naive_fraction": naive,
                       "magic_fraction": fast})


def _budget_section(hw: Hardware, m: GpuMicro, fmt: str, bpw: float) -> Section:
    bw = hw.mem_bytes_per_s
    clk = clock_hz(hw, m)
    raw = 2 * bw
    ws = bw * 8 / bpw
    issue = per_second(hw, m, m.issue_per_clk_sm)
    ints = per_second(hw, m, m.int_per_clk_sm)
    cvts = per_second(hw, m, m.cvt_per_clk_sm)
    naive_frac = min(1.0, issue / ws / (NAIVE_INSTR + GEMV_FMA), cvts / ws / NAIVE_CVT)
    magic_frac = min(1.0, issue / ws / (MAGIC_INSTR + GEMV_FMA), ints / ws / MAGIC_INT)
    sm = f"x {m.sm_count} SMs x {clk:.4g} Hz"
    lines = (
        line("int4 codes arriving", "2 x bandwidth", raw, fmt_rate(raw, "weight"),
             f"2 nibbles per byte x {bw:.4g} B/s = {raw:.4g} weights/s"),
        line(f"{fmt} weights arriving (scales included)", "bandwidth x 8 / bits per weight",
             ws, fmt_rate(ws, "weight"), f"{bw:.4g} x 8 / {bpw:.4g} = {ws:.4g} weights/s"),
        line("instruction issue rate", f"{m.issue_per_clk_sm} /clk/SM x SMs x clock", issue,
             fmt_rate(issue, "instr"), f"{m.issue_per_clk_sm} {sm} = {issue:.4g} thread-instr/s"),
        line("budget: instructions per weight", "issue rate / weights arriving", issue / ws,
             f"{issue / ws:.2f}", f"{issue:.4g} / {ws:.4g} = {issue / ws:.3f}"),
        line("budget: integer/logic (LOP3) per weight", f"{m.int_per_clk_sm} /clk/SM x SMs x clock / weights",
             ints / ws, f"{ints / ws:.2f}", f"{m.int_per_clk_sm} {sm} = {ints:.4g} /s; / "
                                            f"{ws:.4g} = {ints / ws:.3f}"),
        line("budget: conversions (I2F, F2F) per weight", f"{m.cvt_per_clk_sm} /clk/SM x SMs x clock / weights",
             cvts / ws, f"{cvts / ws:.2f}", f"{m.cvt_per_clk_sm} {sm} = {cvts:.4g} /s; / "
                                            f"{ws:.4g} = {cvts / ws:.3f}"),
        line("naive dequant: share of bandwidth", "min(1, budget / 5.5, cvt budget / 2)",
             naive_frac, pct(naive_frac),
             f"shift, and, I2F, FFMA, F2F = {NAIVE_INSTR:g} + {GEMV_FMA:g} (the GEMV's "
             f"HFMA2) per weight, {NAIVE_CVT:g} of them converts: min(1, {issue / ws:.3f} / "
             f"{NAIVE_INSTR + GEMV_FMA:g}, {cvts / ws:.3f} / {NAIVE_CVT:g}) = {naive_frac:.3f}"),
        line("magic-number dequant: share of bandwidth",
             "min(1, budget / 2.125, LOP3 budget / 0.625)", magic_frac, pct(magic_frac),
             f"9 per 8 weights + 1 HMUL2 scale per pair = {MAGIC_INSTR:g} + {GEMV_FMA:g} "
             f"(HFMA2) per weight, {MAGIC_INT:g} on the integer pipe, no converts: min(1, "
             f"{issue / ws:.3f} / {MAGIC_INSTR + GEMV_FMA:g}, {ints / ws:.3f} / "
             f"{MAGIC_INT:g}) = {magic_frac:.3f}"),
    )
    return Section(f"Budget per weight at full bandwidth on {hw.name} ({m.arch})", lines,
                   ("one budget for everything a weight costs: dequant, scale, the FMA itself, "
                    "address arithmetic and loads; batch b > 1 reuses one dequant for b FMAs",
                    m.source))


def _magic_section(v: int) -> Section:
    w = 15 - v
    q = (w << 16) | v
    one = FP16_MAGIC | v
    pair = lop3(q, 0x000F000F, 0x64006400, LOP3_AND_OR)
    hi = FP16_MAGIC | (v << 4)
    f32 = FP32_MAGIC | v
    lut = (0xF0 & 0xCC) | 0xAA
    lines = (
        line("fp16 magic 0x6400", "2^(exponent - 15) x 1.mantissa", half(FP16_MAGIC),
             f"{half(FP16_MAGIC):g}", "0x6400 = sign 0, exponent 11001b = 25, mantissa 0: "
                                      "2^(25-15) = 1024.0; its mantissa step is 2^(10-10) = 1"),
        line(f"0x6400 | {v} (OR the nibble into the mantissa)", "1024 + n", half(one),
             f"0x{one:04X} = {half(one):g}", f"0x6400 | 0x{v:X} = 0x{one:04X} = "
                                              f"1024 + {v} = {half(one):g}"),
        line("minus the magic (HSUB2)", "(0x6400 | n) - 1024.0", half(one) - 1024.0,
             f"{half(one) - 1024.0:g}", f"{half(one):g} - {half(FP16_MAGIC):g} = "
                                        f"{half(one) - 1024.0:g} = n"),
        line("zero point 8 folded into the magic", "(0x6400 | n) - 0x6408", half(one) - half(
            0x6408), f"{half(one) - half(0x6408):g}",
             f"symmetric int4 subtracts 8: {half(one):g} - {half(0x6408):g} (0x6408) = "
             f"{half(one) - half(0x6408):g} = {v} - 8, still one instruction"),
        line("LOP3 immLut for (a & b) | c", "(0xF0 & 0xCC) | 0xAA", lut, f"0x{lut:02X}",
             f"(0xF0 & 0xCC) | 0xAA = 0x{0xF0 & 0xCC:02X} | 0xAA = 0x{lut:02X}"),
        line(f"two nibbles, one LOP3: q = 0x{q:08X}", "(q & 0x000F000F) | 0x64006400", pair,
             f"0x{pair:08X} = ({half(pair >> 16):g}, {half(pair):g})",
             f"(0x{q:08X} & 0x000F000F) | 0x64006400 = 0x{pair:08X}; halves 0x{pair >> 16:04X}"
             f" = {half(pair >> 16):g}, 0x{pair & 0xFFFF:04X} = {half(pair):g}; one HSUB2 of "
             f"0x64006400 -> ({half(pair >> 16) - 1024:g}, {half(pair) - 1024:g}): 2 "
             f"instructions for 2 weights"),
        line("high nibble (bits 4-7): HFMA2 x 1/16 - 64", "(1024 + 16 n) / 16 - 64", half(hi) /
             16 - 64, f"{half(hi) / 16 - 64:g}",
             f"(q & 0x00F000F0) | 0x64006400: 0x6400 | 0x{v << 4:02X} = 0x{hi:04X} = "
             f"{half(hi):g} = 1024 + 16 x {v}; x 1/16 - 64 = {half(hi) / 16 - 64:g} (one "
             f"HFMA2, no shift)"),
        line("fp32 magic 0x4B000000", "(0x4B000000 | n) - 2^23", single(f32) - single(
            FP32_MAGIC), f"{single(f32) - single(FP32_MAGIC):g}",
             f"0x4B000000 = 2^(150-127) = {single(FP32_MAGIC):.0f}; | 0x{v:X} = 0x{f32:08X} = "
             f"{single(f32):.0f}; minus 2^23 = {single(f32) - single(FP32_MAGIC):g} (one "
             f"weight per register, LOP3 + FADD instead of I2F)"),
    )
    return Section(f"The magic-number conversion, worked for n = {v}", lines)
