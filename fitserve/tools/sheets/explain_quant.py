"""`plan explain w4a16-crossover` and `plan explain qat-vs-ptq`: when weight-only int4 stops
paying, and what quantizing costs to make, in GPU-hours.

W4A16 (int4 weights, bf16 activations) runs its GEMMs at the bf16 peak after dequantizing, so
it saves only bytes. A decode step of batch b reads the weights once and computes b tokens:

    t(b) = max((W + b KV) / bandwidth, b F / peak)           F = FLOPs per token
    compute-bound from b = peak W / (bandwidth F)  =  ridge x W / F     (KV left out)

int4's smaller W turns compute-bound first; past bf16's own turning point both steps take
b F / peak and the speedup is 1. The lines use ``plan.speed`` (decode_step, quant_crossover).

PTQ (GPTQ-style) vs QAT, in FLOPs, at an MFU assumption:

    PTQ = calibration forward 2 N T_cal + Hessians sum 2 K^2 T_cal (one per distinct layer
          input) + per matrix column solve rows x K^2 + Cholesky K^3 / 3
    QAT = 6 N T_qat (forward + backward), T_qat a fraction of the pretraining tokens
    GPU-hours = FLOPs / (peak x MFU) / 3600
"""

from __future__ import annotations

import argparse

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import weight_format
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.kv import request_kv
from fitserve.ledger.params import count_params, tensors
from fitserve.ledger.speed import (
    MAX_BATCH,
    compute_bound_batch,
    decode_step,
    quant_crossover,
    smallest_batch,
)
from fitserve.ledger.units import fmt_bytes
from fitserve.ledger.weights import WeightBytes, model_weight_bytes
from fitserve.tools.planner.model_source import ModelEntry
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.sheets.dequant_cost import dequant_lines
from fitserve.tools.sheets.explain_common import (
    fmt_flops,
    hardware,
    line,
    model,
    model_name,
    opt_float,
    opt_int,
    opt_str,
    opt_tokens,
)
from fitserve.tools.sheets.sheet import Sheet

CROSSOVER_FLAGS = ("gpu", "model", "weights", "context", "threshold")
QAT_FLAGS = ("gpu", "model", "mfu", "calib_samples", "calib_seq", "qat_fraction",
             "qat_tokens", "pretrain_tokens")

# Published pretraining tokens (catalog name -> tokens, source). Others need --pretrain-tokens.
PRETRAIN_TOKENS: dict[str, tuple[float, str]] = {
    "Llama-3.1-8B": (15e12, "Llama 3.1 model card: ~15T tokens"),
    "Llama-3.3-70B": (15e12, "Llama 3.3 model card: 15T+ tokens"),
    "Llama-3.1-405B": (15e12, "Llama 3.1 model card: ~15T tokens"),
    "Qwen2.5-7B": (18e12, "Qwen2.5 technical report: up to 18T tokens"),
    "Qwen2.5-72B": (18e12, "Qwen2.5 technical report: up to 18T tokens"),
    "Qwen3-32B": (36e12, "Qwen3 technical report: ~36T tokens"),
    "Gemma-2-9B": (8e12, "Gemma 2 report: 9B on 8T tokens"),
    "Gemma-2-27B": (13e12, "Gemma 2 report: 27B on 13T tokens"),
    "Gemma-3-27B": (14e12, "Gemma 3 report: 27B on 14T tokens"),
    "DeepSeek-V3": (14.8e12, "DeepSeek-V3 technical report: 14.8T tokens"),
    "SmolLM2-135M": (2e12, "SmolLM2 model card: 135M on 2T tokens"),
}
# Projections that read the same input share one GPTQ Hessian (X^T X of that input).
SHARED_INPUT = {"attn_q": "attn_in", "attn_k": "attn_in", "attn_v": "attn_in",
                "q_proj": "attn_in", "q_a_proj": "attn_in", "kv_a_proj": "attn_in",
                "ffn_gate": "ffn_in", "ffn_up": "ffn_in", "expert_gate": "expert_in",
                "expert_up": "expert_in", "shared_gate": "shared_in", "shared_up": "shared_in"}
NOT_QUANTIZED = ("lm_head", "router")  # GPTQ/AWQ checkpoints keep them in bf16


# -- w4a16-crossover -------------------------------------------------------------------------

def gemm_speedup(hw: Hardware, bits: float, batch: int) -> float:
    """t_bf16 / t_int4 of one linear layer at ``batch`` (per weight, activations left out):
    t = max(bytes per weight / bandwidth, 2 x batch / peak), both at the bf16 peak."""
    bw, peak = hw.mem_bytes_per_s, hw.bf16_flops
    t16 = max(2 / bw, 2 * batch / peak)
    t4 = max(bits / 8 / bw, 2 * batch / peak)
    return t16 / t4


def build_crossover(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    entry = model(args)
    spec = entry.spec
    qfmt = weight_format(opt_str(args, "weights", "int4-g128")).name
    ctx = opt_tokens(args, "context", 2048)
    thr = opt_float(args, "threshold", 0.05)
    ref, quant = model_weight_bytes(spec, "bf16"), model_weight_bytes(spec, qfmt)
    bits = weight_format(qfmt).bits_per_weight
    if bits >= 16 or quant.total >= ref.total:
        raise PlanError(f"--weights {qfmt} ({bits:g} bits/weight) is not smaller than bf16: "
                        f"no saving to cross over")
    gemm_stop = smallest_batch(lambda b: gemm_speedup(hw, bits, b) < 1 + thr, MAX_BATCH)
    gemm = _gemm_section(hw, qfmt, bits, thr, gemm_stop)
    dq = dequant_lines(hw, quant, thr)
    if dq:
        gemm = Section(gemm.title, gemm.lines + tuple(dq),
                       ("activations left out; the dequant lines charge plan explain "
                        "int4-dequant's instruction count per weight on the compute side",))
    kv = "bf16"

    def speedup(b: int) -> float:
        t_ref = decode_step(spec, hw, ref, batch=b, context=ctx, kv_dtype=kv, weights_fmt="bf16")
        t_q = decode_step(spec, hw, quant, batch=b, context=ctx, kv_dtype=kv, weights_fmt="bf16")
        return t_ref.seconds / t_q.seconds

    stop = smallest_batch(lambda b: speedup(b) < 1 + thr, MAX_BATCH)
    x = quant_crossover(spec, hw, quant, ref, context=ctx, kv_dtype=kv, threshold=thr)
    step = _step_section(spec, hw, ref, quant, ctx, thr, speedup(1), stop, x.speedups)
    dq_stop = f" ({dq[-1].value} with its dequant instructions)" if dq else ""
    verdict = (f"{qfmt} vs bf16 on {hw.name}: a linear layer's W4A16 GEMM stops paying "
               f"(< x{1 + thr:g}) from batch {gemm_stop}{dq_stop}; a whole {model_name(entry)} decode "
               f"step at {ctx:,} tokens (KV reads included) from batch "
               f"{stop if stop is not None else 'never'}")
    return Sheet(f"W4A16 crossover: {qfmt} vs bf16 on {hw.name}, {model_name(entry)}",
                 (gemm, step), (), verdict,
                 data={"gemm_stops_paying_at": gemm_stop, "step_stops_paying_at": stop,
                       "speedup_batch_1": speedup(1)})


def _gemm_section(hw: Hardware, qfmt: str, bits: float, thr: float,
                  stop: int | None) -> Section:
    ridge = hw.bf16_flops / hw.mem_bytes_per_s
    b4 = ridge * bits / 16
    lines = (
        line("ridge point", "bf16 peak / bandwidth", ridge, f"{ridge:.1f} FLOP/B",
             f"{hw.bf16_flops:.4g} / {hw.mem_bytes_per_s:.4g} = {ridge:.3f} FLOPs per byte"),
        line("GEMM intensity at batch b", "2 b FLOPs / bytes per weight", 16 / bits,
             f"bf16 b, {qfmt} {16 / bits:.3g} b FLOP/B",
             f"2 b / 2 B (bf16); 2 b / ({bits:.4g} / 8) B = {16 / bits:.4f} b ({qfmt})"),
        line(f"{qfmt} GEMM compute-bound from batch", "ridge x (bits / 8) / 2", b4,
             f"{b4:.1f}", f"{ridge:.3f} x {bits:.4g} / 16 = {b4:.2f}"),
        line("bf16 GEMM compute-bound from batch", "ridge x 2 / 2", ridge, f"{ridge:.1f}",
             f"{ridge:.3f} x 2 B / 2 FLOPs = {ridge:.2f}"),
        line("GEMM speedup while both are memory-bound", "16 / bits per weight", 16 / bits,
             f"x{16 / bits:.3f}", f"16 / {bits:.4g} = {16 / bits:.4f}, up to batch {b4:.1f}"),
        line(f"GEMM stops paying (speedup < x{1 + thr:g})", "smallest b with ridge / b < 1 + thr",
             stop, f"{stop:,}" if stop is not None else "never",
             f"between the two turning points speedup = ridge / b; {ridge:.3f} / "
             f"{1 + thr:g} = {ridge / (1 + thr):.2f} -> b = {stop}"),
    )
    return Section(f"One linear layer (K x N weights, batch b) on {hw.name}", lines,
                   ("activations and the dequant instructions left out (plan explain "
                    "int4-dequant); real W4A16 kernels lose their edge somewhat earlier",))


def _step_section(spec: ModelSpec, hw: Hardware, ref: WeightBytes, quant: WeightBytes,
                  ctx: int, thr: float, s1: float, stop: int | None,
                  table: tuple[tuple[int, float], ...]) -> Section:
    kv = request_kv(spec, ctx, "bf16").bytes_reclaimed
    kw = {"context": ctx, "kv_dtype": "bf16", "weights_fmt": "bf16"}
    lines: list[Line] = []
    for wb in (ref, quant):
        lines.append(line(f"{wb.mix} weight bytes", f"model_weight_bytes({wb.mix})", wb.total,
                          fmt_bytes(wb.total), f"{wb.total:,} B ({wb.bits_per_weight:.4g} "
                                               f"bits/weight over all parameters)"))
    lines.append(line(f"KV per sequence at {ctx:,}", "request_kv (bf16)", kv, fmt_bytes(kv),
                      f"{kv:,} B, read by every step of that sequence, in either format"))
    for wb in (ref, quant):
        cb = compute_bound_batch(spec, hw, wb, **kw)  # type: ignore[arg-type]
        lines.append(line(f"{wb.mix} step compute-bound from batch", "compute_bound_batch", cb,
                          f"{cb:,}" if cb else "never (KV reads dominate)",
                          f"smallest b with b F / peak >= (W + b KV) / bandwidth at {ctx:,}"))
    rows = ", ".join(f"b={b}: x{v:.3f}" for b, v in table)
    lines += [
        line("step speedup at batch 1", "t_bf16(1) / t_int4(1)", s1, f"x{s1:.3f}",
             f"(W_bf16 + KV) / (W_int4 + KV) = ({ref.total:,} + {kv:,}) / ({quant.total:,} + "
             f"{kv:,}) = {s1:.4f}"),
        line(f"step stops paying (speedup < x{1 + thr:g})", "smallest b: t_bf16 / t_int4 < 1 + thr",
             stop, f"{stop:,}" if stop is not None else "never",
             f"bisection over decode_step; quant_crossover at b = 1, 2, 4 ...: {rows}"),
    ]
    return Section(f"A whole decode step (plan.speed, context {ctx:,})", tuple(lines),
                   ("the KV bytes every step reads dilute the saving, so the step loses its "
                    "edge where KV reads, not compute, dominate",))


# -- qat-vs-ptq -----------------------------------------------------------------------------

def _pretrain_tokens(args: argparse.Namespace, entry: ModelEntry) -> tuple[float, str]:
    given = getattr(args, "pretrain_tokens", None)
    if given is not None:
        return opt_float(args, "pretrain_tokens", 1.0), "--pretrain-tokens"
    name = entry.spec.name
    if name in PRETRAIN_TOKENS:
        return PRETRAIN_TOKENS[name]
    raise PlanError(f"no published pretraining token count for {model_name(entry)}: pass "
                    f"--pretrain-tokens (e.g. 15e12) or --qat-tokens; known: "
                    f"{', '.join(PRETRAIN_TOKENS)}")


def gptq_extra_flops(spec: ModelSpec, tokens: int) -> tuple[int, int]:
    """(Hessian FLOPs, solve FLOPs) of GPTQ over ``tokens`` calibration tokens.

    Hessians: 2 x K^2 per token for each distinct layer input of width K (q/k/v share one;
    gate/up share one; an expert sees k of E tokens). Solve: per matrix copy rows x K^2 (the
    column-by-column update) + K^3 / 3 (Cholesky of its Hessian inverse).
    """
    hess: dict[tuple[str, int], int] = {}
    solve = 0
    for t in tensors(spec):
        if t.kind != "matmul" or t.name in NOT_QUANTIZED:
            continue
        group = SHARED_INPUT.get(t.name, t.name)
        active = t.per_layer if t.active_per_layer < 0 else t.active_per_layer
        hess[(group, t.cols)] = 2 * t.cols * t.cols * tokens * t.layers * active
        solve += t.count * (t.rows * t.cols * t.cols + t.cols ** 3 // 3)
    return sum(hess.values()), solve


def build_qat(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    entry = model(args)
    spec = entry.spec
    mfu = opt_float(args, "mfu", 0.4, max_value=1.0)
    samples = opt_int(args, "calib_samples", 128)
    seq = opt_tokens(args, "calib_seq", 2048)
    n = count_params(spec).active_matmul
    cal = samples * seq
    fwd = 2 * n * cal
    hess, solve = gptq_extra_flops(spec, cal)
    ptq = fwd + hess + solve
    rate = hw.bf16_flops * mfu
    if getattr(args, "qat_tokens", None) is not None:
        qat_tokens, how = opt_float(args, "qat_tokens", 1.0), "--qat-tokens"
    else:
        frac = opt_float(args, "qat_fraction", 0.001, max_value=1.0)
        pre, src = _pretrain_tokens(args, entry)
        qat_tokens, how = frac * pre, f"{frac:g} x {pre:.4g} pretraining tokens ({src})"
    qat = 6 * n * qat_tokens
    gpu_h = f"{hw.bf16_flops:.4g} x {mfu:g} MFU / 3600"
    ptq_lines = (
        line("calibration tokens", "samples x sequence", cal, f"{cal:,}",
             f"{samples} x {seq:,} = {cal:,}"),
        line("calibration forward", "2 x N x tokens", fwd, fmt_flops(fwd),
             f"2 x {n:,} x {cal:,} = {fwd:.4g} (attention left out)"),
        line("GPTQ Hessians", "sum 2 x K^2 x tokens per distinct input", hess, fmt_flops(hess),
             f"{hess:.4g} FLOPs (X^T X of each layer input; lm_head and router kept bf16)"),
        line("GPTQ column solve", "sum rows x K^2 + K^3 / 3 per matrix", solve,
             fmt_flops(solve), f"{solve:.4g} FLOPs"),
        line("PTQ GPU-hours", "PTQ FLOPs / (peak x MFU) / 3600", ptq / rate / 3600,
             f"{ptq / rate / 3600:.3g} h", f"({fwd:.4g} + {hess:.4g} + {solve:.4g}) / ({gpu_h})"
                                           f" = {ptq / rate:.4g} s"),
    )
    qat_lines = (
        line("QAT tokens", "fraction x pretraining tokens", qat_tokens, f"{qat_tokens:.3g}", how),
        line("QAT FLOPs", "6 x N x tokens", qat, fmt_flops(qat),
             f"6 x {n:,} x {qat_tokens:.4g} = {qat:.4g}"),
        line("QAT GPU-hours", "QAT FLOPs / (peak x MFU) / 3600", qat / rate / 3600,
             f"{qat / rate / 3600:,.0f} h", f"{qat:.4g} / ({gpu_h}) = {qat / rate / 3600:.4g} h"),
        line("QAT / PTQ", "QAT FLOPs / PTQ FLOPs", qat / ptq, f"x{qat / ptq:,.0f}",
             f"{qat:.4g} / {ptq:.4g} = {qat / ptq:.4g}"),
    )
    notes = (f"MFU {mfu:g} is an ASSUMPTION (--mfu) for both; GPTQ runs layer by layer and "
             f"often reaches less (its paper quantizes a 175B model in about 4 A100-hours)",)
    verdict = (f"{model_name(entry)} on {hw.name}: PTQ {ptq / rate / 3600:.3g} GPU-hours, "
               f"QAT {qat / rate / 3600:,.0f} GPU-hours (x{qat / ptq:,.0f})")
    return Sheet(f"QAT vs PTQ: {model_name(entry)} on {hw.name}",
                 (Section(f"PTQ: GPTQ over {samples} x {seq:,} calibration tokens", ptq_lines),
                  Section("QAT: fine-tuning with fake-quantized weights", qat_lines, notes)),
                 (f"ASSUMPTION: MFU {mfu:g}",), verdict,
                 data={"ptq_gpu_hours": ptq / rate / 3600, "qat_gpu_hours": qat / rate / 3600})
