"""`fitserve plan layouts MODEL --gpu h100 --nodes 2 --gpus-per-node 8 --microbatches 16`.

TP vs PP vs hybrid on a cluster: intra-node links from the catalog (NVLink), inter-node links
from the flags (default 400 Gb/s InfiniBand per GPU = 50e9 B/s, 5 us a call). Definitions
where the question is silent (also printed as notes):

- the step: one decode step of B = microbatches x --microbatch-tokens sequences at --context.
  Without PP the B tokens run in one forward (a DP replica ceil(B / dp)); with PP as m
  microbatches through p stages (layers split evenly), flushed: step = sum of stage times +
  (m - 1) x the slowest (= (m + p - 1) x stage when equal; bubble (p - 1) / (m + p - 1));
- stage = roofline max(bytes / bandwidth, FLOPs / peak) (weights read once per microbatch)
  + 2 x layers / p all-reduces priced by ``plan.parallel.tp_allreduce`` (the ledger's
  algorithm for the message size) on the link the group spans: a collective runs at its
  slowest link, so a TP group across nodes runs at the inter-node rate, with the inter-node
  latency per call + the send of the activations to the next stage (latency + bytes / rate);
- crossover: the inter-node latency (one value for a cross-node all-reduce call and a pipeline
  send) at which TP-in-node x PP-across-nodes takes as long as TP across all GPUs;
- memory per GPU: weights / p + the B sequences' KV (every layer keeps every token) / p +
  activations of one forward + 1 GiB workspace, within memory x --memory-utilization;
- one slow link: a link of the kind that bounds the layout's collective (an NVLink for a ring
  inside a node, a NIC for one across nodes; the first cross-node send for pure PP) runs at
  --slow-link-factor of its rate: its ring, so its stage, so the pipeline slows.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import resolve_kv_dtype
from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.kv import check_tp
from fitserve.ledger.parallel import ring_allreduce_seconds, tp_allreduce
from fitserve.ledger.units import fmt_bytes, fmt_seconds
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.model_source import resolve_model
from fitserve.tools.planner.report import ENGINE_DEFAULTS, Line, Section
from fitserve.tools.sheets.cluster_model import (
    MAX_NODES,
    Cluster,
    Layout,
    crossover_latency,
    layouts,
    nodes_needed,
    ring_hw,
    slowed,
)
from fitserve.tools.sheets.sheet import Sheet

BENCH_BYTES = 256 << 20  # the all-reduce benchmark's message in the bisection


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="catalog name, config.json or .gguf")
    p.add_argument("--gpu", default="h100", help="catalog accelerator")
    for flag, default, what in (("--nodes", 2, "nodes"), ("--gpus-per-node", 8, "GPUs a node"),
                                ("--microbatches", 16, "m: microbatches per step"),
                                ("--microbatch-tokens", 1, "decode sequences per microbatch"),
                                ("--context", 8192, "tokens each sequence holds")):
        p.add_argument(flag, type=int, default=default, help=what)
    p.add_argument("--inter-node-gbps", type=float, default=400.0,
                   help="inter-node bandwidth per GPU per direction, Gb/s (400 = 50e9 B/s)")
    p.add_argument("--inter-node-latency-us", type=float, default=5.0,
                   help="latency of one cross-node collective call or send, us")
    p.add_argument("--slow-link-factor", type=float, default=0.25,
                   help="the slow link's share of its rate")
    p.add_argument("--weights", default=None, help="weight format (default: the checkpoint's)")
    p.add_argument("--kv", default="auto", help="KV format (auto: the model dtype)")
    p.add_argument("--memory-utilization", type=float,
                   default=ENGINE_DEFAULTS.cache.gpu_memory_utilization)


def _resolve(args: argparse.Namespace) -> Cluster:
    for flag in ("--nodes", "--gpus-per-node", "--microbatches", "--microbatch-tokens",
                 "--context"):
        if (v := getattr(args, flag[2:].replace("-", "_"))) < 1:
            raise PlanError(f"{flag} must be >= 1, got {v}")
    if not 0 < args.inter_node_gbps < math.inf:
        raise PlanError(f"--inter-node-gbps must be > 0 and finite, got {args.inter_node_gbps:g}")
    if not 0 <= args.inter_node_latency_us < math.inf:
        raise PlanError(f"--inter-node-latency-us must be >= 0 and finite, got "
                        f"{args.inter_node_latency_us:g}")
    if not 0 < args.slow_link_factor <= 1:
        raise PlanError(f"--slow-link-factor must be in (0, 1], got {args.slow_link_factor:g}")
    if not 0.0 < args.memory_utilization <= 1.0:
        raise PlanError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization}")
    if args.gpu.strip().lower() == "cpu":
        raise PlanError("--gpu cpu has no interconnect: plan layouts needs a catalog accelerator")
    hw = get_hardware(args.gpu)
    entry = resolve_model(args.model)
    try:
        check_tp(entry.spec, args.gpus_per_node)  # TP within a node is every layout's base
    except PlanError as e:
        raise PlanError(f"--gpus-per-node {args.gpus_per_node}: {e}") from e
    inter = dataclasses.replace(hw, link=f"inter-node {args.inter_node_gbps:g} Gb/s",
                                link_bytes_per_s=args.inter_node_gbps * 1e9 / 8,
                                link_latency_s=args.inter_node_latency_us * 1e-6)
    act = entry.dtype if entry.dtype in ("bf16", "f16") else "bf16"
    weights = args.weights or entry.native_weights.removeprefix("gguf-file:")
    model_weight_bytes(entry.spec, weights)  # an unknown format is bad input, not a no-fit
    return Cluster(entry.spec, hw, inter, args.nodes, args.gpus_per_node, args.microbatches,
                   args.microbatch_tokens, args.context, weights, resolve_kv_dtype(args.kv, act),
                   int(hw.memory_bytes * args.memory_utilization), args.slow_link_factor)


def _collective_section(c: Cluster) -> Section:
    s, g = c.spec, c.gpn
    ar = tp_allreduce(s, c.intra, tp=g, tokens=1, act_dtype_bytes=c.act_bytes)
    step_bytes = c.batch * ar.bytes_per_call
    lines = [
        Line(f"all-reduces per token at TP{g}", "2 x layers (attention out, MLP down)",
             ar.calls_per_step, f"{ar.calls_per_step}",
             f"2 x {s.num_layers} layers = {ar.calls_per_step}"),
        Line("bytes per all-reduce per token", "hidden x act bytes", ar.bytes_per_call,
             f"{ar.bytes_per_call:,} B", f"{s.hidden_size:,} x {c.act_bytes} B"),
        Line(f"sent per GPU per call at TP{g}", "the algorithm's bytes per rank (ring: "
             "2 (t - 1) / t x bytes)", ar.wire_bytes_per_call, f"{ar.wire_bytes_per_call:,.0f} B",
             f"{getattr(ar, 'algorithm', 'ring')} at 1 token: {ar.wire_bytes_per_call:,.0f} B = "
             f"{ar.wire_bytes_per_call / ar.bytes_per_call:g} x {ar.bytes_per_call:,} B"),
        Line(f"one step's message (B = {c.batch} tokens)", "B x hidden x act bytes", step_bytes,
             fmt_bytes(step_bytes), f"{c.m} microbatches x {c.mb_tokens} tokens x "
             f"{ar.bytes_per_call:,} B"),
    ]
    notes = (f"intra-node: {c.intra.link}, {c.intra.link_bytes_per_s:.4g} B/s per direction, "
             f"{c.intra.link_latency_s * 1e6:g} us a call (catalog); inter-node: "
             f"{c.inter.link_bytes_per_s:.4g} B/s per GPU, {c.inter.link_latency_s * 1e6:g} us "
             "(flags; the default 400 Gb/s is one InfiniBand NDR port per GPU)",)
    return Section("Collectives per token", tuple(lines), notes)


def _layout_section(c: Cluster, x: Layout) -> Section:
    over = x.need - x.usable
    lines = [
        Line("memory per GPU", "weights / pp + KV / pp + reserve", x.need,
             f"{fmt_bytes(x.need)} {'fits' if x.fits else 'no'}",
             f"{fmt_bytes(x.weight_bytes)} + {fmt_bytes(x.kv_bytes)} + "
             f"{fmt_bytes(x.reserve_bytes)} = {x.need:,} B of {x.usable:,} B",
             "" if x.fits else f"over by {fmt_bytes(over)}"),
        Line("all-reduces per forward per stage", "2 x layers / pp", x.calls_per_stage,
             f"{x.calls_per_stage:g}", f"2 x {c.spec.num_layers} / {x.pp}" if x.tp > 1
             else "TP1: none"),
        Line("one all-reduce", "plan.parallel.tp_allreduce: the ledger's fastest algorithm",
             x.allreduce_s, fmt_seconds(x.allreduce_s),
             f"{x.algorithm} over {x.tp} ranks of {x.tokens} x {c.spec.hidden_size:,} x "
             f"{c.act_bytes} B, {x.ring.link_latency_s * 1e6:g} us a call, "
             f"{x.ring.link_bytes_per_s:.4g} B/s ({x.ring.link})" if x.tp > 1 else "TP1: none"),
        Line("stage time", "roofline + all-reduces + send", max(x.stages),
             fmt_seconds(max(x.stages)), f"{x.tokens} tokens a forward; slowest of {x.pp} "
             f"(fastest {fmt_seconds(min(x.stages))}: the last stage sends nothing)"
             if x.pp > 1 else f"{x.tokens} tokens a forward"),
    ]
    if x.pp > 1:
        lines.append(Line("pipeline bubble", "(p - 1) / (m + p - 1)", x.bubble,
                          f"{x.bubble:.2%}", f"({x.pp} - 1) / ({x.m} + {x.pp} - 1) = "
                          f"{x.pp - 1}/{x.m + x.pp - 1}"))
    st = x.step()
    lines += [
        Line("step time", "sum of stages + (m - 1) x slowest stage", st, fmt_seconds(st),
             f"{fmt_seconds(sum(x.stages))} + {x.m - 1} x {fmt_seconds(max(x.stages))}"
             if x.pp > 1 else f"one forward of {x.tokens} tokens"),
        Line("tokens per second", "B / step", c.batch / st, f"{c.batch / st:,.1f}",
             f"{c.batch} / {st:.6g} s"),
    ]
    gpus = x.tp * x.pp * x.dp
    where = "within a node" if x.tp <= c.gpn else "across nodes"
    return Section(f"{x.name}: TP{x.tp} {where}, PP{x.pp}, DP{x.dp} on {gpus} GPUs",
                   tuple(lines))


def _choice_section(c: Cluster, fits: list[Layout]) -> Section:
    lines: list[Line] = []
    cross = crossover_latency(c)
    if cross is not None:
        lam, hyb, tpn = cross
        now = c.inter.link_latency_s
        slope_pp = hyb.pp - 1 + hyb.m - 1
        shown = ("PP wins at any latency" if lam <= 0 else "never: PP pays as many latencies"
                 if lam == math.inf else f"{lam * 1e6:,.2f} us")
        lines.append(Line(f"latency where {hyb.name} beats {tpn.name}",
                          "(t_pp(0) - t_tp(0)) / (calls_tp - sends on the pipeline's path)",
                          lam, shown, f"({fmt_seconds(hyb.step())} - {fmt_seconds(tpn.step())})"
                          f" / ({tpn.calls_per_stage:g} calls - ({hyb.pp} - 1 + {hyb.m} - 1) "
                          f"= {slope_pp} sends); at {now * 1e6:g} us "
                          f"{'PP' if lam <= now else 'TP across nodes'} is faster"))
    for x in sorted(fits, key=lambda x: x.step()):
        lines.append(Line(f"{x.name} (fits)", "step time, fastest first", x.step(),
                          fmt_seconds(x.step()), f"{c.batch / x.step():,.1f} tok/s"))
    return Section("Which layout", tuple(lines), (
        "TP across nodes pays the inter-node latency on every all-reduce (2 per layer); PP "
        "across nodes pays it once per stage boundary per microbatch, and the bubble",))


def _precision_section(c: Cluster) -> Section:
    lines = []
    for fmt in dict.fromkeys((c.weights, "bf16", "fp8")):
        k, one = nodes_needed(c, fmt)
        shown = (f"none up to {MAX_NODES}" if k is None else "1 node" if k == 1
                 else f"{k} nodes (TP{c.gpn} x PP{k})")
        lines.append(Line(f"weights {fmt}", f"fewest nodes where TP{c.gpn} (x PP) fits", k,
                          shown, f"one node: {fmt_bytes(one.weight_bytes)} weights + "
                          f"{fmt_bytes(one.kv_bytes)} KV + {fmt_bytes(one.reserve_bytes)} = "
                          f"{fmt_bytes(one.need)} per GPU {'<=' if one.fits else '>'} "
                          f"{fmt_bytes(one.usable)}"))
    return Section(f"Precision that forces the layout ({c.gpn} x {c.intra.name} a node)",
                   tuple(lines), ("a format that fits one node runs a replica per node with no "
                                  "cross-node traffic; one that does not is forced across nodes",))


def _slow_section(c: Cluster, lays: list[Layout]) -> Section:
    f = c.slow
    lines = []
    for x in lays:
        a, b = x.step(), x.step(slow=True)
        how = (f"all-reduce {fmt_seconds(x.allreduce_s)} -> {fmt_seconds(x.slow_allreduce_s)} a "
               f"call (bandwidth term / {f:g}) in one TP group" if x.tp > 1 else
               f"the first cross-node send at {f:g} of its rate")
        lines.append(Line(f"{x.name} step, one slow link", "step at its slowest stage / replica",
                          b, f"{fmt_seconds(b)} (x{b / a:.3f})",
                          f"healthy {fmt_seconds(a)}; {how}"))
    return Section(f"One link at {f:g} of its rate", tuple(lines), (
        "a ring collective moves every chunk over every link, so it runs at its slowest link: "
        f"one NVLink (or NIC) at {f:g} of its rate makes the bandwidth term of every call of "
        f"that ring {1 / f:g}x longer; a pipeline then runs at its slowest stage, a DP step at "
        "its slowest replica",))


def _bisect_section(c: Cluster) -> Section:
    n, rounds = c.n, max(1, math.ceil(math.log2(c.n)))
    lines = []
    size = n
    for r in range(1, rounds + 1):
        half = max(1, size // 2)
        hw = c.intra if half <= c.gpn else ring_hw(c, half)
        # a pair is a 2-rank ring: the same time as a send, latency + bytes / rate
        ok, bad = (ring_allreduce_seconds(BENCH_BYTES, max(2, half), x)
                   for x in (hw, slowed(hw, c.slow)))
        what = (f"ring all-reduce of {fmt_bytes(BENCH_BYTES)} on each half of {half} GPUs"
                if half > 1 else f"send of {fmt_bytes(BENCH_BYTES)} from each GPU to a good peer")
        lines.append(Line(f"round {r}: {size} -> 2 x {half}", "benchmark both halves at once",
                          ok, f"{fmt_seconds(ok)} vs {fmt_seconds(bad)}",
                          f"{what}: healthy {fmt_seconds(ok)}, the half with the slow link "
                          f"{fmt_seconds(bad)} ({hw.link})"))
        size = half
    lines.append(Line("rounds", "ceil(log2 N)", rounds, f"{rounds}",
                      f"ceil(log2 {n}) = {rounds}"))
    return Section("Finding the slow link: bisection", tuple(lines), (
        "1. run the all-reduce benchmark on all N ranks: a bus bandwidth near "
        f"{c.slow:g} x expected means one slow link",
        "2. split the suspect ranks into two halves (node-aligned first) and run the benchmark "
        "on both halves at the same time; the half at the slow rate holds the link",
        "3. recurse into the slow half; if neither half is slow the link joins the halves: "
        "test the cross pairs (rank i of one half with rank i of the other) in one more round",
        "4. at two GPUs a point-to-point test against a known-good peer names the link: "
        "ceil(log2 N) rounds in all"))


def build(args: argparse.Namespace) -> Sheet:
    c = _resolve(args)
    lays, skipped = layouts(c)
    fits = [x for x in lays if x.fits]
    sections = [_collective_section(c), *(_layout_section(c, x) for x in lays),
                _choice_section(c, fits), _precision_section(c), _slow_section(c, lays),
                _bisect_section(c)]
    s = c.spec
    title = (f"{s.name or s.architecture} on {c.nodes} x {c.gpn} {c.intra.name}: weights "
             f"{c.weights}, KV {c.kv}; a decode step of {c.m} x {c.mb_tokens} tokens at "
             f"{c.context:,}")
    warnings = tuple(skipped)
    if not fits:
        low = min(lays, key=lambda x: x.need, default=None)
        least = f": the least is {low.name}, {fmt_bytes(low.need)} of {fmt_bytes(c.usable)}" if (
            low) else ""
        return Sheet(title, tuple(sections), warnings, f"no layout fits {c.n} x "
                     f"{c.intra.name}{least} per GPU; see the precision section", False)
    best = min(fits, key=lambda x: x.step())
    verdict = (f"{best.name}: step {fmt_seconds(best.step())}, "
               f"{c.batch / best.step():,.1f} tok/s; one slow link: "
               f"{fmt_seconds(best.step(slow=True))}")
    cross = crossover_latency(c)
    data: dict[str, object] = {"best": best.name}
    if cross is not None:
        data["crossover_latency_s"] = cross[0]
    return Sheet(title, tuple(sections), warnings, verdict, True, data)
