"""`fitserve plan offload MODEL --gpu G --what weights|embeddings|kv`: moving part of a model's
bytes to host memory, and what crossing the host link costs each decode step.

What crosses the link per decode step of B sequences (one GPU, tp=1):

    weights     N offloaded decoder layers x layer bytes, once per step, shared by the batch
                (per token: N x layer bytes / B; MoE layers whole: a prefetch precedes routing)
    embeddings  the looked-up rows only: B x hidden x bytes per element (untied; a tied table
                is also the lm_head, which reads all of it every step: N/A to offload cheaply)
    kv          each sequence's offloaded layers' KV at its context:
                B x N x KV bytes per layer per token x context

    t_link = transfers x link latency + bytes / link bandwidth
    t_gpu  = decode_step(B, context): the roofline step with every byte in HBM

Overlap rule: a prefetched transfer (weights, KV: layer i + 1 copies while layer i computes,
into two layer-sized staging buffers in HBM) hides behind the step: t_step = max(t_gpu, t_link);
without prefetch (--no-prefetch, one staging buffer) t_step = t_gpu + t_link. Embedding rows
are known only once the previous step has sampled its token: never overlapped. HBM freed =
host bytes - staging buffers.

When it pays: the best tok/s at --context is reached at the KV ceiling (B / step grows with B);
offload pays when that is higher with it than without, B1 / t_step(B1) > B0 / t_gpu(B0) (the
memory it frees buys more sequences than the link costs), or when nothing fits without it
(B0 = 0 < B1). A workload that fits only with it but runs slower is a "does not pay": holding
B0 sequences and queueing the rest yields more tokens per second.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from fitserve.ledger.errors import PlanError
from fitserve.ledger.kv import kv_layer_bytes_per_token
from fitserve.ledger.memory import EngineMemoryPlan
from fitserve.ledger.speed import MAX_BATCH, decode_step, smallest_batch
from fitserve.ledger.units import fmt_bytes, fmt_seconds, parse_tokens
from fitserve.ledger.weights import WeightBytes, model_weight_bytes
from fitserve.tools.planner.fit import memory_plan
from fitserve.tools.planner.report import Line, PlanRequest, Resolved, Section, resolve
from fitserve.tools.sheets.sheet import Sheet

WHATS = ("weights", "embeddings", "kv")
# NOTE: PCIe Gen5 x16: 32 GT/s x 16 lanes x 128/130 encoding = 63 GB/s per direction, ~64 in
# round figures (Gen4 x16 is half; NVLink-C2C of a GH200 is 450 GB/s: pass --host-link-gbs).
HOST_LINK_GBS = 64.0
HOST_LINK_LATENCY_US = 10.0  # NOTE: an assumption: a DMA copy's launch and completion
NOT_LAYER = ("embedding", "lm_head", "final_norm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="catalog name, a config.json (or its folder), or a .gguf file")
    p.add_argument("--gpu", default="h100", help="accelerator from the catalog")
    p.add_argument("--what", required=True, help="weights, embeddings or kv")
    p.add_argument("--host-link-gbs", type=float, default=HOST_LINK_GBS,
                   help=f"GPU <-> host GB/s per direction (default {HOST_LINK_GBS:g}: PCIe "
                        f"Gen5 x16)")
    p.add_argument("--host-link-latency-us", type=float, default=HOST_LINK_LATENCY_US,
                   help=f"latency per transfer (assumption, default {HOST_LINK_LATENCY_US:g})")
    p.add_argument("--tokens-per-s", type=float, default=None,
                   help="decode rate to size the link for (default: the rate offload allows)")
    p.add_argument("--layers-offloaded", type=int, default=None,
                   help="decoder layers whose weights / KV live on the host (default: the "
                        "fewest that fit the workload, else the most that hide behind a step)")
    p.add_argument("--fraction", type=float, default=None,
                   help="share of the layers offloaded instead: ceil(fraction x layers)")
    p.add_argument("--context", default="8k", help="tokens per sequence; 8k = 8,192")
    p.add_argument("--concurrency", type=int, default=1, help="sequences per decode step")
    p.add_argument("--weights", default=None, help="weight format (default: the checkpoint's)")
    p.add_argument("--kv", default=None, help="KV format (default: the model dtype)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="transfers do not overlap the step (one staging buffer)")


@dataclass(frozen=True)
class Query:
    what: str
    link_bw: float  # B/s per direction
    latency: float  # s per transfer
    context: int
    batch: int
    prefetch: bool
    layers: int | None  # asked (None: default rule)
    rate: float | None


@dataclass(frozen=True)
class Offload:
    """One offload choice at batch ``batch``: bytes in host memory, HBM buffers, link traffic."""

    what: str
    layers: int  # decoder layers offloaded (0 for embeddings)
    batch: int
    unit_bytes: float  # one transfer's bytes per step: a layer's weights / B x a layer's KV
    host_bytes: float
    staging_bytes: float
    step_bytes: float  # crossing the link per step, whole batch
    transfers: int
    overlapped: bool
    tied: bool = False  # embeddings tied to the lm_head

    @property
    def freed(self) -> float:
        return self.host_bytes - self.staging_bytes


def _check(args: argparse.Namespace) -> Query:
    what = args.what.strip().lower()
    if what not in WHATS:
        raise PlanError(f"--what {args.what!r} is not one of {', '.join(WHATS)}")
    if not 0 < args.host_link_gbs < math.inf:
        raise PlanError(f"--host-link-gbs must be > 0 and finite, got {args.host_link_gbs:g}")
    if not 0 <= args.host_link_latency_us < math.inf:
        raise PlanError(f"--host-link-latency-us must be >= 0, got {args.host_link_latency_us:g}")
    if args.tokens_per_s is not None and not 0 < args.tokens_per_s < math.inf:
        raise PlanError(f"--tokens-per-s must be > 0 and finite, got {args.tokens_per_s:g}")
    if args.concurrency < 1:
        raise PlanError(f"--concurrency must be >= 1, got {args.concurrency}")
    both, given = (args.layers_offloaded, args.fraction), "--layers-offloaded or --fraction"
    if None not in both:
        raise PlanError(f"give {given}, not both")
    if what == "embeddings" and both != (None, None):
        raise PlanError(f"{given} apply to --what weights or kv: embedding offload moves the "
                        "whole table")
    if args.fraction is not None and not 0 < args.fraction <= 1:
        raise PlanError(f"--fraction must be in (0, 1], got {args.fraction:g}")
    try:
        context = parse_tokens(args.context)
    except PlanError as e:
        raise PlanError(f"--context: {e}") from None
    return Query(what, args.host_link_gbs * 1e9, args.host_link_latency_us * 1e-6, context,
                 args.concurrency, not args.no_prefetch, args.layers_offloaded, args.tokens_per_s)


def layer_weight_bytes(wb: WeightBytes, num_layers: int) -> float:
    """Bytes of one (average) decoder layer: all weights but embedding, lm_head, final norm."""
    return sum(t.bytes for t in wb.lines if t.name not in NOT_LAYER) / num_layers


def make_offload(r: Resolved, wb: WeightBytes, q: Query, layers: int, batch: int) -> Offload:
    s = r.entry.spec
    buffers = min(layers, 2 if q.prefetch else 1)
    if q.what in ("weights", "kv"):  # a layer's weights, or a layer's KV of the whole batch
        unit = (layer_weight_bytes(wb, s.num_layers) if q.what == "weights"
                else batch * kv_layer_bytes_per_token(s, r.kv_dtype) * q.context)
        return Offload(q.what, layers, batch, unit, layers * unit, buffers * unit,
                       layers * unit, layers, q.prefetch)
    table = next((t.bytes for t in wb.lines if t.name == "embedding"), None)
    if table is None:  # tied: the table is the lm_head too, read whole by every step
        lm = next(t.bytes for t in wb.lines if t.name == "lm_head")
        return Offload("embeddings", 0, batch, lm, lm, lm, lm, 1, q.prefetch, tied=True)
    rows = batch * table / s.vocab_size
    return Offload("embeddings", 0, batch, rows, table, rows, rows, 1, False)


def link_seconds(o: Offload, q: Query) -> float:
    return o.transfers * q.latency + o.step_bytes / q.link_bw


def gpu_seconds(r: Resolved, wb: WeightBytes, batch: int, context: int) -> float:
    return decode_step(r.entry.spec, r.hw, wb, batch=batch, context=context,
                       kv_dtype=r.kv_dtype, weights_fmt=r.weights).seconds


def step_seconds(o: Offload, q: Query, t_gpu: float) -> float:
    """The overlap rule: prefetched max(t_gpu, t_link), else t_gpu + t_link."""
    t_link = link_seconds(o, q)
    return max(t_gpu, t_link) if o.overlapped else t_gpu + t_link


def ceiling_with(mp: EngineMemoryPlan, o: Offload, context: int, num_layers: int) -> int:
    """Sequences of ``context`` tokens the KV pool holds with ``o``'s offload (tp=1)."""
    per_seq = -(-context // mp.block_size) * mp.block_bytes
    if o.what == "kv":  # each sequence keeps (L - N) layers on the GPU, + its staging share
        share = (num_layers - o.layers + min(o.layers, 2 if o.overlapped else 1)) / num_layers
        return max(0, int(mp.kv_pool_bytes // (per_seq * share)))
    return max(0, int((mp.kv_pool_bytes + o.freed) // per_seq))


def default_layers(r: Resolved, wb: WeightBytes, q: Query, mp: EngineMemoryPlan,
                   b0: int) -> tuple[int, str]:
    """The fewest layers that fit the workload; if it already fits, the most that hide."""
    n_layers = r.entry.spec.num_layers
    if q.batch > b0:
        for n in range(1, n_layers + 1):
            if ceiling_with(mp, make_offload(r, wb, q, n, q.batch), q.context,
                            n_layers) >= q.batch:
                return n, f"the fewest layers that fit {q.batch} x {q.context:,} tokens"
        return n_layers, "all layers: even so the workload does not fit"
    hid, least = hidden_layers(r, wb, q)[0], (2 if q.prefetch else 1) + 1
    n = min(n_layers, max(hid, least))
    return n, (f"it fits without offload: the {hid} layers that hide behind one step"
               if hid >= least else f"it fits without offload: {n}, one more than the "
                                    f"staging buffers ({hid} would hide behind one step)")


def hidden_layers(r: Resolved, wb: WeightBytes, q: Query) -> tuple[int, float]:
    """Most layers whose prefetched transfer hides behind one step at the asked batch, and
    one layer's transfer time."""
    per = q.latency + make_offload(r, wb, q, 1, q.batch).unit_bytes / q.link_bw
    n = int(gpu_seconds(r, wb, q.batch, q.context) // per) if q.prefetch else 0
    return min(r.entry.spec.num_layers, n), per


def hidden_batches(r: Resolved, wb: WeightBytes, q: Query, layers: int) -> str:
    """Where the offload's link time hides behind the step (t_link <= t_gpu), in words."""
    def hides(b: int) -> bool:
        return link_seconds(make_offload(r, wb, q, layers, b), q) <= gpu_seconds(r, wb, b, q.context)

    if not q.prefetch:
        return "never (no prefetch)"
    if hides(1):
        first_miss = smallest_batch(lambda b: not hides(b), MAX_BATCH)
        return "at every batch" if first_miss is None else f"up to batch {first_miss - 1:,}"
    first = smallest_batch(hides, MAX_BATCH)
    return "never" if first is None else f"from batch {first:,}"


def _rate(batch: int, seconds: float) -> float:
    return batch / seconds if batch and seconds > 0 else 0.0  # tok/s of the whole batch


def moved_section(r: Resolved, o: Offload, mp: EngineMemoryPlan, b1: int, q: Query,
                  note: str) -> Section:
    s = r.entry.spec
    if o.what == "weights":
        what = (f"{o.layers} of {s.num_layers} decoder layers x {o.unit_bytes:,.0f} B "
                f"(weights but embedding, lm_head, final norm / {s.num_layers})")
    elif o.what == "kv":
        what = (f"{o.layers} of {s.num_layers} layers x {o.batch} seqs x "
                f"{kv_layer_bytes_per_token(s, r.kv_dtype):,} B per layer per token x "
                f"{q.context:,} tokens")
    elif o.tied:
        what = "tied: the table is also the lm_head, which every step reads whole"
    else:
        what = f"{s.vocab_size:,} rows x {o.host_bytes / s.vocab_size:,.0f} B (input table)"
    freed_miss = "" if o.freed > 0 else "frees nothing: the staging buffers hold as much"
    pool, seq = mp.kv_pool_bytes, -(-q.context // mp.block_size) * mp.block_bytes
    b0 = max(0, pool // seq)
    lines = (
        Line(f"{o.what} in host memory", "offloaded bytes", o.host_bytes,
             fmt_bytes(o.host_bytes), what),
        Line("staging buffers in HBM", "buffers x transfer bytes", o.staging_bytes,
             fmt_bytes(o.staging_bytes),
             f"{o.staging_bytes / o.unit_bytes:g} x {o.unit_bytes:,.0f} B: " + (
                 "the table, which the lm_head reads whole" if o.tied else
                 "one step's rows" if o.what == "embeddings" else
                 "min(N, 2) layers (prefetch double buffer)" if o.overlapped else
                 "1 layer (no prefetch)")),
        Line("HBM freed", "host bytes - staging", o.freed, fmt_bytes(o.freed),
             f"{o.host_bytes:,.0f} - {o.staging_bytes:,.0f} = {o.freed:,.0f} B", freed_miss),
        Line(f"sequences of {q.context:,} tokens, without -> with", "KV pool ceiling",
             b1, f"{b0:,} -> {b1:,}", f"without: {pool:,} B // {seq:,} B per sequence; with: "
             + (f"({pool:,} + {o.freed:,.0f}) // {seq:,}" if o.what != "kv" else
                f"{pool:,} // ({seq:,} x (L - N + staging) / L = {s.num_layers - o.layers}"
                f" + {o.staging_bytes / o.unit_bytes:g} of {s.num_layers})")),
    )
    return Section(f"Moved to host: {o.what} of {s.name} on {r.hw.name}", lines, (note,))


def link_section(r: Resolved, o: Offload, q: Query, t_gpu: float, t_step: float) -> Section:
    per_token = o.step_bytes / o.batch
    rate = q.rate if q.rate is not None else _rate(o.batch, t_step)
    need = rate * per_token
    t_link = link_seconds(o, q)
    over = f"the link carries at most {q.link_bw / per_token:,.1f} tok/s" if need > q.link_bw else ""
    how = ("given (--tokens-per-s)" if q.rate is not None
           else f"the rate with offload: {o.batch} / {fmt_seconds(t_step)}")
    overlap = ("prefetched: max(t_gpu, t_link)" if o.overlapped else
               "after sampling, before the step: t_gpu + t_link" if o.what == "embeddings"
               else "no prefetch: t_gpu + t_link")
    lines = (
        Line("bytes over the link per step", "per step, whole batch", o.step_bytes,
             fmt_bytes(o.step_bytes), f"{o.transfers} transfer(s), {o.step_bytes:,.0f} B"),
        Line("bytes per token", "step bytes / batch", per_token, fmt_bytes(per_token),
             f"{o.step_bytes:,.0f} / {o.batch} = {per_token:,.1f} B"),
        Line(f"bandwidth at {rate:,.1f} tok/s", "rate x bytes per token", need,
             f"{need / 1e9:,.3f} GB/s ({need / q.link_bw:.1%} of the link)",
             f"{how}: {rate:,.1f} x {per_token:,.1f} B = {need:,.0f} B/s of "
             f"{q.link_bw:,.0f}", over),
        Line("link time per step", "transfers x latency + bytes / link", t_link,
             fmt_seconds(t_link), f"{o.transfers} x {q.latency * 1e6:g} us + "
             f"{o.step_bytes:,.0f} / {q.link_bw:,.0f} B/s = {fmt_seconds(t_link)}"),
        Line(f"GPU step, batch {o.batch} @ {q.context:,}", "decode_step (roofline, all in HBM)",
             t_gpu, fmt_seconds(t_gpu), f"{_rate(o.batch, t_gpu):,.1f} tok/s without offload"),
        Line("step with offload", overlap, t_step, fmt_seconds(t_step),
             f"{_rate(o.batch, t_step):,.1f} tok/s; {overlap.split(': ')[-1]} = "
             f"{fmt_seconds(t_step)}"),
        Line("latency added per step", "step with offload - GPU step", t_step - t_gpu,
             fmt_seconds(t_step - t_gpu), f"{fmt_seconds(t_step)} - {fmt_seconds(t_gpu)}"),
    )
    return Section(f"Host link at {q.link_bw / 1e9:g} GB/s per direction", lines,
                   (f"host link {q.link_bw / 1e9:g} GB/s (default {HOST_LINK_GBS:g}: PCIe Gen5 "
                    f"x16, 32 GT/s x 16 lanes x 128/130 per direction), "
                    f"{q.latency * 1e6:g} us per transfer (assumption)",))


@dataclass(frozen=True)
class Pays:
    pays: bool
    why: str
    b0: int
    b1: int
    t0: float  # tok/s at the ceiling without offload
    t1: float  # tok/s at the ceiling with it


def judge(r: Resolved, wb: WeightBytes, q: Query, o: Offload, b0: int, b1: int) -> Pays:
    """Pays when the best tok/s at --context (the batch up to its KV ceiling: B / step grows
    with B) is higher with the offload than without, or when nothing fits without it."""
    t0 = _rate(b0, gpu_seconds(r, wb, b0, q.context)) if b0 else 0.0
    o1, t_gpu1 = make_offload(r, wb, q, o.layers, b1), gpu_seconds(r, wb, max(1, b1), q.context)
    t1 = _rate(b1, step_seconds(o1, q, t_gpu1)) if b1 else 0.0
    at = f"at the KV ceiling {t1:,.1f} tok/s ({b1} seqs) with it vs {t0:,.1f} ({b0}) without"
    only = f"{q.batch} x {q.context:,} tokens fit only with it, but " if b0 < q.batch <= b1 else ""
    pays, why = (
        (False, "it frees no HBM: its staging buffers hold as much as it moves") if o.freed <= 0
        else (False, f"not one sequence of {q.context:,} tokens fits even with it") if b1 == 0
        else (True, f"nothing fits on one {r.hw.name} without it; with it {b1} seqs run at "
                    f"{t1:,.1f} tok/s") if b0 == 0
        else (True, f"the memory it frees buys more than the link costs: {at}") if t1 > t0
        else (False, f"{only}the link costs more than the memory buys: {at}"))
    return Pays(pays, why, b0, b1, t0, t1)


def pays_section(r: Resolved, wb: WeightBytes, q: Query, o: Offload, p: Pays) -> Section:
    lines = [
        Line(f"throughput at the ceiling without ({p.b0} seqs)", "B0 / t_gpu(B0)", p.t0,
             f"{p.t0:,.1f} tok/s", "0: not one sequence fits" if not p.b0 else
             f"{p.b0} / {fmt_seconds(gpu_seconds(r, wb, p.b0, q.context))}"),
        Line(f"throughput at the ceiling with ({p.b1} seqs)", "B1 / t_step(B1)", p.t1,
             f"{p.t1:,.1f} tok/s", "0: nothing fits" if not p.b1 else
             f"{p.b1} / {fmt_seconds(p.b1 / p.t1) if p.t1 else '-'}"),
    ]
    yes = [(f"{q.batch} <= {b}: yes" if q.batch <= b else f"{q.batch} > {b}: no")
           for b in (p.b0, p.b1)]
    fits = " / ".join(y.split(": ")[1] for y in yes)
    lines.append(Line(f"{q.batch} x {q.context:,} tokens fit, without / with", "B <= ceiling",
                      fits, fits, " / ".join(yes)))
    if o.what != "embeddings":
        hb = hidden_batches(r, wb, q, o.layers)
        lines.append(Line("link time hidden behind the step", "t_link(B) <= t_gpu(B)", hb, hb,
                          f"prefetched transfers cost nothing while the GPU step is longer "
                          f"(KV ceiling with offload: {p.b1})"))
        h, per = hidden_layers(r, wb, q)
        lines.append(Line(f"layers that hide at batch {q.batch}", "floor(t_gpu / t_link(1 layer))",
                          h, f"{h}", f"floor({fmt_seconds(gpu_seconds(r, wb, q.batch, q.context))}"
                          f" / {fmt_seconds(per)}), capped at {r.entry.spec.num_layers}"
                          + ("" if q.prefetch else "; 0: no prefetch")))
    lines.append(Line("pays", "more tok/s at the KV ceiling, or nothing fits without",
                      p.pays, "yes" if p.pays else "NO", p.why, "" if p.pays else p.why))
    return Section("When it pays", tuple(lines),
                   ("ceilings count KV blocks only (the engine's --max-num-seqs is a knob); "
                    "sliding-window layers are counted at full context, as allocated",))


def build(args: argparse.Namespace) -> Sheet:
    q = _check(args)
    if args.gpu.strip().lower() == "cpu":
        raise PlanError("--gpu cpu: offload moves bytes from GPU memory to host memory; "
                        "pick a catalog GPU")
    r = resolve(PlanRequest(args.model, gpu=args.gpu, context=q.context,
                            context_text=args.context, weights=args.weights, kv=args.kv,
                            concurrency=q.batch))
    s = r.entry.spec
    wb = model_weight_bytes(s, r.weights, base_dtype=r.base_dtype)
    mp = memory_plan(r)
    b0 = max(0, mp.num_kv_blocks // -(-q.context // mp.block_size))
    if q.what == "embeddings":
        layers, note = 0, "the input embedding table moves whole; the lm_head stays"
    elif q.layers is not None:
        if not 1 <= q.layers <= s.num_layers:
            raise PlanError(f"--layers-offloaded must be in 1..{s.num_layers}, got {q.layers}")
        layers, note = q.layers, "--layers-offloaded"
    elif args.fraction is not None:
        layers = math.ceil(args.fraction * s.num_layers)
        note = f"--fraction: ceil({args.fraction:g} x {s.num_layers}) = {layers}"
    else:
        layers, note = default_layers(r, wb, q, mp, b0)
    o = make_offload(r, wb, q, layers, q.batch)
    b1 = ceiling_with(mp, o, q.context, s.num_layers)
    t_gpu = gpu_seconds(r, wb, q.batch, q.context)
    t_step = step_seconds(o, q, t_gpu)
    verdict_p = judge(r, wb, q, o, b0, b1)
    sections = (moved_section(r, o, mp, b1, q, f"layers offloaded: {note}"),
                link_section(r, o, q, t_gpu, t_step), pays_section(r, wb, q, o, verdict_p))
    head = (f"offloading {o.what}" + (f" ({layers} layer{'s' * (layers > 1)})" if layers else "")
            + f" of {s.name} to host over {q.link_bw / 1e9:g} GB/s")
    verdict = f"{head} {'pays' if verdict_p.pays else 'does not pay'}: {verdict_p.why}"
    data: dict[str, object] = {
        "layers": layers, "host_bytes": o.host_bytes, "freed_bytes": o.freed,
        "step_bytes": o.step_bytes, "bytes_per_token": o.step_bytes / o.batch,
        "t_gpu_s": t_gpu, "t_link_s": link_seconds(o, q), "t_step_s": t_step,
        "ceiling_without": b0, "ceiling_with": b1, "pays": verdict_p.pays}
    title = (f"fitserve plan offload: {o.what} of {s.name} on {r.hw.name}, weights "
             f"{r.weights}, KV {r.kv_dtype}, {q.batch} x {q.context:,} tokens")
    return Sheet(title, sections, r.warnings, verdict, verdict_p.pays, data)
