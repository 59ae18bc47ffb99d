"""The engine-memory, fit, speed, energy and layout sections of a plan, and the whole plan."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fitserve.ledger.flops import attention_crossover_context, flops_per_token
from fitserve.ledger.memory import EngineMemoryPlan
from fitserve.ledger.parallel import tp_allreduce
from fitserve.ledger.speed import compute_bound_batch, decode_step, prefill_time, quant_crossover
from fitserve.ledger.units import fmt_bytes, fmt_count, fmt_seconds
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.energy import best_point, energy_curve
from fitserve.tools.planner.fit import (
    Alternative,
    FitCheck,
    Miss,
    check_fit,
    memory_plan,
    what_fits,
)
from fitserve.tools.planner.layouts import LayoutChoice, LayoutQuery, recommend_layout
from fitserve.tools.planner.report import (
    Line,
    PlanRequest,
    Resolved,
    Section,
    resolve,
    speed_weights,
)
from fitserve.tools.planner.sections import (
    kv_section,
    model_section,
    sharing_section,
    speculative_section,
    weights_section,
)
from fitserve.tools.planner.sections_moe import moe_section
from fitserve.tools.planner.sections_slo import step_time_section
from fitserve.tools.planner.sections_workload import workload_section


@dataclass(frozen=True)
class EngineSummary:
    """The figures the engine must reproduce, for machines (``fitserve plan --json``)."""

    device: str  # "cpu": host-memory ledger of fitserve's engine; "gpu": one device
    dtype: str  # model / activation dtype
    weights: str
    kv_dtype: str
    block_size: int
    block_bytes: int
    kv_bytes_per_token: int
    num_kv_blocks: int
    kv_budget_bytes: int
    kv_allocated_bytes: int
    weight_bytes: int
    peak_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    lines: dict[str, int]
    # cpu: peak_bytes = resident_bytes + max(load_bytes, kv_allocated_bytes + step_bytes); a run
    # that touched fewer KV blocks peaks at the same with its touched bytes in place of the pool
    resident_bytes: int = 0
    load_bytes: int = 0
    step_bytes: int = 0


def engine_summary(r: Resolved, mp: EngineMemoryPlan) -> EngineSummary:
    return EngineSummary(
        mp.device, r.act_dtype, r.weights, mp.kv_dtype, mp.block_size, mp.block_bytes,
        mp.kv_bytes_per_token, mp.num_kv_blocks, mp.kv_pool_bytes, mp.kv_allocated_bytes,
        mp.line("weights").bytes, mp.peak_bytes, mp.max_num_seqs,
        r.req.max_num_batched_tokens, {m.name: m.bytes for m in mp.lines},
        mp.resident_bytes, mp.load_bytes, mp.step_bytes)


def memory_section(r: Resolved, mp: EngineMemoryPlan, fc: FitCheck) -> Section:
    marks = fc.marks()
    lines = [Line(m.name, m.formula, m.bytes, fmt_bytes(m.bytes), m.note, marks.get(m.name, ""))
             for m in mp.lines]
    ceil = mp.max_concurrent_sequences(r.req.context)
    per_seq = -(-r.req.context // mp.block_size)
    short = (f"{fc.sequences} sequences per engine asked, at most {ceil.value} fit"
             if ceil.value < fc.sequences else "")
    lines += [
        Line("KV blocks", "num_kv_blocks", mp.num_kv_blocks, f"{mp.num_kv_blocks:,}",
             f"floor({mp.kv_pool_bytes:,} / {mp.block_bytes:,} B per block)"),
        Line(f"max concurrent @ {r.req.context} (ceiling)", "max_concurrent_sequences",
             ceil.value, f"<= {ceil.value:,}",
             f"min({mp.num_kv_blocks:,} // {per_seq} blocks per sequence, max_num_seqs="
             f"{mp.max_num_seqs}); limited by {ceil.limited_by}", short),
    ]
    if r.on_cpu:
        lines.append(Line("total (peak RSS)", "peak_bytes", mp.peak_bytes, fmt_bytes(mp.peak_bytes),
                          "runtime + weights + rope + max(loading transient, KV pool + step "
                          f"peak {mp.step_bytes:,} B = masks and block tables + max(attention phase: "
                          "activations + attention scratch (+ KV dequant scratch), mlp phase, "
                          "sampling phase: hidden + logits + sampler); set by the "
                          f"{mp.step_phase} phase); the bound with every KV block touched: a "
                          "run that has held fewer blocks at once holds that much less",
                          marks.get("total (peak RSS)", "")))
    notes = [f"per GPU of {fmt_bytes(r.hw.memory_bytes)} ({r.hw.name}); ceiling because: "
             + "; ".join(ceil.reasons)]
    if r.on_cpu:
        notes[0] = ("fitserve's engine on this CPU: the KV pool is a fixed budget "
                    "(--kv-cache-memory), not what is left of RAM; ceiling because: "
                    + "; ".join(ceil.reasons))
        if r.weights_note:
            notes.insert(0, f"weights: {r.weights_note} (tied embeddings counted once)")
    if not fc.fits:
        notes.append(f"DOES NOT FIT: {fc.sequences} sequences of {r.req.context} tokens per "
                     f"engine asked, at most {ceil.value} fit; the lines marked MISS say why")
    title = ("Engine host memory on cpu, in the order the process takes it" if r.on_cpu
             else "Engine memory, in reservation order (one GPU)")
    return Section(title, tuple(lines), tuple(notes))


def fit_section(r: Resolved, mp: EngineMemoryPlan, fc: FitCheck,
                alternatives: tuple[Alternative, ...], cannot: str = "") -> Section:
    """The verdict: fits or not, the KV the workload needs, each miss, what would fit;
    ``cannot``: the engine's refusal, which overrides a memory fit."""
    q, per_seq = r.req, -(-r.req.context // mp.block_size)
    where = "in the KV budget / host RAM" if r.on_cpu else "per GPU"
    dp = q.gpus // q.tp
    shown = "yes" if fc.fits else "NO"
    if cannot:
        shown = f"NO: {cannot} (memory alone: {'fits' if fc.fits else 'does not fit'})"
    lines = [
        Line("fits", "check_fit", fc.fits and not cannot, shown,
             f"{fc.sequences} x {q.context:,} tokens at once per engine "
             f"(ceil({q.concurrency} / {dp} engines of TP {q.tp}))"),
        Line("KV needed", "sequences x ceil(context / block_size) x block_bytes",
             fc.kv_needed_bytes, fmt_bytes(fc.kv_needed_bytes),
             f"{fc.sequences} x {per_seq:,} blocks x {mp.block_bytes:,} B = "
             f"{fc.kv_needed_bytes:,} B (one rank)"),
    ]
    if not fc.fits:
        lines.append(Line("shortfall", "max(miss shortfalls)", fc.shortfall_bytes,
                          f"{fmt_bytes(fc.shortfall_bytes)} ({fc.shortfall_bytes:,} B)",
                          f"bytes missing {where}"))
    lines += [Line(f"miss: {m.line}", "check_fit", m.shortfall_bytes,
                   f"{fmt_bytes(m.shortfall_bytes)}" if m.unit == "bytes"
                   else f"{m.have} < {m.need} {m.unit}", "", m.reason)
              for m in fc.misses]
    lines += [Line(f"would fit: {a.option}", "what_fits", a.value, a.flags, a.note)
              for a in alternatives]
    notes = () if fc.fits or alternatives else (
        "nothing tried fits: shorter context, fewer sequences, more GPUs, smaller formats",)
    title = "Fit: ENGINE CANNOT RUN" if cannot else "Fit" if fc.fits else "Fit: DOES NOT FIT"
    return Section(title, tuple(lines), notes)


def verdict(fc: FitCheck, alternatives: tuple[Alternative, ...], where: str) -> str:
    """One line for a plan that does not fit ("" if it fits)."""
    if fc.fits:
        return ""
    text = (f"short by {fmt_bytes(fc.shortfall_bytes)} ({fc.shortfall_bytes:,} B) {where}; "
            if fc.shortfall_bytes else "")
    text += "; ".join(f"{m.line}: {m.reason}" for m in fc.misses)
    if alternatives:
        text += "; would fit instead: " + " | ".join(a.flags for a in alternatives)
    return text


def speed_section(r: Resolved, batch: int) -> Section:
    s, hw, q = r.entry.spec, r.hw, r.req
    wb = speed_weights(r)
    tf = flops_per_token(s, q.context)
    cross = attention_crossover_context(s)
    ctx, kvd, wf = q.context, r.kv_dtype, r.weights
    one = decode_step(s, hw, wb, batch=1, context=ctx, kv_dtype=kvd, weights_fmt=wf)
    many = decode_step(s, hw, wb, batch=batch, context=ctx, kv_dtype=kvd, weights_fmt=wf)
    cb = compute_bound_batch(s, hw, wb, context=ctx, kv_dtype=kvd, weights_fmt=wf)
    pf = prefill_time(s, hw, wb, prompt_len=ctx, kv_dtype=kvd, weights_fmt=wf)
    ar = tp_allreduce(s, hw, tp=q.tp, tokens=batch, act_dtype_bytes=r.act_bytes)
    lines = [
        Line(f"FLOPs per token @ {q.context}", "flops_per_token", tf.total, fmt_count(tf.total),
             f"2 x active matmul = {tf.matmul:,} + attention {tf.attention:,} "
             f"({tf.attention_share:.1%})"),
        Line("attention = rest at context", "attention_crossover_context", cross,
             "never (windows cap it)" if cross is None else f"{cross:,} tokens"),
    ]
    rows = [("decode, batch 1", one)] + ([(f"decode, batch {batch}", many)] if batch > 1 else [])
    for label, st in rows:
        lines.append(Line(label, "decode_step (roofline)", st.seconds,
                          f"{fmt_seconds(st.seconds)}/token, {st.tokens_per_s:,.1f} tok/s, "
                          f"{st.bound}-bound",
                          f"max(({st.weight_bytes:,.0f} + {st.kv_bytes:,.0f}) B / "
                          f"{hw.mem_bytes_per_s:.3g} B/s, {st.flops:.4g} / "
                          f"{hw.peak_flops(r.weights, st.batch):.3g} FLOP/s) + comm "
                          f"{fmt_seconds(st.t_comm)} + overhead {fmt_seconds(st.t_overhead)}"))
    lines += [
        Line("compute-bound from batch", "compute_bound_batch", cb,
             "never (KV reads dominate)" if cb is None else f"{cb:,}"),
        Line(f"prefill {q.context} tokens (TTFT floor)", "prefill_time", pf.seconds,
             fmt_seconds(pf.seconds),
             f"max({pf.weight_bytes + pf.kv_bytes:,.0f} B / {hw.mem_bytes_per_s:.3g}, "
             f"{pf.flops:.4g} FLOPs / {hw.peak_flops(r.weights, q.context):.3g}) + comm "
             f"{fmt_seconds(pf.t_comm)} + overhead {fmt_seconds(pf.t_overhead)}"),
    ]
    if q.tp > 1:
        lines.append(Line("TP all-reduces per step", "tp_allreduce", ar.calls_per_step,
                          f"{ar.calls_per_step} x {fmt_bytes(ar.bytes_per_call)} = "
                          f"{fmt_seconds(ar.seconds_per_step)}",
                          f"2 x {s.num_layers} layers; each {batch} tokens x {s.hidden_size} x "
                          f"{r.act_bytes} B, {ar.algorithm} all-reduce (fastest at this size): "
                          f"{hw.link_latency_s * 1e6:.0f} us per call + hops + "
                          f"{ar.wire_bytes_per_call:,.0f} B sent / {hw.link_bytes_per_s:.3g} B/s"))
    if not r.weights.startswith("int4"):
        i4 = model_weight_bytes(s, "int4-g128", tp=q.tp)
        bf = model_weight_bytes(s, "bf16", tp=q.tp)
        x = quant_crossover(s, hw, i4, bf, context=q.context, kv_dtype=r.kv_dtype)
        table = ", ".join(f"B={b}: x{v:.2f}" for b, v in x.speedups)
        lines.append(Line("int4-g128 vs bf16 stops paying at batch", "quant_crossover",
                          x.stops_paying_at, str(x.stops_paying_at or "never"),
                          f"speedup of W4A16 over bf16 (< 1.05 = stops): {table}; bytes and "
                          f"FLOPs only: the dequant instructions per weight move it earlier "
                          f"(`fitserve plan explain q4km-cost --model ...` counts them)"))
    notes = ["floors: kernels reach a fraction of peak bandwidth and FLOP/s"]
    if hw.measured:  # the figures every line above divides by, and when they were taken
        notes.append(f"{hw.name}: {hw.source}")
    return Section(f"Speed (roofline on {hw.name}, per TP group of {q.tp})", tuple(lines),
                   tuple(notes))


def energy_section(r: Resolved, max_batch: int) -> Section | None:
    s, hw, q = r.entry.spec, r.hw, r.req
    if hw.power_w is None:
        return Section("Energy", (), (f"{hw.name} has no power figure: energy not estimated",))
    wb = speed_weights(r)
    batches = [1]
    while batches[-1] * 2 <= max(1, max_batch):
        batches.append(batches[-1] * 2)
    if batches[-1] != max_batch and max_batch > 1:
        batches.append(max_batch)
    steps = [decode_step(s, hw, wb, batch=b, context=q.context, kv_dtype=r.kv_dtype,
                         weights_fmt=r.weights) for b in batches]
    pts = energy_curve(steps, hw.power_w, q.tp)
    best = best_point(pts)
    lines = [Line(f"J/token, batch {p.batch}", "power / throughput", p.joules_per_token,
                  f"{p.joules_per_token:.4g} J", f"{p.watts:.0f} W / {p.tokens_per_s:,.1f} tok/s")
             for p in ((pts[0], best) if best.batch != pts[0].batch else (pts[0],))]
    return Section("Energy per token", tuple(lines),
                   (f"{q.tp} x {hw.power_w:.0f} W power limit at every batch: batch-1 figure is "
                    f"an upper bound; batches up to the KV ceiling {max_batch}",))


def layouts_section(r: Resolved) -> tuple[Section, LayoutChoice]:
    q = r.req
    lq = LayoutQuery(q.gpus, q.context, q.concurrency, r.weights, r.kv_dtype,
                     memory_utilization=q.memory_utilization, act_dtype_bytes=r.act_bytes,
                     step_tokens=q.max_num_batched_tokens, max_num_seqs=r.max_num_seqs)
    choice = recommend_layout(r.entry.spec, r.hw, lq)
    lines = tuple(
        Line(x.name, "layout", x.tokens_per_s,
             f"{'fits' if x.fits else 'NO FIT'}; W {fmt_bytes(x.weight_bytes_per_gpu)} + KV "
             f"{fmt_bytes(x.kv_bytes_per_gpu)}/GPU; dup KV {fmt_bytes(x.duplicated_kv_bytes)}; "
             f"comm {fmt_bytes(x.comm_bytes_per_token)}/tok; bubble {x.bubble:.0%}; "
             f"{x.tokens_per_s:,.0f} tok/s aggregate, {x.per_user_tokens_per_s:,.0f} per user"
             + (f" ({x.busy_replicas} of {x.dp} replicas busy)" if x.busy_replicas < x.dp
                else ""))
        for x in choice.layouts)
    return Section(f"Layouts on {q.gpus} x {r.hw.name} for {q.concurrency} x {q.context} tokens",
                   lines, (choice.reason,)), choice


@dataclass(frozen=True)
class Plan:
    """A whole plan. ``fits`` False: ``shortfall_bytes`` (per GPU, or of a fixed KV pool /
    host RAM on cpu), the ``misses`` that make it and ``alternatives`` that would fit."""

    title: str
    warnings: tuple[str, ...]
    sections: tuple[Section, ...]
    recommended_layout: str | None
    engine: EngineSummary | None = None
    fits: bool = True
    shortfall_bytes: int = 0
    shortfall_gib: float = 0.0
    misses: tuple[Miss, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    verdict: str = ""
    # on cpu, for a file fitserve's engine refuses: "engine: cannot run (<every missing part>)"
    engine_cannot_run: str = ""


def build_plan(req: PlanRequest) -> Plan:
    """Resolve the request and compute every section, fitting or not (raises PlanError only
    on input that cannot be planned)."""
    r = resolve(req)
    req = r.req  # the model's own context filled in where none was asked
    mp = memory_plan(r)
    fc = check_fit(r, mp)
    runtime = mp.line("runtime baseline").bytes if r.on_cpu else None
    alts = () if fc.fits else what_fits(r, runtime)
    ceiling = mp.max_concurrent_sequences(req.context).value
    batch = max(1, min(req.concurrency, ceiling))
    # NOTE: the memory lines still print (what it would take), but the plan never says "fits"
    # for a model the engine refuses: it names every missing part and exits 1.
    cannot = (f"engine: cannot run ({'; '.join(r.entry.engine_refusal)})"
              if r.on_cpu and r.entry.engine_refusal else "")
    sections = [model_section(r), weights_section(r), kv_section(r), memory_section(r, mp, fc),
                fit_section(r, mp, fc, alts, cannot), speed_section(r, batch),
                workload_section(r, mp)]
    moe = moe_section(r, batch)
    if moe is not None:
        sections.append(moe)
    energy = energy_section(r, max(1, ceiling))
    if energy is not None:
        sections.append(energy)
    for optional in (sharing_section(r), speculative_section(r), step_time_section(r, batch)):
        if optional is not None:
            sections.append(optional)
    lay, choice = layouts_section(r)
    sections.append(lay)
    hyp = " [HYPOTHETICAL]" if r.hypothetical else ""
    title = (f"fitserve plan: {r.entry.spec.name} on {req.gpus} x {r.hw.name}, tp={req.tp}, "
             f"context {req.context_text} = {req.context:,} tokens (k = x1024), weights "
             f"{r.weights}, KV {r.kv_dtype}, concurrency {req.concurrency}{hyp}")
    if r.on_cpu:
        title += f"; fitserve engine dtype {r.act_dtype}, max_num_seqs {r.max_num_seqs}"
    where = "in the KV budget / host RAM" if r.on_cpu else "per GPU"
    plan = Plan(title, r.warnings, tuple(sections),
                choice.recommended.name if choice.recommended else None, engine_summary(r, mp),
                fc.fits, fc.shortfall_bytes, round(fc.shortfall_bytes / (1 << 30), 2),
                fc.misses, alts, verdict(fc, alts, where))
    if cannot:
        plan = dataclasses.replace(plan, fits=False, verdict=cannot, engine_cannot_run=cannot)
    return plan
