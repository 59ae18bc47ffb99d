"""`plan explain qat-fleet`: QAT's GPU-hours against the serving fleet int4 weights could shrink.

    replica   = the smallest TP (1, 2, 4, 8) whose weights + batch x KV fit 90% of each GPU
    tok/s     = batch / decode step (the ledger's roofline, ``decode_step_roofline``)
    fleet     = ceil(traffic / replica tok/s) x TP GPUs, for the baseline format and int4-g128
    saved     = fleet(baseline) - fleet(int4) GPUs, x 730 GPU-hours a month
    QAT cost  = 6 x N x QAT tokens / (bf16 peak x MFU)       (as ``plan explain qat-vs-ptq``)
    payback   = QAT GPU-hours / GPU-hours saved per month

QAT buys quality at int4, not speed: PTQ (GPTQ, AWQ) gives the same int4 fleet for a few
GPU-hours. It pays only where PTQ's int4 quality is not acceptable, the fleet shrinks, and the
payback is shorter than the model's serving life.
"""

from __future__ import annotations

import argparse
import math

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.kv import request_kv
from fitserve.ledger.params import count_params
from fitserve.ledger.speed import decode_step_roofline
from fitserve.ledger.weights import roofline_weight_bytes
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.sheets.explain_common import (
    hardware,
    line,
    model,
    model_name,
    opt_float,
    opt_int,
    opt_str,
    opt_tokens,
)
from fitserve.tools.sheets.explain_quant import _pretrain_tokens
from fitserve.tools.sheets.sheet import Sheet

FLAGS = ("gpu", "model", "weights", "batch", "context", "traffic", "months", "mfu",
         "qat_fraction", "qat_tokens", "pretrain_tokens")
INT4 = "int4-g128"
HOURS_PER_MONTH = 730
MEM_USE = 0.9  # NOTE: 10% of each GPU left to the runtime, activations and fragmentation
TPS = (1, 2, 4, 8)


def replica_tp(spec: ModelSpec, hw: Hardware, fmt: str, batch: int, context: int) -> int:
    """Smallest TP whose per-rank weights + batch x KV fit MEM_USE of the GPU."""
    for tp in TPS:
        w = roofline_weight_bytes(spec, fmt, tp=tp).total
        kv = batch * request_kv(spec, context, "bf16", tp=tp).bytes_reclaimed
        if w + kv <= MEM_USE * hw.memory_bytes:
            return tp
    raise PlanError(f"{fmt}: batch {batch} at {context:,} tokens does not fit 8 x {hw.name}; "
                    f"lower --batch or --context")


def fleet(spec: ModelSpec, hw: Hardware, fmt: str, batch: int, context: int,
          traffic: float) -> tuple[int, float, int]:
    """(TP, replica tok/s, fleet GPUs) for ``traffic`` tokens/s."""
    tp = replica_tp(spec, hw, fmt, batch, context)
    step = decode_step_roofline(spec, hw, batch=batch, context=context, weight_fmt=fmt,
                                kv_dtype="bf16", tp=tp)
    rate = batch / step.seconds
    return tp, rate, math.ceil(traffic / rate) * tp


def build(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    entry = model(args, "Llama-3.3-70B")
    spec = entry.spec
    base = opt_str(args, "weights", "bf16")
    batch = opt_int(args, "batch", 64, hi=4096)
    ctx = opt_tokens(args, "context", 2048)
    traffic = opt_float(args, "traffic", 20_000.0)
    months = opt_float(args, "months", 6.0)
    mfu = opt_float(args, "mfu", 0.4, max_value=1.0)
    if getattr(args, "qat_tokens", None) is not None:
        tokens, how = opt_float(args, "qat_tokens", 1.0), "--qat-tokens"
    else:
        frac = opt_float(args, "qat_fraction", 0.001, max_value=1.0)
        pre, src = _pretrain_tokens(args, entry)
        tokens, how = frac * pre, f"{frac:g} x {pre:.4g} ({src})"
    n = count_params(spec).active_matmul
    qat_h = 6 * n * tokens / (hw.bf16_flops * mfu) / 3600
    rows: list[Line] = []
    fleets = {}
    for fmt in (base, INT4):
        tp, rate, gpus = fleet(spec, hw, fmt, batch, ctx, traffic)
        fleets[fmt] = gpus
        rows.append(line(f"{fmt}: fleet GPUs", "ceil(traffic / replica tok/s) x TP", gpus,
                         f"{gpus:,} ({math.ceil(traffic / rate):,} x TP{tp})",
                         f"replica TP{tp}: {batch} / step = {rate:,.0f} tok/s; "
                         f"ceil({traffic:,.0f} / {rate:,.0f}) x {tp} = {gpus:,}"))
    saved = fleets[base] - fleets[INT4]
    saved_h = saved * HOURS_PER_MONTH
    payback = qat_h / saved_h if saved_h > 0 else math.inf
    rows += [
        line("GPUs saved by int4", f"fleet({base}) - fleet({INT4})", saved, f"{saved:,}",
             f"{fleets[base]:,} - {fleets[INT4]:,} = {saved:,}"),
        line("GPU-hours saved per month", "saved x 730", saved_h, f"{saved_h:,.0f} h",
             f"{saved:,} x {HOURS_PER_MONTH} = {saved_h:,} h"),
        line("QAT GPU-hours", "6 x N x tokens / (peak x MFU) / 3600", qat_h, f"{qat_h:,.0f} h",
             f"6 x {n:,} x {tokens:.4g} ({how}) / ({hw.bf16_flops:.4g} x {mfu:g}) / 3600"),
        line("QAT payback", "QAT GPU-hours / GPU-hours saved per month", payback,
             "never" if math.isinf(payback) else f"{payback:.2f} months",
             "no GPU saved" if math.isinf(payback) else
             f"{qat_h:,.0f} / {saved_h:,.0f} = {payback:.3f} months vs a {months:g}-month life"),
    ]
    go = saved > 0 and payback <= months
    why = ("int4 saves no GPU at this traffic and batch (the fleet is one replica, or the "
           "step is compute-bound)" if saved <= 0 else
           f"payback {payback:.1f} months > the model's {months:g}-month life" if not go else
           f"pays back in {payback:.2f} months, IF PTQ int4 quality is not acceptable")
    verdict = (f"{'consider QAT' if go else 'do not touch QAT'}: {why}; PTQ gives the same "
               f"{fleets[INT4]:,}-GPU fleet for a few GPU-hours")
    return Sheet(f"QAT vs the fleet: {model_name(entry)} on {hw.name}, {traffic:,.0f} tok/s",
                 (Section(f"Decode at batch {batch}, context {ctx:,}", tuple(rows),
                          (f"ASSUMPTIONS: MFU {mfu:g}, serving life {months:g} months "
                           f"(--months), {int(MEM_USE * 100)}% of each GPU usable",)),),
                 verdict=verdict, ok=True,
                 data={"saved_gpus": saved, "qat_gpu_hours": qat_h, "payback_months": payback,
                       "go": go})
