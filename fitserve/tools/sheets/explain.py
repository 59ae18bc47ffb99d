"""`fitserve plan explain TOPIC`: explain sheets whose every number comes from the catalog's
accelerators and models (change --gpu or --model and the numbers change).

    plan explain                      the topics (also: plan explain --list)
    plan explain gemv-littles-law --gpu h200 --model Qwen2.5-7B --explain

Each topic is a module ``explain_*.py`` with a ``build(args) -> Sheet`` and the flags it reads;
a flag given to a topic that does not read it is an error (exit 2), as is an unknown topic.
SM-level figures the catalog lacks (SM counts, pipe rates, DRAM latency) are the data table in
``explain_micro``, with its sources.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from fitserve.ledger.errors import PlanError
from fitserve.tools.planner.report import Section
from fitserve.tools.sheets import (
    explain_attention,
    explain_gemv,
    explain_gguf,
    explain_int4,
    explain_memory,
    explain_numerics,
    explain_qat_fleet,
    explain_quant,
    explain_spec,
    explain_tiles,
)
from fitserve.tools.sheets.explain_common import flag_name, line
from fitserve.tools.sheets.sheet import Sheet


@dataclass(frozen=True)
class Topic:
    build: Callable[[argparse.Namespace], Sheet]
    help: str
    flags: tuple[str, ...]  # argparse dests the topic reads


TOPICS: dict[str, Topic] = {
    "gemv-littles-law": Topic(explain_gemv.build, "bytes in flight per SM (bandwidth x "
                              "latency) and the decode GEMVs too small to fill it",
                              explain_gemv.FLAGS),
    "fa2-vs-fa3": Topic(explain_attention.build, "exponentials vs matmul throughput per "
                        "attention tile, and which FA3 technique hides which stall",
                        explain_attention.FLAGS),
    "int4-dequant": Topic(explain_int4.build, "instructions per int4 weight at full bandwidth "
                          "and the magic-number (0x6400) conversion", explain_int4.FLAGS),
    "w4a16-crossover": Topic(explain_quant.build_crossover, "the batch where int4 weights stop "
                             "beating bf16 (the GEMM turns compute-bound)",
                             explain_quant.CROSSOVER_FLAGS),
    "qat-vs-ptq": Topic(explain_quant.build_qat, "GPU-hours of GPTQ-style PTQ vs QAT for the "
                        "model, at an MFU assumption", explain_quant.QAT_FLAGS),
    "llamacpp-vs-vllm": Topic(explain_gguf.build_llamacpp, "one user (bandwidth / file bytes) "
                              "vs hundreds (shared reads, paged KV)", explain_gguf.LLAMACPP_FLAGS),
    "q4km-cost": Topic(explain_gguf.build_q4km, "bits per weight of a Q4_K_M file from ggml's "
                       "blocks and the model's tensor shapes", explain_gguf.Q4KM_FLAGS),
    "medusa-vs-eagle": Topic(explain_spec.build, "blind Medusa heads vs a conditioned EAGLE "
                             "drafter: acceptance, draft cost, the batch where the winner "
                             "flips; EAGLE-3's changes", explain_spec.FLAGS),
    "fa-l2-reuse": Topic(explain_memory.build_fa, "naive vs textbook FlashAttention IO vs HBM "
                         "bytes with K/V re-reads hitting L2; the wave's working set",
                         explain_memory.FA_FLAGS),
    "gemv-coalescing": Topic(explain_memory.build_gemv, "which lane reads which weight: 32-B "
                             "sectors per warp load, row- vs column-major, bf16 vs int4",
                             explain_memory.GEMV_FLAGS),
    "smem-swizzle": Topic(explain_memory.build_smem, "bank conflicts of fp32 scalars and 16-B "
                          "bf16 vectors: padding bytes vs XOR swizzle", explain_memory.SMEM_FLAGS),
    "gqa-packing": Topic(explain_tiles.build_gqa, "query heads per KV head packed into the "
                         "MMA's M: tensor-core utilisation in decode", explain_tiles.GQA_FLAGS),
    "tma-wgmma": Topic(explain_tiles.build_tma, "TMA and wgmma instructions for one GEMM tile "
                       "vs cp.async and mma.sync", explain_tiles.TMA_FLAGS),
    "paged-indirection": Topic(explain_tiles.build_paged, "block-table loads, blocks per tile, "
                               "TMA boxes, the stages that hide them", explain_tiles.PAGED_FLAGS),
    "rope-fusion": Topic(explain_numerics.build_rope, "bytes eager RoPE moves vs the fused "
                         "kernel (and the fused KV-cache write)", explain_numerics.ROPE_FLAGS),
    "bf16-sum": Topic(explain_numerics.build_sum, "a bf16 running sum's error curve vs fp32 and "
                      "the bisection for where it crosses --threshold", explain_numerics.SUM_FLAGS),
    "kv-quant-roads": Topic(explain_numerics.build_roads, "why keys want per-channel scales and "
                            "values per-token, and what that costs a paged cache",
                            explain_numerics.ROADS_FLAGS),
    "qat-fleet": Topic(explain_qat_fleet.build, "QAT's GPU-hours vs the GPUs int4 weights save "
                       "at a traffic: payback, and when not to touch it", explain_qat_fleet.FLAGS),
}

# (dest, type, help) of every topic flag; all default to None ("not given").
_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("gpu", str, "accelerator from the catalog (default h100)"),
    ("model", str, "catalog model, config.json or .gguf (default Llama-3.1-8B)"),
    ("weights", str, "weight format or mix (per topic: bf16, int4-g128, Q4_K_M)"),
    ("latency_ns", float, "loaded DRAM latency in ns (default: the table's, 600 on HBM)"),
    ("head_dim", int, "attention head dim (default: the model's)"),
    ("tile", str, "tile BRxBC (attention) or BMxBN (GEMM); default 128x128, paged-indirection "
                       "64x64"),
    ("value", int, "nibble 0-15 for the worked dequant example (default 11)"),
    ("context", str, "tokens per sequence, k = 1024 (default 2048; llamacpp-vs-vllm 1024; "
                          "fa-l2-reuse, paged-indirection 8k; medusa-vs-eagle 4k)"),
    ("threshold", float, "w4a16: speedup below 1 + threshold stops paying (0.05); bf16-sum: relative error (0.01)"),
    ("batch", int, "concurrent users (default 256)"),
    ("max_context", str, "tokens a contiguous slot reserves (default 8192)"),
    ("block_size", int, "paged KV block size in tokens (default 16)"),
    ("mfu", float, "model FLOPs utilization assumed (default 0.4)"),
    ("calib_samples", int, "PTQ calibration sequences (default 128, as GPTQ)"),
    ("calib_seq", str, "tokens per calibration sequence (default 2048)"),
    ("qat_fraction", float, "QAT tokens as a fraction of pretraining (default 0.001)"),
    ("qat_tokens", float, "QAT tokens outright (instead of --qat-fraction)"),
    ("pretrain_tokens", float, "pretraining tokens (default: published, where known)"),
    ("tp", int, "tensor-parallel ranks (default 2)"),
    ("heads_accept", str, "Medusa heads' top-1 acceptance, one per head (default "
                          "0.6,0.45,0.35,0.25)"),
    ("draft_accept", float, "EAGLE acceptance per draft, conditioned on the previous (0.75)"),
    ("q_len", int, "query positions per sequence in a decode step (default 1)"),
    ("traffic", float, "served tokens per second (default 20000)"),
    ("months", float, "the model's serving life in months (default 6)"),
    ("kv_bits", int, "KV quantization bits (default 4)"),
    ("outlier_ratio", float, "key outlier channels' range / the others' (default 10)"),
    ("draft_k", int, "EAGLE draft tokens per round (default: as many as Medusa heads)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("topic", nargs="?", choices=list(TOPICS), metavar="TOPIC",
                   help=f"one of: {', '.join(TOPICS)} (none: list them)")
    p.add_argument("--list", action="store_true", help="list the topics and their flags")
    for dest, typ, help_ in _FLAGS:
        p.add_argument(flag_name(dest), dest=dest, type=typ, default=None, help=help_)


def build(args: argparse.Namespace) -> Sheet:
    topic_name: str | None = args.topic
    if topic_name is None or args.list:
        return topics_sheet()
    if topic_name not in TOPICS:  # argparse's choices catch this first on the command line
        raise PlanError(f"unknown topic {topic_name!r}; topics: {', '.join(TOPICS)}")
    topic = TOPICS[topic_name]
    extra = [d for d, _, _ in _FLAGS if getattr(args, d, None) is not None
             and d not in topic.flags]
    if extra:
        raise PlanError(f"{', '.join(flag_name(d) for d in extra)} does not apply to "
                        f"{topic_name}; its flags: "
                        f"{', '.join(flag_name(d) for d in topic.flags)}")
    return topic.build(args)


def topics_sheet() -> Sheet:
    """The topics, one line each, with the flags each reads."""
    lines = tuple(
        line(name, f"plan explain {name}", t.help, t.help,
             "flags: " + ", ".join(flag_name(d) for d in t.flags))
        for name, t in TOPICS.items())
    return Sheet("plan explain: topics", (Section("Topics", lines),),
                 verdict="run: fitserve plan explain TOPIC [flags] --explain",
                 data={"topics": list(TOPICS)})
