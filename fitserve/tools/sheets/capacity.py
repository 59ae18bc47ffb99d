"""`fitserve plan capacity`: capacity units at an SLO across GPU generations.

One replica (a TP group) of each GPU runs the roofline step-time model
``t = a + b new_tokens + c seqs + d kv_tokens_read`` (plan.step_time). Requests of P prompt
and O new tokens arrive at rate lambda; in steady state (Little's law) each step lasts t, B =
lambda O t sequences decode and the step carries lambda (P + O) t tokens, so

    t(lambda) = H / (1 - lambda K),  H = a + c + d P,  K = b (P + O) + c O + d O (P + O/2)
    B(lambda) = lambda O t(lambda)   <=>   lambda(B) = B / (O H + B K)

Three limits on lambda, the smallest is the replica's capacity at the SLO:

    TPOT   t(lambda) <= T                       -> predicted_knee = (T - H) / (T K)
    KV     B <= the KV pool's ceiling of sequences of P + O tokens (plan.memory)
    TTFT   (1 + ceil(P / cap(B))) T <= TTFT     cap(B): the prompt tokens a step may take
           beside B decodes within T (StepTimeModel.max_new_tokens, the slo policy's chunk);
           one step in flight on arrival, then the prompt's chunks, no queue of other prompts

A capacity unit is the rate one reference GPU (--unit-gpu) sustains: lambda_ref / tp_ref
requests/s. A GPU's worth is its rate per GPU in units; routing weights are proportional to a
replica's units. ``cpu:N`` is a replica of N threads of this CPU (its measured figures, its
share of them: capacity_kinds), and several --weights compare each device in each format.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import dtype_bytes, resolve_kv_dtype
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.memory import DEFAULT_GPU_WORKSPACE_BYTES, engine_memory_plan
from fitserve.ledger.moe import expected_experts_touched
from fitserve.ledger.speed import MAX_BATCH
from fitserve.ledger.step_time import StepTimeModel
from fitserve.ledger.tp_split import check_tp_split
from fitserve.ledger.units import fmt_bytes, parse_tokens
from fitserve.ledger.weights import roofline_weight_bytes
from fitserve.tools.planner.model_source import resolve_model
from fitserve.tools.planner.report import ENGINE_DEFAULTS, Line, Section
from fitserve.tools.sheets._rates import (
    Workload,
    assignments,
    cheapest_mix,
    chunk_cap,
    count,
    open_fraction,
    positive,
    ttft_at,
)
from fitserve.tools.sheets.capacity_kinds import (
    ReplicaKind,
    find_kind,
    kind_hardware,
    replica_kinds,
)
from fitserve.tools.sheets.capacity_steps import step_model
from fitserve.tools.sheets.sheet import Sheet

AUTO_TP = (1, 2, 4, 8)
DEFAULT_UTILIZATION = 0.8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="catalog name, a config.json (or its folder), or a .gguf file")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="time per output token")
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="time to first token")
    p.add_argument("--gpus", default="h100",
                   help="replicas to compare, comma-separated: catalog GPUs, and cpu:N for a "
                        "replica of N threads of this CPU (cpu: all its cores)")
    p.add_argument("--unit-gpu", default=None,
                   help="the unit's replica kind, e.g. h100 or cpu:1 (default: the first)")
    p.add_argument("--prompt-tokens", default="1k", help="prompt tokens per request (1k = 1024)")
    p.add_argument("--new-tokens", default="256", help="new tokens per request")
    p.add_argument("--weights", default=None,
                   help="weight format, or several comma-separated (each --gpus entry in each: "
                        "named DEVICE/FORMAT, e.g. cpu:1/int4); default: the checkpoint's")
    p.add_argument("--kv", default=None, help="KV format (default: the model dtype)")
    p.add_argument("--tp", default="auto",
                   help="tensor parallel size of a replica, or auto: the smallest of 1, 2, 4, 8 "
                        "that holds the weights and one sequence")
    p.add_argument("--memory-utilization", type=float,
                   default=ENGINE_DEFAULTS.cache.gpu_memory_utilization)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's cap on sequences (default: what the KV pool holds)")
    p.add_argument("--demand-rps", type=float, default=None, help="requests/s to buy for")
    p.add_argument("--utilization", type=float, default=DEFAULT_UTILIZATION,
                   help=f"run replicas at this share of their SLO capacity (at 1.0 queues grow "
                        f"without bound); default {DEFAULT_UTILIZATION}")
    p.add_argument("--price", default=None,
                   help="$ per GPU-hour, e.g. h100=2.5,b200=6: the cheapest mix for --demand-rps")
    p.add_argument("--fleet", default=None,
                   help="GPUs owned, e.g. h100=16,a100-80gb=32: routing shares and whether it "
                        "serves --demand-rps")
    p.add_argument("--emit-ray-config", default=None, metavar="FILE",
                   help="write a Ray Serve config for fitserve's replicas (serve deploy FILE): "
                        "per GPU, --fleet's replicas, else those --demand-rps needs on --unit-gpu")


@dataclass(frozen=True)
class GpuCapacity:
    """One replica of one GPU at the SLO (rates in requests/s of the replica)."""

    name: str  # the replica kind (capacity_kinds): "h100", "cpu:2", "cpu:1/int4"
    hw: Hardware
    tp: int
    weight_bytes: int  # per GPU
    kv_seqs: int  # the KV pool's ceiling of P + O sequences
    model: StepTimeModel
    h: float
    k: float
    rate_tpot: float
    rate_kv: float
    b_ttft: int | None  # most decoding sequences meeting TTFT (None: no limit found)
    rate_ttft: float | None
    rate: float
    binding: str
    note: str = ""
    tp_rule: str = ""
    # MoE: the tokens a steady-state step carries and the experts they touch (of num_experts)
    step_tokens: int = 0
    experts_touched: float = 0.0
    num_experts: int = 0
    weights: str = ""
    threads: int = 0  # a CPU replica's threads (0: a GPU)

    @property
    def per_gpu(self) -> float:
        return self.rate / self.tp


def _memory(spec: ModelSpec, hw: Hardware, args: argparse.Namespace, weights: str, kv: str,
            act_bytes: int, tp: int, context: int) -> tuple[int, int]:
    """(weight bytes per GPU, KV ceiling of ``context``-token sequences) on one rank."""
    wb = roofline_weight_bytes(spec, weights, tp=tp)  # what roofline_step_model counts
    seqs = ENGINE_DEFAULTS.scheduler.max_num_seqs if args.max_num_seqs is None else count(
        "--max-num-seqs", args.max_num_seqs)
    for _ in range(2):  # NOTE: max_num_seqs defaults to what the pool holds (its logits line)
        mp = engine_memory_plan(
            spec, weight_bytes=wb.total, total_memory_bytes=hw.memory_bytes,
            memory_utilization=args.memory_utilization,
            max_num_batched_tokens=ENGINE_DEFAULTS.scheduler.max_num_batched_tokens, max_num_seqs=seqs,
            block_size=ENGINE_DEFAULTS.cache.block_size, kv_dtype=kv, act_dtype_bytes=act_bytes,
            workspace_bytes=DEFAULT_GPU_WORKSPACE_BYTES, tp=tp, strict=False)
        by_kv = mp.num_kv_blocks // -(-context // mp.block_size)
        if args.max_num_seqs is not None:
            break
        seqs = max(seqs, by_kv)
    return wb.total, mp.max_concurrent_sequences(context).value


def _tp_and_memory(spec: ModelSpec, hw: Hardware, args: argparse.Namespace, weights: str,
                   kv: str, act_bytes: int, w: Workload) -> tuple[int, int, int]:
    ctx = w.prompt + w.new
    if hw.name.startswith("cpu"):  # NOTE: a CPU replica is one process on its threads
        return (1, *_memory(spec, hw, args, weights, kv, act_bytes, 1, ctx))
    if args.tp != "auto":
        try:
            tp = int(args.tp)
        except ValueError:
            raise PlanError(f"--tp must be a whole number or auto, got {args.tp!r}") from None
        check_tp_split(spec, tp, weights)
        return (tp, *_memory(spec, hw, args, weights, kv, act_bytes, tp, ctx))
    last = (AUTO_TP[-1], 0, 0)
    for tp in AUTO_TP:
        try:
            check_tp_split(spec, tp, weights)
        except PlanError:
            continue
        last = (tp, *_memory(spec, hw, args, weights, kv, act_bytes, tp, ctx))
        if last[2] >= 1:
            break
    return last


def gpu_capacity(kind: ReplicaKind, spec: ModelSpec, args: argparse.Namespace, kv: str,
                 act_bytes: int, w: Workload) -> GpuCapacity:
    """One replica of ``kind`` at the SLO."""
    hw, weights = kind_hardware(kind), kind.weights
    tp, wbytes, kv_seqs = _tp_and_memory(spec, hw, args, weights, kv, act_bytes, w)
    m, r = step_model(spec, hw, weights, kv, tp, w, kv_seqs)
    limits = r.limits()
    binding = min(limits, key=lambda x: limits[x])
    note = ""
    if kv_seqs < 1:
        note = f"does not hold the weights and one {w.prompt + w.new:,}-token sequence at tp={tp}"
    elif r.tpot <= 0:
        note = f"one step's weight read alone ({m.a * 1e3:.2f} ms) exceeds the TPOT target"
    elif not r.ttft_met:
        note = "even an idle replica misses the TTFT target"
    elif limits[binding] <= 0:
        note = f"{binding} leaves no request rate"
    rule = ("a CPU replica: one process" if kind.threads else "given" if args.tp != "auto" else
            "auto: the smallest of 1, 2, 4, 8 that holds the weights and one sequence")
    n = r.step_tokens(w)
    e, k = spec.num_experts, spec.num_experts_per_token
    return GpuCapacity(kind.name, hw, tp, wbytes, kv_seqs, m, r.h, r.k, r.tpot, r.kv, r.b_ttft,
                       r.ttft, max(0.0, limits[binding]), binding, note, rule, n,
                       expected_experts_touched(e, k, n) if e else 0.0, e, weights, kind.threads)


def _gpu_section(g: GpuCapacity, w: Workload) -> Section:
    p, o, t = w.prompt, w.new, w.tpot
    m = g.model
    lines = [
        Line("tensor parallel size", "--tp", g.tp, str(g.tp), g.tp_rule),
        Line("weights per GPU", "model_weight_bytes / tp", g.weight_bytes,
             fmt_bytes(g.weight_bytes), f"of {fmt_bytes(g.hw.memory_bytes)} on each {g.hw.name}"),
        Line(f"KV ceiling, sequences of {p + o:,}", "max_concurrent_sequences", g.kv_seqs,
             f"{g.kv_seqs:,}", "engine_memory_plan: what the weights, activations, logits, "
             "workspace and headroom leave, in whole blocks"),
        Line("step-time model", "roofline_step_model", m.describe(), m.describe(),
             m.source),
        *([Line("MoE: tokens per step at capacity, experts read", "lambda (P + O) t; "
                "E (1 - (1 - k/E)^n)", g.step_tokens, f"{g.step_tokens:,} tokens, "
                f"{g.experts_touched:.1f} of {g.num_experts} experts",
                "a reads the experts a step of this many tokens touches (uniform routing), at "
                "the rate it sets: the fixed point of capacity_steps.step_model")]
          if g.num_experts else []),
        Line("per-step constant", "H = a + c + d P", g.h, f"{g.h * 1e3:.4f} ms",
             f"{m.a * 1e3:.4f} ms + {m.c * 1e3:.4f} ms + {m.d * 1e9:.4f} ns x {p:,}"),
        Line("per-request load", "K = b (P+O) + c O + d O (P + O/2)", g.k, f"{g.k * 1e3:.4f} ms",
             f"{m.b * 1e6:.4f} us x {p + o:,} + {m.c * 1e6:.4f} us x {o:,} + {m.d * 1e9:.4f} ns "
             f"x {o:,} x {p + o / 2:,.1f}"),
        Line("rate at the TPOT target", "(T - H) / (T K)", g.rate_tpot,
             f"{g.rate_tpot:,.3f} req/s", f"({t * 1e3:g} ms - {g.h * 1e3:.4f} ms) / "
             f"({t * 1e3:g} ms x {g.k * 1e3:.4f} ms): predicted_knee"),
        Line("rate at the KV ceiling", "B / (O H + B K)", g.rate_kv, f"{g.rate_kv:,.3f} req/s",
             f"{g.kv_seqs:,} / ({o:,} x {g.h * 1e3:.4f} ms + {g.kv_seqs:,} x "
             f"{g.k * 1e3:.4f} ms)"),
    ]
    if g.b_ttft is None:
        lines.append(Line("rate at the TTFT target", "B / (O H + B K)", None, "no limit",
                          f"TTFT holds up to {MAX_BATCH:,} decoding sequences"))
    else:
        lines.append(Line("rate at the TTFT target", "B_ttft / (O H + B_ttft K)", g.rate_ttft,
                          f"{g.rate_ttft or 0:,.3f} req/s (B <= {g.b_ttft:,})",
                          f"largest B with (1 + ceil({p:,} / cap(B))) x {t * 1e3:g} ms <= "
                          f"{w.ttft * 1e3:g} ms, i.e. cap(B) >= ceil({p:,} / {w.steps_max}) = "
                          f"{math.ceil(p / w.steps_max):,} tokens"))
    lines.append(Line("replica capacity at the SLO", "min(TPOT, KV, TTFT rates)", g.rate,
                      f"{g.rate:,.3f} req/s", f"set by {g.binding}" + (f": {g.note}" if g.note
                                                                       else ""),
                      g.note))
    if g.rate > 0:
        tt = g.h / (1 - g.rate * g.k)
        b = g.rate * o * tt
        lines += [
            Line("at capacity: step time, decoding", "t = H / (1 - lambda K), B = lambda O t",
                 tt, f"{tt * 1e3:.3f} ms, {b:,.1f} seqs",
                 f"{g.h * 1e3:.4f} ms / (1 - {g.rate:.4f} x {g.k * 1e3:.4f} ms)"),
            Line("at capacity: TTFT", "(1 + ceil(P / cap(B))) T", ttft_at(m, w, math.floor(b)),
                 f"{ttft_at(m, w, math.floor(b)) * 1e3:,.0f} ms",
                 f"cap({math.floor(b):,}) = {chunk_cap(m, w, math.floor(b)):,} prompt tokens "
                 f"per step"),
        ]
    lines.append(Line("capacity per GPU", "rate / tp", g.per_gpu, f"{g.per_gpu:,.3f} req/s",
                      f"{g.rate:,.4f} / {g.tp}"))
    return Section(f"{g.name} x {g.tp}: one replica at the SLO", tuple(lines))


def _units_section(caps: list[GpuCapacity], ref: GpuCapacity, fleet: dict[str, float] | None,
                   kinds: list[ReplicaKind]) -> tuple[Section, float | None]:
    unit = ref.per_gpu
    lines = [Line("capacity unit", f"rate per {ref.name} {'replica' if ref.threads else 'GPU'}",
                  unit, f"{unit:,.3f} req/s", f"{ref.rate:,.4f} req/s / {ref.tp} GPU(s) at the SLO"
                  if not ref.threads else f"{ref.rate:,.4f} req/s at the SLO")]
    for g in caps:  # NOTE: a CPU replica is one process (tp 1): per GPU reads per replica
        lines.append(Line(f"{g.name}: units per {'replica' if g.threads else 'GPU'}",
                          "(rate / tp) / unit", g.per_gpu / unit,
                          f"{g.per_gpu / unit:,.3f}", f"{g.per_gpu:,.4f} / {unit:,.4f}"))
    for g in caps:
        lines.append(Line(f"{g.name}: routing weight per replica", "rate / unit",
                          g.rate / unit, f"{g.rate / unit:,.3f}", f"{g.rate:,.4f} / {unit:,.4f}"))
    total: float | None = None
    if fleet is not None:
        by = {g.name: g for g in caps}
        reps: dict[str, int] = {}
        for name, n in fleet.items():
            bad = f"--fleet {name}={n:g}: name a GPU of --gpus with a whole count >= 0"
            owned = by[find_kind("--fleet", name, kinds, bad).name]
            if n < 0 or n != int(n):
                raise PlanError(bad)
            reps[owned.name] = int(n) // owned.tp
        total = sum(reps[x] * by[x].rate for x in reps)
        for x, r in reps.items():
            share = reps[x] * by[x].rate / total if total > 0 else 0.0
            lines.append(Line(f"{x}: share of traffic", "n_g rate_g / sum n rate", share,
                              f"{share:.2%}", f"{r:,} replicas x {by[x].rate:,.4f} / "
                              f"{total:,.4f} req/s"))
        lines.append(Line("fleet capacity at the SLO", "sum n_g rate_g", total,
                          f"{total:,.2f} req/s = {total / unit:,.2f} units",
                          " + ".join(f"{r} x {by[x].rate:,.4f}" for x, r in reps.items())))
    return Section(f"Capacity units (1 unit = one {ref.name} at the SLO)", tuple(lines),
                   ("routing: send each replica traffic in proportion to its weight (weighted "
                    "round robin, or least-outstanding-requests scaled by weight)",)), total


def _purchase_section(caps: list[GpuCapacity], unit: float, demand: float, util: float,
                      prices: dict[str, float] | None, kinds: list[ReplicaKind]) -> Section:
    need = demand / util
    usable = [g for g in caps if g.rate > 0]
    lines = [Line("capacity to buy", "D / utilization", need,
                  f"{need:,.2f} req/s = {need / unit:,.2f} units",
                  f"{demand:g} req/s / {util:g}; units of {unit:,.4f} req/s")]
    cost: dict[str, float] = {}
    if prices is not None:
        for name, price in prices.items():
            kind = find_kind("--price", name, kinds, f"--price {name}: not one of --gpus").name
            cost[kind] = positive(f"--price {name}", price) * next(
                g.tp for g in caps if g.name == kind)
    for g in usable:
        reps = math.ceil(need / g.rate - 1e-9)
        dollars = f", ${reps * cost[g.name]:,.2f}/h" if g.name in cost else ""
        lines.append(Line(f"{g.name} alone", "ceil(D / (u rate)) x tp", reps * g.tp,
                          f"{reps * g.tp:,} GPUs ({reps:,} replicas){dollars}",
                          f"ceil({need:,.4f} / {g.rate:,.4f}) = {reps:,} replicas x tp {g.tp}"))
    notes: list[str] = []
    priced = [g for g in usable if g.name in cost]
    if priced:
        for g in priced:
            per = cost[g.name] / g.rate
            lines.append(Line(f"{g.name}: $ per req/s-hour", "price x tp / rate", per,
                              f"${per:,.4f}", f"${cost[g.name] / g.tp:g} x {g.tp} / "
                              f"{g.rate:,.4f}"))
        mix, how = cheapest_mix({g.name: g.rate for g in priced}, cost, need)
        total = sum(n * cost[x] for x, n in mix.items())
        shown = " + ".join(f"{n * next(g.tp for g in priced if g.name == x):,} {x}"
                           for x, n in mix.items())
        lines.append(Line("cheapest mix", "lowest $/req/s, remainder on the cheapest cover",
                          total, f"{shown} GPUs, ${total:,.2f}/h", how))
        notes.append("rule: fill with the GPU of lowest $ per req/s while a whole replica is "
                     "used, then cover the remainder with whichever GPU does it cheapest; "
                     "this costs at most one replica of that GPU more than the optimum")
        left = [g.name for g in usable if g.name not in cost]
        if left:
            notes.append(f"no --price for {', '.join(left)}: left out of the mix")
    return Section(f"Purchase plan for {demand:g} req/s at {util:.0%} of capacity", tuple(lines),
                   tuple(notes))


def _workload(args: argparse.Namespace) -> Workload:
    tpot_ms = positive("--slo-tpot-ms", args.slo_tpot_ms)
    ttft_ms = positive("--slo-ttft-ms", args.slo_ttft_ms)
    steps = math.floor(ttft_ms / tpot_ms + 1e-9) - 1
    if steps < 1:
        raise PlanError(f"--slo-ttft-ms {ttft_ms:g} must be at least 2 x --slo-tpot-ms "
                        f"({2 * tpot_ms:g}): a prompt waits for the step in flight, then takes "
                        f"at least one step of up to the TPOT target")
    return Workload(parse_tokens(args.prompt_tokens), parse_tokens(args.new_tokens),
                    tpot_ms / 1e3, ttft_ms / 1e3, steps)


def build(args: argparse.Namespace) -> Sheet:
    w = _workload(args)
    if not 0 < args.memory_utilization <= 1:
        raise PlanError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization:g}")
    util = positive("--utilization", args.utilization)
    if util > 1:
        open_fraction("--utilization", util)
    entry = resolve_model(args.model)
    spec = entry.spec
    weights = [x.strip() for x in (args.weights or entry.native_weights.removeprefix(
        "gguf-file:")).split(",") if x.strip()]
    if not weights:
        raise PlanError("--weights is empty: name a weight format")
    act = entry.dtype if entry.dtype in ("bf16", "f16") else "bf16"
    kv = resolve_kv_dtype(args.kv or "auto", act)
    kinds = replica_kinds(args.gpus, weights)
    ref_name = find_kind("--unit-gpu", args.unit_gpu, kinds).name if args.unit_gpu else kinds[0].name
    caps = [gpu_capacity(k, spec, args, kv, dtype_bytes(act), w) for k in kinds]
    ref = next(g for g in caps if g.name == ref_name)
    sections = [_gpu_section(g, w) for g in caps]
    warnings = tuple(f"{g.name}: cannot meet the SLO ({g.note})" for g in caps if g.rate <= 0)
    title = (f"fitserve plan capacity: {spec.name} ({', '.join(weights)}, KV {kv}), {w.prompt:,} prompt + "
             f"{w.new:,} new tokens, TPOT {w.tpot * 1e3:g} ms, TTFT {w.ttft * 1e3:g} ms")
    rows: dict[str, dict[str, object]] = {
        g.name: {"tp": g.tp, "rate": g.rate, "per_gpu": g.per_gpu, "binding": g.binding,
                 "weights": g.weights, "threads": g.threads} for g in caps}
    data: dict[str, object] = dict(rows)
    if ref.rate <= 0:
        return Sheet(title, tuple(sections), warnings, f"no capacity unit: the unit GPU "
                     f"{ref.name} cannot meet the SLO ({ref.note})", False, data)
    fleet = assignments("--fleet", args.fleet) if args.fleet else None
    usec, fleet_rate = _units_section(caps, ref, fleet, kinds)
    for g in caps:  # NOTE: a replica's routing weight (rate / unit), what --emit-ray-config writes
        rows[g.name]["units"] = g.rate / ref.per_gpu
    sections.append(usec)
    worth = ", ".join(f"{g.name} {g.per_gpu / ref.per_gpu:.2f}" for g in caps)
    verdict = f"1 unit = {ref.per_gpu:,.2f} req/s on one {ref.name}; units per GPU: {worth}"
    ok = True
    if args.demand_rps is not None:
        demand = positive("--demand-rps", args.demand_rps)
        prices = assignments("--price", args.price) if args.price else None
        sections.append(_purchase_section(caps, ref.per_gpu, demand, util, prices, kinds))
        verdict += f"; {demand:g} req/s needs {demand / util / ref.per_gpu:,.1f} units"
        if fleet_rate is not None:
            ok = fleet_rate * util >= demand
            verdict += (f"; the fleet {'serves' if ok else 'does NOT serve'} it "
                        f"({fleet_rate * util:,.1f} req/s at {util:.0%})")
    data["unit_rps"] = ref.per_gpu
    if args.emit_ray_config:
        from fitserve.tools.sheets.ray_config import emit_ray_config

        emit_ray_config(args, caps, ref, fleet, util, kinds)
        verdict += f"; Ray Serve config written to {args.emit_ray_config}"
    return Sheet(title, tuple(sections), warnings, verdict, ok, data)

