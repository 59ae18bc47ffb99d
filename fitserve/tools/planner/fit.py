"""Does a plan fit, by how much does it miss, and what would fit instead.

A plan FITS when each engine (one TP group; --gpus / --tp of them share the sequences, as
data-parallel replicas), sized by the memory ledger (``memory.py``), can hold its share of
the sequences, ``context`` tokens each, at once, on one rank:

    sequences = ceil(concurrency / (gpus / tp))
    KV needed = sequences x ceil(context / block_size) x block_bytes

    GPU, KV pool = what is left:   KV pool = total - lines above  >=  KV needed
                                   shortfall = KV needed - KV pool  (more memory per GPU)
    GPU, KV pool given (--kv-cache-memory / --num-kv-blocks):
                                   KV pool >= KV needed  and  lines above + max(KV pool,
                                   KV needed) <= total
    cpu (fixed KV budget):         KV pool >= KV needed  and  the peak RSS with that KV
                                   <= physical RAM
    always:                        max_num_seqs >= sequences (a count, no bytes)

Each miss names the ledger line at fault. A line above the KV pool is at fault when, from it
on, not even one KV block is left of total x utilization: the line the engine's own error
names (``memory._no_block_message``). ``shortfall_bytes`` is the largest miss: the bytes one
GPU (or a fixed KV pool) is short of.

What would fit instead is found by planning variants of the request with the same functions
(so a later ledger line, e.g. attention scratch growing with context, is counted too):
the largest context at the asked concurrency (vLLM's "estimated maximum model length"), the
largest concurrency at the asked context, the data-parallel replicas that would hold it, the
fewest GPUs (TP size) per weight format, an FP8 KV cache, or the KV budget the workload needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from fitserve.ledger.errors import PlanError
from fitserve.ledger.memory import (
    EngineMemoryPlan,
    cpu_engine_memory_plan,
    engine_load_transient_bytes,
    engine_memory_plan,
)
from fitserve.ledger.tp_split import check_tp_split
from fitserve.ledger.units import fmt_bytes
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.fit_more import format_pair, larger_gpu, smaller_tp
from fitserve.tools.planner.report import PlanRequest, Resolved, resolve
from fitserve.tools.planner.sections import runs_ggml_kernels, weight_bytes_per_gpu

# NOTE: smaller weight formats tried, largest first, when a plan misses (what vLLM users reach
# for: FP8, then weight-only int8 and int4 with 128-wide groups).
SMALLER_WEIGHT_FORMATS = ("fp8", "int8", "int4-g128")
Runtime = int | None | Literal["measure"]


@dataclass(frozen=True)
class Miss:
    """One reason a plan does not fit: ``line`` is the ledger line at fault (or a knob)."""

    line: str
    need: int
    have: int
    unit: str  # "bytes", or "sequences" for max_num_seqs
    shortfall_bytes: int
    reason: str


@dataclass(frozen=True)
class FitCheck:
    """The verdict for one plan, per rank."""

    fits: bool
    sequences: int  # per engine (TP group)
    kv_needed_bytes: int
    shortfall_bytes: int
    misses: tuple[Miss, ...]

    def marks(self) -> dict[str, str]:
        """Ledger line name -> why it misses (for marking the lines of the memory section)."""
        out: dict[str, str] = {}
        for m in self.misses:
            out[m.line] = f"{out[m.line]}; {m.reason}" if m.line in out else m.reason
        return out


@dataclass(frozen=True)
class Alternative:
    """A change to the request that fits: ``flags`` says it as `fitserve plan` options."""

    option: str  # context, concurrency, max_num_seqs, gpus, tp, weights, kv, weights+kv,
    # kv_cache_memory, gpu
    value: int | str
    flags: str
    note: str


def memory_plan(r: Resolved, *, runtime: Runtime = "measure") -> EngineMemoryPlan:
    """The engine's memory ledger, never refusing (``strict=False``): device memory on a GPU,
    the process's host memory on cpu (``runtime``: the baseline RSS, measured if "measure")."""
    q = r.req
    if r.on_cpu:
        from fitserve.ledger.runtime import runtime_baseline_bytes

        wb = weight_bytes_per_gpu(r)
        rt = runtime_baseline_bytes() if runtime == "measure" else runtime
        return cpu_engine_memory_plan(
            r.entry.spec, weight_bytes=wb, max_num_batched_tokens=q.max_num_batched_tokens,
            max_num_seqs=r.max_num_seqs, block_size=q.block_size, kv_dtype=r.kv_dtype,
            act_dtype_bytes=r.act_bytes, kv_cache_memory_bytes=q.kv_cache_memory_bytes,
            kv_blocks=q.num_kv_blocks, runtime_bytes=rt or 0,
            load_transient_bytes=engine_load_transient_bytes(r.entry.spec, wb, r.act_bytes),
            weights_note=r.weights_note, strict=False, max_model_len=q.context,
            runtime_note="" if rt is not None else "NOT MEASURED (torch not importable)",
            output_staging=runs_ggml_kernels(r))
    return engine_memory_plan(
        r.entry.spec, weight_bytes=weight_bytes_per_gpu(r), total_memory_bytes=r.hw.memory_bytes,
        memory_utilization=q.memory_utilization, max_num_batched_tokens=q.max_num_batched_tokens,
        max_num_seqs=r.max_num_seqs, block_size=q.block_size, kv_dtype=r.kv_dtype,
        act_dtype_bytes=r.act_bytes, workspace_bytes=r.workspace_bytes, tp=q.tp,
        kv_cache_memory_bytes=q.kv_cache_memory_bytes, kv_blocks=q.num_kv_blocks, strict=False)


def engine_sequences(req: PlanRequest) -> int:
    """Sequences one engine (TP group) holds: ceil(concurrency / data-parallel replicas)."""
    return -(-req.concurrency // (req.gpus // req.tp))


def kv_needed_bytes(mp: EngineMemoryPlan, context: int, sequences: int) -> int:
    """KV one rank must hold for ``sequences`` sequences of ``context`` tokens (whole blocks)."""
    return sequences * -(-context // mp.block_size) * mp.block_bytes


def check_fit(r: Resolved, mp: EngineMemoryPlan) -> FitCheck:
    """Whether ``mp`` holds its share of the request's sequences, and every miss if not."""
    seqs = engine_sequences(r.req)
    need = kv_needed_bytes(mp, r.req.context, seqs)
    misses = _cpu_misses(r, mp, need) if r.on_cpu else _gpu_misses(r, mp, need)
    if mp.max_num_seqs < seqs:
        misses.append(Miss("max_num_seqs", seqs, mp.max_num_seqs, "sequences", 0,
                           f"--max-num-seqs {mp.max_num_seqs} < {seqs} sequences per engine: "
                           f"the engine runs at most {mp.max_num_seqs} at once"))
    short = max((m.shortfall_bytes for m in misses), default=0)
    return FitCheck(not misses, seqs, need, short, tuple(misses))


def _short(need: int, have: int) -> str:
    return f"short by {fmt_bytes(need - have)} ({need - have:,} B)"


def _kv_miss(mp: EngineMemoryPlan, need: int, r: Resolved, fixed: bool) -> Miss | None:
    pool = mp.kv_pool_bytes
    if pool >= need:
        return None
    q = r.req
    why = (f"{engine_sequences(q)} x {q.context:,} tokens need {fmt_bytes(need)} ({need:,} B) of KV "
           f"per rank, the pool has {fmt_bytes(pool)}: {_short(need, pool)}")
    if fixed:
        why += f"; raise --kv-cache-memory to {need:,}"
    return Miss("KV pool", need, pool, "bytes", need - pool, why)


def _first_over(lines: Iterable[tuple[str, int]], limit: int) -> tuple[str, int] | None:
    """The first line (in order) at which the running sum exceeds ``limit``, and that sum."""
    running = 0
    for name, nbytes in lines:
        running += nbytes
        if running > limit:
            return name, running
    return None


def _gpu_misses(r: Resolved, mp: EngineMemoryPlan, need: int) -> list[Miss]:
    total, block = r.hw.memory_bytes, mp.block_bytes
    above = [(m.name, m.bytes) for m in mp.lines[:-1]]
    fixed = r.req.kv_cache_memory_bytes is not None or r.req.num_kv_blocks is not None
    misses: list[Miss] = []
    if not fixed:
        usable = total - mp.line("headroom").bytes
        over = _first_over([x for x in above if x[0] != "headroom"], usable - block)
        if over is not None:
            name, running = over
            need_here = running if running > usable else running + block
            what = (f"exceed the usable {fmt_bytes(usable)}" if running > usable else
                    f"leave less than one KV block ({fmt_bytes(block)}) of the usable "
                    f"{fmt_bytes(usable)}")
            misses.append(Miss(name, need_here, usable, "bytes", need_here - usable,
                               f"the lines up to {name} ({fmt_bytes(running)}) {what} (total "
                               f"{fmt_bytes(total)} x utilization {r.req.memory_utilization}):"
                               f" {_short(need_here, usable)}"))
    else:
        kv_line = ("KV pool", max(mp.kv_pool_bytes, need))
        over = _first_over([*above, kv_line], total)
        if over is not None:
            reserved = sum(b for _, b in above) + kv_line[1]
            misses.append(Miss(over[0], reserved, total, "bytes", reserved - total,
                               f"the lines up to {over[0]} with a KV pool of "
                               f"{fmt_bytes(kv_line[1])} take {fmt_bytes(reserved)} of "
                               f"{fmt_bytes(total)}: {_short(reserved, total)}"))
    kv = _kv_miss(mp, need, r, fixed)
    return misses + ([kv] if kv else [])


def _cpu_misses(r: Resolved, mp: EngineMemoryPlan, need: int) -> list[Miss]:
    kv = _kv_miss(mp, need, r, True)
    misses = [kv] if kv else []
    ram = r.hw.memory_bytes
    if ram <= 0:
        return misses  # physical RAM unknown: nothing to check the peak against
    peak = mp.peak_with_kv(max(mp.kv_allocated_bytes, need))
    if peak > ram:
        misses.append(Miss("total (peak RSS)", peak, ram, "bytes", peak - ram,
                           f"peak RSS {fmt_bytes(peak)} with the KV this workload needs > "
                           f"physical RAM {fmt_bytes(ram)}: {_short(peak, ram)}"))
    return misses


def _largest(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest x in [lo, hi] with ok(x), for ok true up to some x and false after."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _fits_fn(r: Resolved, runtime: Runtime) -> Callable[[PlanRequest], bool]:
    def fits(req: PlanRequest) -> bool:
        try:
            v = resolve(req, entry=r.entry, hw=r.hw)
            return check_fit(v, memory_plan(v, runtime=runtime)).fits
        except PlanError:
            return False  # a variant that cannot be planned (a TP size that does not divide)

    return fits


def _fits_on_fn(r: Resolved) -> Callable[[PlanRequest, str], bool]:
    """``fits`` on another catalog accelerator (a GPU plan: no measured runtime)."""
    def fits_on(req: PlanRequest, gpu: str) -> bool:
        try:
            v = resolve(dataclasses.replace(req, gpu=gpu), entry=r.entry)
            return check_fit(v, memory_plan(v, runtime=None)).fits
        except PlanError:
            return False

    return fits_on


def what_fits(r: Resolved, runtime: Runtime = None) -> tuple[Alternative, ...]:
    """Changes to a request that does not fit, each planned again and found to fit."""
    q, fits = r.req, _fits_fn(r, runtime)
    out: list[Alternative] = []
    ctx = _largest(lambda c: fits(dataclasses.replace(q, context=c, context_text=str(c))),
                   1, q.context - 1)
    if ctx is not None:
        out.append(Alternative("context", ctx, f"--context {ctx}",
                               f"the largest context for {q.concurrency} sequence(s): vLLM's "
                               f"estimated maximum model length"))
    conc = _largest(lambda n: fits(dataclasses.replace(q, concurrency=n)), 1, q.concurrency - 1)
    if conc is not None:
        out.append(Alternative("concurrency", conc, f"--concurrency {conc}",
                               f"the most sequences of {q.context:,} tokens at once"))
        out += _replicas(r, conc, fits)
    seqs = engine_sequences(q)
    if r.max_num_seqs < seqs and fits(dataclasses.replace(q, max_num_seqs=seqs)):
        out.append(Alternative("max_num_seqs", seqs, f"--max-num-seqs {seqs}",
                               f"let one engine run all {seqs} sequences at once"))
    if r.on_cpu or q.kv_cache_memory_bytes is not None or q.num_kv_blocks is not None:
        out += _pool_as_needed(r, fits)
    if not r.on_cpu:
        out += _more_gpus_or_smaller_formats(r, fits)
        more = [*smaller_tp(r, fits), *format_pair(r, fits, SMALLER_WEIGHT_FORMATS),
                *larger_gpu(r, _fits_on_fn(r))]
        out += [Alternative(*a) for a in more if a[2] not in {x.flags for x in out}]
    return tuple(out)


def _replicas(r: Resolved, conc: int, fits: Callable[[PlanRequest], bool]) -> list[Alternative]:
    """More engines of the same TP size, each holding what one holds now (``conc`` over all)."""
    q = r.req
    per_engine = max(1, conc // (q.gpus // q.tp))
    dp = -(-q.concurrency // per_engine)
    v = dataclasses.replace(q, gpus=dp * q.tp)
    if r.on_cpu or dp * q.tp <= q.gpus or not fits(v):
        return []
    return [Alternative("gpus", dp * q.tp, f"--gpus {dp * q.tp}",
                        f"{dp} data-parallel engines of TP {q.tp}, "
                        f"{engine_sequences(v)} sequences each")]


def _pool_as_needed(r: Resolved, fits: Callable[[PlanRequest], bool]) -> list[Alternative]:
    """A fixed KV pool of exactly what the workload needs (too small or too big now)."""
    mp = memory_plan(r, runtime=0)
    need = kv_needed_bytes(mp, r.req.context, engine_sequences(r.req))
    v = dataclasses.replace(r.req, kv_cache_memory_bytes=need, num_kv_blocks=None)
    if need == mp.kv_pool_bytes or not fits(v):
        return []
    return [Alternative("kv_cache_memory", need, f"--kv-cache-memory {need}",
                        f"a KV pool of {fmt_bytes(need)}: {r.req.concurrency} x "
                        f"{r.req.context:,} tokens")]


def _tp_sizes(r: Resolved) -> list[int]:
    """Valid TP sizes from the asked one up to the head count."""
    out = []
    for tp in range(r.req.tp, r.entry.spec.num_heads + 1):
        try:
            check_tp_split(r.entry.spec, tp, r.weights, r.base_dtype)
            out.append(tp)
        except PlanError:
            continue
    return out


def _more_gpus_or_smaller_formats(r: Resolved,
                                  fits: Callable[[PlanRequest], bool]) -> list[Alternative]:
    q, s = r.req, r.entry.spec
    out: list[Alternative] = []
    asked = model_weight_bytes(s, r.weights, tp=1, base_dtype=r.base_dtype).total
    smaller = [f for f in SMALLER_WEIGHT_FORMATS
               if model_weight_bytes(s, f, tp=1).total < asked]
    best_tp = 0  # the fewest GPUs found so far: a smaller format must beat it to be listed
    for fmt in [r.weights, *smaller]:
        for tp in _tp_sizes(r):
            if (fmt == r.weights and tp == q.tp) or (best_tp and tp >= best_tp):
                continue  # the asked plan, or no fewer GPUs than a larger format needs
            gpus = -(-max(q.gpus, tp) // tp) * tp
            weights = None if fmt == r.weights else fmt
            if fits(dataclasses.replace(q, weights=weights or q.weights, tp=tp, gpus=gpus)):
                flags = " ".join(x for x in (f"--weights {fmt}" if weights else "",
                                             f"--tp {tp} --gpus {gpus}" if tp != q.tp else "")
                                 if x)
                out.append(Alternative("weights" if weights else "tp",
                                       fmt if weights else gpus, flags,
                                       f"{fmt} weights on TP groups of {tp} GPUs"))
                best_tp = tp
                break
    if r.kv_dtype not in ("fp8", "int8") and fits(dataclasses.replace(q, kv="fp8")):
        out.append(Alternative("kv", "fp8", "--kv fp8", "an FP8 KV cache (half of 16-bit KV)"))
    return out
