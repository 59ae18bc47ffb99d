"""Fit suggestions beyond "more GPUs": a smaller TP with data parallelism on the same GPUs, a
smaller weight format paired with an FP8 KV cache, and a larger accelerator instead.

Each is planned again in full (``resolve`` + ``check_fit``) and listed only if it fits:

    smaller TP:   TP t < asked, DP = gpus / t: fewer ranks to replicate KV heads past the
                  KV-head count, each replica holding its share of the sequences
    format pair:  --weights F --kv fp8 on the asked GPUs, when neither change alone fits
    larger GPU:   the smallest catalog accelerator with more memory that fits as asked
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import get_hardware, gpu_names
from fitserve.ledger.tp_split import check_tp_split
from fitserve.ledger.units import fmt_bytes
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.report import PlanRequest, Resolved

Fits = Callable[[PlanRequest], bool]

# NOTE: the KV format a pair tries (the engine's --kv-cache-dtype fp8 with a scale per layer,
# vLLM's fp8 KV): half of a 16-bit cache.
PAIR_KV = "fp8"


def smaller_tp(r: Resolved, fits: Fits) -> list[tuple[str, int | str, str, str]]:
    """The smallest TP below the asked one, on the same GPUs, that fits (most replicas)."""
    q = r.req
    for tp in range(1, q.tp):
        if q.gpus % tp:
            continue
        try:
            check_tp_split(r.entry.spec, tp, r.weights, r.base_dtype)
        except PlanError:
            continue
        if fits(dataclasses.replace(q, tp=tp)):
            return [("tp", tp, f"--tp {tp} --gpus {q.gpus}",
                     f"TP {tp} x DP {q.gpus // tp} on the same {q.gpus} GPUs: each replica "
                     f"holds {-(-q.concurrency // (q.gpus // tp))} sequence(s)")]
    return []


def format_pair(r: Resolved, fits: Fits,
                smaller_formats: tuple[str, ...]) -> list[tuple[str, int | str, str, str]]:
    """The largest smaller weight format that fits with an FP8 KV cache on the asked GPUs,
    when neither the format alone nor the FP8 cache alone does."""
    q, s = r.req, r.entry.spec
    if r.kv_dtype in ("fp8", "int8") or fits(dataclasses.replace(q, kv=PAIR_KV)):
        return []
    asked = model_weight_bytes(s, r.weights, tp=1, base_dtype=r.base_dtype).total
    for fmt in smaller_formats:
        if model_weight_bytes(s, fmt, tp=1).total >= asked:
            continue
        if fits(dataclasses.replace(q, weights=fmt, kv=PAIR_KV)) and not fits(
                dataclasses.replace(q, weights=fmt)):
            return [("weights+kv", f"{fmt}+{PAIR_KV}", f"--weights {fmt} --kv {PAIR_KV}",
                     f"{fmt} weights and an FP8 KV cache on the asked {q.gpus} GPU(s), TP "
                     f"{q.tp} (neither alone fits)")]
    return []


def larger_gpu(r: Resolved, fits_on: Callable[[PlanRequest, str], bool]
               ) -> list[tuple[str, int | str, str, str]]:
    """The smallest catalog accelerator with more memory than the asked one that fits as
    asked (same TP, GPUs, formats); none for cpu or a --gpu-memory what-if."""
    q = r.req
    if r.on_cpu or q.gpu_memory_bytes is not None:
        return []
    bigger = sorted((get_hardware(n) for n in gpu_names() if n != "cpu"),
                    key=lambda h: (h.memory_bytes, -h.mem_bytes_per_s))
    for hw in bigger:
        if hw.memory_bytes > r.hw.memory_bytes and fits_on(q, hw.name):
            return [("gpu", hw.name, f"--gpu {hw.name}",
                     f"{fmt_bytes(hw.memory_bytes)} per GPU instead of "
                     f"{fmt_bytes(r.hw.memory_bytes)} ({r.hw.name}), as asked otherwise")]
    return []
