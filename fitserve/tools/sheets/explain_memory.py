"""`plan explain fa-l2-reuse | gemv-coalescing | smem-swizzle`: where bytes really move.

fa-l2-reuse: FlashAttention's textbook IO count re-reads K and V once per query tile (Tr = N /
Br times) from HBM. Concurrent CTAs of one wave work on neighbouring query tiles of the same
head(s) (the query-tile index is the grid's fastest axis), so they ask for the same K/V tiles at
about the same time: while the wave's K/V working set fits in L2 every re-read after the first
hits L2 and HBM sees Q, K, V and O once each. Per head, in units U = N d x 2 B:

    naive attention  = Q, K, V, O (4U) + S written, read; P written, read (4 N^2 x 2 B)
    textbook FA      = Q + O (2U) + Tr x (K + V) (2 Tr U)
    with L2 reuse    = 4U

gemv-coalescing: a warp load is served in 32-byte sectors (4 per 128-byte line); efficiency =
useful bytes / (distinct sectors x 32 B). smem-swizzle: shared memory has 32 banks of 4 bytes;
a warp's access is split into phases (32 lanes for 4-B accesses, 8 lanes for 16-B vectors) and
a phase takes as many passes as the most distinct words asked of one bank.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable

from fitserve.ledger.units import fmt_bytes
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.sheets.explain_attention import parse_tile
from fitserve.tools.sheets.explain_common import (
    hardware,
    line,
    model,
    model_name,
    opt_str,
    opt_tokens,
    pct,
)
from fitserve.tools.sheets.explain_micro import gpu_micro
from fitserve.tools.sheets.sheet import Sheet

FA_FLAGS = ("gpu", "model", "context", "tile")
GEMV_FLAGS = ("model",)
SMEM_FLAGS = ("gpu",)
ACT = 2  # bf16 bytes
SECTOR, LINE = 32, 128
BANKS, BANK_BYTES = 32, 4
# L2 per accelerator (MiB), from the vendors' whitepapers; not in the catalog.
L2_MIB = {"a100-40gb": 40, "a100-80gb": 40, "h100": 50, "h200": 50, "l40s": 96, "b200": 126}


def kv_heads_in_wave(q_heads: int, group: int, kv_heads: int) -> int:
    """KV heads a run of ``q_heads`` consecutive query heads can touch (straddling a group)."""
    return min(kv_heads, math.ceil((q_heads - 1) / group) + 1)


def wave_working_set(sms: int, n: int, br: int, heads: int, kv_heads: int, d: int) -> int:
    """Bytes one wave keeps live in L2: the K/V of the KV heads it touches + its Q, O tiles."""
    tr = math.ceil(n / br)
    q_heads = min(heads, math.ceil(sms / tr) + 1)
    kv = kv_heads_in_wave(q_heads, heads // kv_heads, kv_heads) * 2 * n * d * ACT
    return kv + sms * 2 * br * d * ACT


def build_fa(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    m = gpu_micro(hw)
    spec = model(args).spec
    n = opt_tokens(args, "context", 8192)
    br, _bc = parse_tile(opt_str(args, "tile", "128x128"))
    d, h, hkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    u = n * d * ACT
    tr = math.ceil(n / br)
    naive, textbook, reuse = 4 * u + 4 * n * n * ACT, 2 * u + 2 * tr * u, 4 * u
    l2 = L2_MIB[hw.name] * 2**20
    ws = wave_working_set(m.sm_count, n, br, h, hkv, d)
    q_in_wave = min(h, math.ceil(m.sm_count / tr) + 1)
    layer_hbm = h * 2 * u + hkv * 2 * u if ws <= l2 else h * textbook
    spill = _first_spill(lambda c: wave_working_set(m.sm_count, c, br, h, hkv, d) > l2, br)
    lines = (
        line("U = one head's Q (or K, V, O)", "N x d x 2 B", u, fmt_bytes(u),
             f"{n:,} x {d} x 2 = {u:,} B"),
        line("naive attention per head", "4U + 4 N^2 x 2 B", naive, fmt_bytes(naive),
             f"4 x {u:,} + 4 x {n:,}^2 x 2 = {naive:,} B (S and P written and read)"),
        line("textbook FlashAttention per head", "2U + 2 Tr U", textbook, fmt_bytes(textbook),
             f"Tr = {n:,} / {br} = {tr}: 2 x {u:,} + 2 x {tr} x {u:,} = {textbook:,} B "
             f"({naive / textbook:.2f}x below naive)"),
        line("with L2 reuse per head", "4U (each tensor once)", reuse, fmt_bytes(reuse),
             f"4 x {u:,} = {reuse:,} B: {naive / reuse:.1f}x below naive, "
             f"{textbook / reuse:.1f}x below the textbook count"),
        line("query heads per wave", "min(H, ceil(SMs / Tr) + 1)", q_in_wave, str(q_in_wave),
             f"{m.sm_count} CTAs in flight / {tr} query tiles per head -> up to {q_in_wave} "
             f"heads (one straddled)"),
        line("L2 working set per wave", "KV heads x 2 N d x 2 B + SMs x 2 Br d x 2 B", ws,
             f"{fmt_bytes(ws)} of {L2_MIB[hw.name]} MiB L2" + ("" if ws <= l2 else ": SPILLS"),
             f"{kv_heads_in_wave(q_in_wave, h // hkv, hkv)} KV heads x 2 x {n:,} x {d} x 2 + "
             f"{m.sm_count} x 2 x {br} x {d} x 2 (Q, O tiles) = {ws:,} B"),
        line("HBM bytes per layer (batch 1)", "H x 2U + H_kv x 2U if it fits, else H x "
             "textbook", layer_hbm, fmt_bytes(layer_hbm),
             f"{h} x 2 x {u:,} + {hkv} x 2 x {u:,} = {h * 2 * u + hkv * 2 * u:,} B (fits); "
             f"textbook {h} x {textbook:,} = {h * textbook:,} B"),
        line("context where the wave's K/V spills L2", "first N with working set > L2",
             spill if spill else "none", f"{spill:,} tokens" if spill else "none up to 4M",
             f"bisected over multiples of Br = {br}; past it the re-reads go to HBM"),
    )
    return Sheet(f"FlashAttention IO with L2 reuse: {model_name(model(args))} at {n:,} on "
                 f"{hw.name}", (Section(f"One attention layer, tile Br={br}", lines, (
                     "full (non-causal) attention; a causal mask halves the K/V re-reads and "
                     "the naive S, P traffic, not the L2 case",
                     f"L2 sizes: {L2_MIB[hw.name]} MiB on {hw.name} (vendor whitepaper); "
                     "ASSUMED: the query-tile index is the grid's fastest axis and one CTA "
                     "per SM")),),
                 verdict=f"{n:,} tokens: naive {fmt_bytes(naive)}, textbook "
                         f"{fmt_bytes(textbook)} ({naive / textbook:.1f}x less), L2 reuse "
                         f"{fmt_bytes(reuse)} ({naive / reuse:.1f}x less) per head",
                 data={"naive_over_reuse": naive / reuse, "naive_over_textbook":
                       naive / textbook, "working_set": ws, "spill_context": spill})


def _first_spill(spills: Callable[[int], bool], br: int, top: int = 4 << 20) -> int | None:
    lo, hi = 0, br
    while not spills(hi):
        if hi >= top:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > br:
        mid = (lo + hi) // 2 // br * br
        lo, hi = (lo, mid) if spills(mid) else (mid, hi)
    return hi


def sectors(addresses: Iterable[tuple[int, int]], unit: int = SECTOR) -> int:
    """Distinct ``unit``-byte pieces (32-B sectors; 128-B lines) touched by (address, bytes)."""
    out: set[int] = set()
    for a, nb in addresses:
        out.update(range(a // unit, (a + nb - 1) // unit + 1))
    return len(out)


def build_gemv(args: argparse.Namespace) -> Sheet:
    spec = model(args).spec
    k = spec.hidden_size
    cases: tuple[tuple[str, int, Callable[[int], int]], ...] = (  # name, bytes per lane, lane -> (address) for a row-major N x K weight
        ("row-major, warp per row, bf16 x8 (16-B vector)", 16, lambda ln: ln * 16),
        ("row-major, warp per row, int4 x32 (16-B vector)", 16, lambda ln: ln * 16),
        ("row-major, thread per row, bf16 scalar", 2, lambda ln: ln * k * ACT),
        ("row-major, thread per row, int4 x8 (int32)", 4, lambda ln: ln * k // 2),
        ("column-major, thread per row, bf16 scalar", 2, lambda ln: ln * ACT),
        ("column-major, thread per 8 rows, int4 x8 (int32)", 4, lambda ln: ln * 4),
    )
    lines: list[Line] = []
    for name, nb, addr in cases:
        sec = sectors((addr(ln), nb) for ln in range(32))
        lns = sectors(((addr(ln), nb) for ln in range(32)), LINE)
        useful = 32 * nb
        eff = useful / (sec * SECTOR)
        lines.append(line(name, "32 x bytes per lane / (sectors x 32 B)", eff,
                          f"{pct(eff)}: {sec} sectors in {lns} x 128-B lines",
                          f"lane i reads {nb} B at {_addr_text(addr)}: {useful} useful B in "
                          f"{sec} sectors x 32 B = {sec * SECTOR} B fetched"))
    return Sheet(f"GEMV coalescing: one warp load, K = {k:,} ({model_name(model(args))})",
                 (Section("Which lane reads which element (y = W x, W is N x K)", tuple(lines),
                          ("a warp load is one request; the memory system serves it as the "
                           "distinct 32-B sectors it touches, grouped by 128-B line",
                           "thread per row on a row-major W: lanes are K x 2 B apart, one "
                           "sector each; store W column-major (K-major transposed) or give "
                           "each row a warp",)),),
                 verdict="a warp per row (or column-major W) fetches only useful bytes; a "
                         "thread per row on row-major W wastes 15/16 (bf16) or 7/8 (int4)")


def _addr_text(addr: Callable[[int], int]) -> str:
    return f"{addr(0)}, {addr(1)}, {addr(2)}, ... B"


def bank_passes(word_addrs: list[list[int]]) -> int:
    """Passes of one access: per phase, the most distinct 4-B words asked of one bank."""
    worst = 1
    for phase in word_addrs:
        per_bank: dict[int, set[int]] = {}
        for w in phase:
            per_bank.setdefault(w % BANKS, set()).add(w)
        worst = max(worst, max(len(s) for s in per_bank.values()))
    return worst


def _column_fp32(stride_words: int) -> int:
    """32 lanes read one fp32 column of a [32][stride] tile."""
    return bank_passes([[i * stride_words for i in range(32)]])


def _column_vec16(row_bytes: int, swizzle: bool) -> int:
    """Lanes read 16-B chunk 0 of rows 0..31 (phases of 8 lanes); swizzle: chunk ^ (row % 8)."""
    phases = []
    for p in range(4):
        words: list[int] = []
        for r in range(8 * p, 8 * p + 8):
            chunk = (0 ^ (r % 8)) if swizzle else 0
            base = (r * row_bytes + chunk * 16) // BANK_BYTES
            words.extend(range(base, base + 4))
        phases.append(words)
    return bank_passes(phases)


def build_smem(args: argparse.Namespace) -> Sheet:
    m = gpu_micro(hardware(args))
    rows = (
        ("fp32 [32][32], column read", _column_fp32(32), 0, 32 * 32 * 4),
        ("fp32 [32][33] (1-word pad), column read", _column_fp32(33), 32 * 4, 32 * 32 * 4),
        ("bf16 [32][64] 16-B vectors, chunk-column read", _column_vec16(128, False), 0,
         32 * 128),
        ("bf16 [32][72] (16-B pad), chunk-column read", _column_vec16(144, False), 32 * 16,
         32 * 128),
        ("bf16 [32][64] XOR swizzle chunk ^ (row % 8)", _column_vec16(128, True), 0, 32 * 128),
    )
    lines = tuple(
        line(name, "max distinct words per bank per phase", passes,
             f"{passes}-way" + (f", +{fmt_bytes(pad)} ({pct(pad / size)})" if pad else ""),
             f"{passes} pass(es) per phase; padding {pad} B on a {size:,}-B tile")
        for name, passes, pad, size in rows)
    return Sheet(f"Shared memory: padding vs swizzle ({m.arch}, {BANKS} banks x {BANK_BYTES} B)",
                 (Section("A column of a tile, read by one warp", lines,
                          ("TMA writes dense boxes (optionally 32/64/128-B swizzled) and wgmma "
                           "descriptors expect those layouts: a padded row exists for neither, "
                           "so Hopper kernels swizzle",)),),
                 verdict="pad fp32 scalars by one word (3.1%); for 16-B vectors XOR-swizzle "
                         "the chunk index (0 bytes) instead of a 16-B pad (12.5%)")
