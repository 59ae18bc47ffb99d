"""`plan explain gqa-packing | tma-wgmma | paged-indirection`: one tile's instructions and loads.

gqa-packing: in decode attention each KV head serves ``group = H / H_kv`` query heads; packing
their rows (and the q_len positions of a speculative verification) into the M dimension of one
MMA fills it: utilisation = min(1, group x q_len / M_tile), M_tile = 64 for a Hopper wgmma, 16
for an Ampere/Ada mma.sync.

tma-wgmma: one BM x BN output tile of a bf16 GEMM, BK = 64 (a 128-byte row, the 128-B swizzle)
per k-step. TMA moves a whole box per instruction; wgmma m64nNk16 (N <= 256) covers 64 rows;
Ampere's path is 16-byte cp.async per thread and mma.sync m16n8k16 per warp.

paged-indirection: a paged KV cache stores b tokens per block; a kernel reading a Bc-token KV
tile looks each block up in the block table first (a dependent load: the address of the data
is in memory), and a TMA box cannot span two blocks.
"""

from __future__ import annotations

import argparse
import math

from fitserve.ledger.units import fmt_bytes, fmt_seconds
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.sheets.explain_attention import parse_tile
from fitserve.tools.sheets.explain_common import (
    hardware,
    line,
    model,
    model_name,
    opt_float,
    opt_int,
    opt_str,
    opt_tokens,
    pct,
)
from fitserve.tools.sheets.explain_micro import gpu_micro
from fitserve.tools.sheets.sheet import Sheet

GQA_FLAGS = ("gpu", "model", "q_len")
TMA_FLAGS = ("gpu", "model", "tile")
PAGED_FLAGS = ("gpu", "model", "block_size", "context", "tile", "latency_ns")
ACT = 2
BK = 64  # bf16 elements per k-step: one 128-byte row
WGMMA_M, WGMMA_K, WGMMA_MAX_N = 64, 16, 256
MMA_M, MMA_N, MMA_K = 16, 8, 16
CP_ASYNC_BYTES = 16
TABLE_ENTRY = 4  # int32 block id


def m_tile(arch: str) -> int:
    """Rows one tensor-core instruction covers: wgmma 64 on sm90+, mma.sync 16 before."""
    return WGMMA_M if arch in ("sm90", "sm100") else MMA_M


def build_gqa(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    m = gpu_micro(hw)
    spec = model(args).spec
    q_len = opt_int(args, "q_len", 1, hi=1024)
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    group = h // hkv
    mt = m_tile(m.arch)
    ridge = hw.bf16_flops / hw.mem_bytes_per_s
    lines: list[Line] = []
    for ql in sorted({1, q_len}):
        rows = group * ql
        util = min(1.0, rows / mt)
        alone = min(1.0, ql / mt)
        lines += [
            line(f"q_len {ql}: packed utilisation", "min(1, group x q_len / M_tile)", util,
                 pct(util), f"min(1, {group} x {ql} / {mt}) = {util:.4f}"),
            line(f"q_len {ql}: one head per MMA", "min(1, q_len / M_tile)", alone, pct(alone),
                 f"min(1, {ql} / {mt}) = {alone:.4f}: {h} x {math.ceil(ql / mt)} MMAs per KV "
                 f"tile column vs {hkv} x {math.ceil(rows / mt)} packed"),
            line(f"q_len {ql}: FLOPs per KV byte", "4 group q_len d / (2 d x 2 B)", 2 * rows,
                 f"{2 * rows} FLOP/B vs ridge {ridge:,.0f}",
                 f"QK^T + PV: 2 x 2 x {rows} x {d} FLOPs per {2 * d * ACT} B of K, V = "
                 f"{2 * rows}; {hw.name}'s ridge {hw.bf16_flops:.4g} / "
                 f"{hw.mem_bytes_per_s:.4g} = {ridge:,.0f}: still memory-bound"),
        ]
    head = line("query heads per KV head (group)", "H / H_kv", group, str(group),
                f"{h} / {hkv} = {group}; M_tile {mt} on {m.arch}")
    util_q = min(1.0, group * q_len / mt)
    return Sheet(f"GQA packing on {hw.name}: {model_name(model(args))}",
                 (Section("Decode attention rows per tensor-core instruction",
                          (head, *lines)),),
                 verdict=f"group {group} x q_len {q_len} = {group * q_len} rows of {mt}: "
                         f"{pct(util_q)} of each MMA (unpacked {pct(min(1.0, q_len / mt))})",
                 data={"group": group, "m_tile": mt, "utilisation": util_q})


def build_tma(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    m = gpu_micro(hw)
    spec = model(args).spec
    bm, bn = parse_tile(opt_str(args, "tile", "128x128"))
    k = spec.hidden_size
    ksteps = math.ceil(k / BK)
    step_bytes = (bm + bn) * BK * ACT
    wg = math.ceil(bm / WGMMA_M) * (BK // WGMMA_K) * math.ceil(bn / WGMMA_MAX_N)
    mma = math.ceil(bm / MMA_M) * math.ceil(bn / MMA_N) * (BK // MMA_K)
    cp = step_bytes // CP_ASYNC_BYTES
    wg_n = min(bn, WGMMA_MAX_N)
    wg_clk = 2 * WGMMA_M * wg_n * WGMMA_K / m.tensor_flops_per_clk_sm
    lines = (
        line("k-steps over K", "ceil(K / BK)", ksteps, f"{ksteps}", f"ceil({k} / {BK})"),
        line("bytes per k-step (A + B)", "(BM + BN) x BK x 2 B", step_bytes,
             fmt_bytes(step_bytes), f"({bm} + {bn}) x {BK} x 2 = {step_bytes:,} B"),
        line("TMA instructions per k-step", "one per box: A BMxBK, B BKxBN", 2, "2",
             f"A box {bm}x{BK} ({fmt_bytes(bm * BK * ACT)}) + B box {BK}x{bn} "
             f"({fmt_bytes(bn * BK * ACT)}), issued by one thread"),
        line("cp.async (16 B) per k-step", "bytes per k-step / 16", cp, f"{cp:,}",
             f"{step_bytes:,} / 16 = {cp:,} (each with its own address arithmetic)"),
        line("wgmma per k-step", "ceil(BM/64) x BK/16 x ceil(BN/256)", wg, f"{wg}",
             f"ceil({bm}/64) x {BK}/16 x ceil({bn}/256) = {wg} (m64n{wg_n}k16)"),
        line("mma.sync m16n8k16 per k-step", "BM/16 x BN/8 x BK/16", mma, f"{mma:,}",
             f"{math.ceil(bm / MMA_M)} x {math.ceil(bn / MMA_N)} x {BK // MMA_K} = {mma:,}: "
             f"{mma / wg:.0f}x the wgmma count"),
        line("tile totals over K", "k-steps x (TMA, wgmma)", ksteps * (2 + wg),
             f"{2 * ksteps} TMA + {wg * ksteps} wgmma",
             f"{ksteps} x 2 = {2 * ksteps} TMA, {ksteps} x {wg} = {wg * ksteps} wgmma vs "
             f"{ksteps * cp:,} cp.async + {ksteps * mma:,} mma.sync"),
        line("clocks per wgmma (one SM)", "2 x 64 x N x 16 / tensor FLOPs/clk/SM", wg_clk,
             f"{wg_clk:.0f} clk", f"2 x 64 x {wg_n} x 16 / {m.tensor_flops_per_clk_sm:,} = "
                                  f"{wg_clk:.0f}: one issue slot keeps the tensor cores busy "
                                  f"that long"),
    )
    warn = () if m.arch in ("sm90", "sm100") else (
        f"{hw.name} is {m.arch}: no TMA or wgmma; its kernels take the cp.async + mma.sync "
        f"rows",)
    return Sheet(f"TMA + wgmma for one {bm}x{bn} tile, K {k:,} ({model_name(model(args))}) on "
                 f"{hw.name}", (Section(f"BK = {BK} bf16 per k-step", lines),), warn,
                 verdict=f"per k-step: 2 TMA + {wg} wgmma vs {cp:,} cp.async + {mma:,} mma.sync",
                 data={"wgmma_per_kstep": wg, "mma_per_kstep": mma, "cp_async_per_kstep": cp})


def pages_per_tile(bc: int, b: int) -> int:
    """Blocks one Bc-token tile touches, tiles aligned to Bc and blocks to b."""
    if bc % b == 0:
        return bc // b
    if b % bc == 0:
        return 1
    return math.ceil(bc / b) + 1  # misaligned: a tile can straddle one more block


def build_paged(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    mi = gpu_micro(hw)
    spec = model(args).spec
    b = opt_int(args, "block_size", 16, hi=1 << 16)
    ctx = opt_tokens(args, "context", 8192)
    _br, bc = parse_tile(opt_str(args, "tile", "64x64"))
    lat = opt_float(args, "latency_ns", mi.dram_latency_ns) * 1e-9
    d, hkv = spec.head_dim, spec.num_kv_heads
    pages = pages_per_tile(bc, b)
    tile_bytes = 2 * bc * d * ACT  # K and V of one KV head
    t_tile = tile_bytes / (hw.mem_bytes_per_s / mi.sm_count)
    stages = math.ceil(2 * lat / t_tile) + 1
    table = TABLE_ENTRY * math.ceil(ctx / b)
    kv_seq = spec.num_layers * 2 * hkv * d * ACT * ctx
    lines = (
        line("blocks per KV tile", "Bc / b (aligned)", pages, str(pages),
             f"Bc {bc} / b {b} -> {pages} block(s) per tile"),
        line("dependent loads per tile", "block-table entries before the K/V loads", pages,
             f"{pages} table loads, then data",
             f"{pages} x {TABLE_ENTRY}-B entries; each K/V address waits for its entry: "
             f"2 latencies per tile unpipelined"),
        line("TMA boxes per tile (K and V)", "2 x blocks per tile", 2 * pages, str(2 * pages),
             f"a box cannot span blocks: 2 x {pages}; box {min(b, bc)} x {d} x 2 B = "
             f"{fmt_bytes(min(b, bc) * d * ACT)}"),
        line("contiguous run per head", "b x d x 2 B ([block, head, token, d]) vs d x 2 B "
             "([block, token, head, d])", b * d * ACT, f"{fmt_bytes(b * d * ACT)} / "
             f"{d * ACT} B", f"{b} x {d} x 2 = {b * d * ACT:,} B head-major in a block (fitserve's "
                             f"[kv_heads, blocks, block_size, d]); "
                             f"{d * ACT} B token-major (rows {hkv} x {d * ACT} B apart)"),
        line("tile stream time per SM", "2 Bc d x 2 B / (bw / SMs)", t_tile,
             fmt_seconds(t_tile), f"{tile_bytes:,} B / ({hw.mem_bytes_per_s:.4g} / "
                                  f"{mi.sm_count}) = {t_tile * 1e9:,.0f} ns"),
        line("stages to hide table + data latency", "ceil(2 x latency / t_tile) + 1", stages,
             str(stages), f"ceil(2 x {lat * 1e9:.0f} ns / {t_tile * 1e9:,.0f} ns) + 1 = {stages} "
                          f"tiles in flight (1 latency without paging: "
                          f"{math.ceil(lat / t_tile) + 1})"),
        line("block table per sequence vs its KV", "4 B x ceil(T / b) / KV bytes",
             table / kv_seq, f"{fmt_bytes(table)} ({table / kv_seq:.2e} of KV)",
             f"{TABLE_ENTRY} x ceil({ctx:,} / {b}) = {table:,} B vs {kv_seq:,} B of KV"),
    )
    return Sheet(f"Paged KV indirection: block {b}, tile {bc}, {model_name(model(args))} on "
                 f"{hw.name}", (Section("One KV tile of one KV head", lines),),
                 verdict=f"block {b}, tile {bc}: {pages} dependent table load(s) and "
                         f"{2 * pages} TMA boxes per tile; {stages} tiles in flight hide them",
                 data={"pages_per_tile": pages, "stages": stages})
