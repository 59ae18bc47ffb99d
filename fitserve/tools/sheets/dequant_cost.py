"""What dequantizing costs a W4A16-style GEMM, and the batch where a 4-bit file stops paying.

A weight-only quantized GEMM (Marlin-style: dequantize a tile once into registers, reuse it for
every row of the batch on the tensor cores) spends per weight and step, beside the b MMAs:

    D instructions to dequantize it (``plan explain int4-dequant``'s count), issued at I per s
    t_bf16(b) = max(2 B / bandwidth,           2 b / peak)
    t_q(b)    = max(bits / 8 / bandwidth,      2 b / peak + D / I)

Where bf16 is still memory-bound and the 4-bit GEMM is not, t_bf16 / t_q < 1 + thr from

    b* = peak / (bandwidth (1 + thr))  -  D x peak / (2 I)

The first term is the ridge point (hardware); the second is the dequant cost per weight against
the tensor-core rate: each dequant instruction costs as long as peak / (2 I) batch rows of MMA
(sm90: 4,096 tensor FLOPs / 128 issues per clock per SM / 2 = 16 rows). Neither term knows the
model: every model in one format crosses over at the same batch on one accelerator (a mix such
as Q4_K_M averages D over its tensors, so its share of Q6_K moves D a little).
"""

from __future__ import annotations

from fitserve.config import ModelSpec
from fitserve.ledger.flops import flops_per_token
from fitserve.ledger.formats import weight_format
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.speed import (
    MAX_BATCH,
    decode_step,
    experts_touched_fraction,
    smallest_batch,
)
from fitserve.ledger.weights import WeightBytes
from fitserve.tools.planner.report import Line
from fitserve.tools.sheets.explain_common import line
from fitserve.tools.sheets.explain_int4 import MAGIC_INSTR
from fitserve.tools.sheets.explain_micro import MICRO, per_second

# Instructions per weight on the magic-number path (explain_int4's MAGIC_INSTR: 9 per 8
# nibbles + an HMUL2/HFMA2 per pair for the scale), plus what each format adds.
# NOTE: counted as MAGIC_INSTR is (a Marlin-style kernel), not measured:
# Q4_K: + one 6-bit scale and one 6-bit min per 32-weight sub-block, ~4 integer ops each
#       (shift, and, or of the split 12-byte field) = 8 / 32; the min rides in the HFMA2.
# Q5_K: Q4_K + the fifth bit (one LOP3 per pair = 4 / 8).
# Q6_K: + the two high bits (one LOP3 per pair = 4 / 8) + an int8 scale per 16 converted (1/16).
DEQUANT_INSTR: dict[str, float] = {
    "int4": MAGIC_INSTR, "Q4_0": MAGIC_INSTR, "Q4_1": MAGIC_INSTR,
    "Q4_K": MAGIC_INSTR + 8 / 32,
    "Q5_K": MAGIC_INSTR + 8 / 32 + 4 / 8,
    "Q6_K": MAGIC_INSTR + 4 / 8 + 1 / 16,
}


def format_dequant_instr(fmt: str) -> float:
    """Dequant instructions per weight of one format (0 for bf16/f16/f32 and fp8, which the
    tensor cores read as they are or in one convert; int4-g<N> variants share the int4 count)."""
    name = weight_format(fmt).name
    if name.startswith("int4"):
        return DEQUANT_INSTR["int4"]
    return DEQUANT_INSTR.get(name, 0.0)


def mix_dequant(wb: WeightBytes, expert_fraction: float = 1.0) -> tuple[float, float]:
    """(dequant instructions per step summed over the GEMM weights wb holds, average D per
    weight of those that need one): each tensor's parameters x its format's D. The embedding
    is a lookup (b rows dequantized, not the table) and is left out; experts count
    ``expert_fraction`` of their copies (the share a step's tokens touch)."""
    total = params = 0.0
    for t in wb.lines:
        d = format_dequant_instr(t.fmt)
        if d and t.name != "embedding":
            n = t.bytes * 8 / weight_format(t.fmt).bits_per_weight
            n *= expert_fraction if t.name.startswith("expert_") else 1.0
            total, params = total + n * d, params + n
    return total, (total / params if params else 0.0)


def issue_rate(hw: Hardware) -> float | None:
    """Thread-instructions per second of the whole device (None: no SM data for it)."""
    m = MICRO.get(hw.name)
    return None if m is None else per_second(hw, m, m.issue_per_clk_sm)


def gemm_speedup_dequant(hw: Hardware, bits: float, batch: int, d_instr: float,
                         issue: float) -> float:
    """t_bf16 / t_q of one weight at ``batch`` (module docstring), dequant included."""
    bw, peak = hw.mem_bytes_per_s, hw.bf16_flops
    t16 = max(2 / bw, 2 * batch / peak)
    tq = max(bits / 8 / bw, 2 * batch / peak + d_instr / issue)
    return t16 / tq


def gemm_stop_batch(hw: Hardware, bits: float, d_instr: float, issue: float,
                    threshold: float) -> int | None:
    """Smallest batch where the quantized GEMM's speedup over bf16 falls below 1 + threshold."""
    return smallest_batch(
        lambda b: gemm_speedup_dequant(hw, bits, b, d_instr, issue) < 1 + threshold, MAX_BATCH)


def closed_form_stop(hw: Hardware, d_instr: float, issue: float, threshold: float) -> float:
    """b* = peak / (bandwidth (1 + thr)) - D x peak / (2 I) (module docstring)."""
    return (hw.bf16_flops / (hw.mem_bytes_per_s * (1 + threshold))
            - d_instr * hw.bf16_flops / (2 * issue))


def kernel_step(spec: ModelSpec, hw: Hardware, wb: WeightBytes, *, batch: int, context: int,
                issue: float | None) -> tuple[float, float, float]:
    """(linear layers, attention, all-reduces) seconds of one decode step, kernel by kernel:
    the GEMMs read the weights once for the batch and dequantize them once (D_step / I on the
    compute side), attention reads each sequence's bf16 KV; the kernels run one after another,
    so the step is their sum (a whole-step max() would hide the GEMMs' compute behind the
    attention's KV reads)."""
    st = decode_step(spec, hw, wb, batch=batch, context=context, kv_dtype="bf16",
                     weights_fmt="bf16")
    f = flops_per_token(spec, context)
    peak, bw = hw.bf16_flops, hw.mem_bytes_per_s
    d_step = mix_dequant(wb, experts_touched_fraction(spec, batch))[0] if issue else 0.0
    t_lin = max(st.weight_bytes / bw, batch * f.matmul / wb.tp / peak
                + (d_step / issue if issue else 0.0))
    t_att = max(st.kv_bytes / bw, batch * f.attention / wb.tp / peak)
    return t_lin, t_att, st.t_comm


def dequant_lines(hw: Hardware, quant: WeightBytes, threshold: float) -> list[Line]:
    """The dequant cost per weight of ``quant`` and the batch where its GEMMs stop paying
    against bf16 (module docstring); [] on an accelerator without SM data."""
    issue = issue_rate(hw)
    if issue is None:
        return []
    _, d = mix_dequant(quant)
    rows = d * hw.bf16_flops / (2 * issue)
    stop = gemm_stop_batch(hw, quant.bits_per_weight, d, issue, threshold)
    plain = smallest_batch(lambda b: gemm_speedup_dequant(hw, quant.bits_per_weight, b, 0.0,
                                                          issue) < 1 + threshold, MAX_BATCH)
    ridge = hw.bf16_flops / (hw.mem_bytes_per_s * (1 + threshold))
    return [
        line(f"{quant.mix} dequant per weight", "D (plan explain int4-dequant's count)", d,
             f"{d:.4g} instructions", "magic-number path, averaged over the quantized tensors "
             f"by parameters: {', '.join(f'{k} {v:.4g}' for k, v in DEQUANT_INSTR.items())}"),
        line("one dequant instruction = MMA rows", "peak / (2 x issue rate)",
             hw.bf16_flops / (2 * issue), f"{hw.bf16_flops / (2 * issue):.3g} batch rows",
             f"{hw.bf16_flops:.4g} / (2 x {issue:.4g}); D costs {rows:.1f} rows"),
        line(f"{quant.mix} GEMMs stop paying (< x{1 + threshold:g}), dequant included",
             "b* = peak / (bandwidth (1 + thr)) - D x peak / (2 I)", stop,
             f"{stop:,}" if stop else "never",
             f"{ridge:.2f} - {rows:.2f} = {ridge - rows:.2f} -> {stop}; without dequant "
             f"{plain} (the model does not enter)"),
    ]
