"""`fitserve plan longctx MODEL --context 1m --gpu h100 --gpus 8`: one very long request.

What it answers, line by line, from the model's config and the accelerator's sheet:

- KV of the request (``kv.request_kv``: GQA heads or the MLA latent, sliding layers capped at
  their window), one copy, on a TP group, and per GPU under context parallelism;
- the attention share of the prefill FLOPs (``flops.prefill_flops``);
- a layout that holds it: every split gpus = TP x CP, and the chosen one;
- the ring (``context_parallel.ring_step``): the KV block each GPU passes per step and
  whether its transfer hides behind one step's attention; causal balance, contiguous vs zigzag;
- which single change to the model or the input breaks the layout, and what replaces it.

Definitions where the question is silent (also printed as notes):

- one request spans all --gpus: gpus = tp x cp (no data parallelism);
- the chosen layout is the fitting split with the smallest TP (CP takes the rest); --tp fixes it;
- per GPU: the TP shard of the weights (CP replicates them) + the KV of its ceil(N / cp)
  tokens on its TP rank + activations of one --chunk of prefill tokens + 1 GiB workspace, within
  memory x --memory-utilization;
- sliding layers keep only their window (an allocator that reclaims, as vLLM's hybrid manager
  does; ``--windows all-layers`` plans fitserve's engine, which keeps every layer's tokens);
- a ring step runs per full-attention layer over the catalog link (all --gpus on one NVLink
  domain); the compute that hides it is one off-diagonal zigzag step: shard^2 / 2 causal pairs
  at the attention peak (fp8 peak for an fp8 KV, else bf16); sliding layers only need the
  previous rank's last window of tokens, once, and are left out of the ring;
- "breaks": the chosen layout no longer fits; the first breaking change is the one with the
  smallest KV growth; replacements are tried in order: another TP x CP split of the same GPUs,
  fp8 KV on the chosen split, then twice, four times ... the GPUs (a larger CP degree), first
  with the same KV format, then with fp8 KV.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.flops import (
    attention_crossover_context,
    attention_flops_per_position,
    prefill_flops,
)
from fitserve.ledger.formats import kv_format, resolve_kv_dtype
from fitserve.ledger.hardware import Hardware, get_hardware
from fitserve.ledger.kv import check_tp, kv_bytes_per_token, kv_layer_bytes_per_token, request_kv
from fitserve.ledger.memory import DEFAULT_GPU_WORKSPACE_BYTES
from fitserve.ledger.params import count_params, is_mla
from fitserve.ledger.units import fmt_bytes, fmt_seconds, parse_tokens
from fitserve.tools.planner.model_source import ModelEntry, resolve_model
from fitserve.tools.planner.report import ENGINE_DEFAULTS, Line, Section
from fitserve.tools.sheets.context_parallel import (
    CPLayout,
    CPQuery,
    choose_layout,
    contiguous_shards,
    cp_layout,
    cp_layouts,
    first_fit,
    imbalance,
    max_context,
    rank_work,
    replacements,
    ring_step,
    single_changes,
    zigzag_shards,
)
from fitserve.tools.sheets.sheet import Sheet


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="catalog name, config.json or .gguf")
    p.add_argument("--context", default="1m", help="tokens of the request (k, m = x1024)")
    p.add_argument("--gpu", default="h100", help="catalog accelerator")
    p.add_argument("--gpus", type=int, default=8, help="GPUs the request spans (= tp x cp)")
    p.add_argument("--tp", type=int, default=None, help="fix the TP degree (default: smallest fit)")
    p.add_argument("--kv", default="auto", help="KV format: bf16, fp8, int8 ... (auto: model dtype)")
    p.add_argument("--weights", default=None, help="weight format (default: the checkpoint's)")
    p.add_argument("--memory-utilization", type=float,
                   default=ENGINE_DEFAULTS.cache.gpu_memory_utilization)
    p.add_argument("--chunk", type=int, default=ENGINE_DEFAULTS.scheduler.max_num_batched_tokens,
                   help="prefill tokens per GPU per step (the activation reserve)")
    p.add_argument("--windows", choices=("reclaimed", "all-layers"), default="reclaimed",
                   help="sliding layers keep their window only, or every token")


@dataclass(frozen=True)
class _Inputs:
    entry: ModelEntry
    hw: Hardware
    gpus: int
    tp: int | None
    q: CPQuery
    warnings: tuple[str, ...]

    @property
    def spec(self) -> ModelSpec:
        return self.entry.spec


def _resolve(args: argparse.Namespace) -> _Inputs:
    try:
        context = parse_tokens(args.context)
    except PlanError as e:
        raise PlanError(f"--context: {e}") from e
    if args.gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {args.gpus}")
    if args.tp is not None and (args.tp < 1 or args.gpus % args.tp):
        raise PlanError(f"--gpus {args.gpus} is not a multiple of --tp {args.tp} (gpus = tp x cp)")
    if not 0.0 < args.memory_utilization <= 1.0:
        raise PlanError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization}")
    if args.chunk < 1:
        raise PlanError(f"--chunk must be >= 1 token, got {args.chunk}")
    if args.gpu.strip().lower() == "cpu":
        raise PlanError("--gpu cpu has no interconnect: plan longctx needs a catalog accelerator")
    hw = get_hardware(args.gpu)
    entry = resolve_model(args.model)
    if args.tp is not None:
        check_tp(entry.spec, args.tp)
    act = entry.dtype if entry.dtype in ("bf16", "f16") else "bf16"
    q = CPQuery(context, args.weights or entry.native_weights.removeprefix("gguf-file:"),
                resolve_kv_dtype(args.kv, act), int(hw.memory_bytes * args.memory_utilization),
                2, args.chunk, DEFAULT_GPU_WORKSPACE_BYTES, args.windows == "reclaimed")
    warnings = []
    trained = entry.spec.max_position_embeddings
    if context > trained:
        warnings.append(f"HYPOTHETICAL: {context:,} tokens is {context / trained:.3g}x the "
                        f"model's trained maximum of {trained:,}: bytes and FLOPs hold, "
                        "output quality past it is unknown")
    return _Inputs(entry, hw, args.gpus, args.tp, q, tuple(warnings))


def _kv_how(spec: ModelSpec, kv: str, tp: int) -> str:
    f, b = kv_format(kv), kv_layer_bytes_per_token(spec, kv, tp=tp)
    if is_mla(spec):
        return (f"MLA latent ({spec.kv_lora_rank} + {spec.qk_rope_head_dim}) x {f.element_bytes}"
                f" B + {f.scale_bytes_per_head} B scale = {b:,} B, shared by all heads")
    heads = -(-spec.num_kv_heads // tp)
    return (f"ceil({spec.num_kv_heads} KV heads / tp {tp}) = {heads} x (2 x {spec.head_dim} x "
            f"{f.element_bytes} B + {f.key_token_scale_bytes + f.scale_bytes_per_head} B "
            f"scales) = {b:,} B")


def _kv_section(inp: _Inputs, lay: CPLayout) -> Section:
    s, q, ctx, tp = inp.spec, inp.q, inp.q.context, lay.tp
    one = request_kv(s, ctx, q.kv_dtype, tp=1)
    rank = request_kv(s, ctx, q.kv_dtype, tp=tp)
    pick = "bytes_reclaimed" if q.reclaim_windows else "bytes_all_layers"
    one_b, rank_b = getattr(one, pick), getattr(rank, pick)
    lt1 = kv_layer_bytes_per_token(s, q.kv_dtype)
    tok = kv_bytes_per_token(s, q.kv_dtype)
    lines = [
        Line("KV per token per layer", "kv_layer_bytes_per_token(tp=1)", lt1, fmt_bytes(lt1),
             _kv_how(s, q.kv_dtype, 1)),
        Line("KV per token, all layers", "kv_bytes_per_token(tp=1)", tok, fmt_bytes(tok),
             f"{s.num_layers} layers x {lt1:,} B = {tok:,} B"),
        Line(f"KV per request @ {ctx:,}, one copy", "request_kv(tp=1).bytes_all_layers",
             one.bytes_all_layers, fmt_bytes(one.bytes_all_layers),
             f"{s.num_layers} layers x {lt1:,} B x {ctx:,} tokens = {one.bytes_all_layers:,} B"),
    ]
    if one.sliding_layers:
        lines.append(Line("KV per request, windows reclaimed", "request_kv(tp=1).bytes_reclaimed",
                          one.bytes_reclaimed, fmt_bytes(one.bytes_reclaimed),
                          f"({one.full_layers} full x {ctx:,} + {one.sliding_layers} sliding x "
                          f"min({ctx:,}, {one.window:,})) tokens x {lt1:,} B = "
                          f"{one.bytes_reclaimed:,} B (saves {one.window_saving:.1%})"))
    lines += [
        Line(f"KV per request on the TP{tp} group", f"request_kv(tp={tp}).{pick} x tp",
             rank_b * tp, fmt_bytes(rank_b * tp),
             f"{rank_b:,} B per rank x {tp} = {rank_b * tp:,} B = one copy {one_b:,} B + "
             f"{rank_b * tp - one_b:,} B replicated"),
        Line(f"KV per GPU, TP{tp} alone", f"request_kv(tp={tp}).{pick}", rank_b,
             fmt_bytes(rank_b), f"all {ctx:,} tokens on each rank: {_kv_how(s, q.kv_dtype, tp)}"
             f" a layer"),
        Line(f"KV per GPU, {lay.name}", f"request_kv(ceil(N/cp), tp={tp}).{pick}", lay.kv_bytes,
             fmt_bytes(lay.kv_bytes), f"ceil({ctx:,} / {lay.cp}) = {lay.shard_tokens:,} tokens "
             f"on each GPU = {lay.kv_bytes:,} B"),
    ]
    return Section("KV of the request", tuple(lines), (f"KV format {q.kv_dtype}: "
                                                        f"{kv_format(q.kv_dtype).note}",))


def _flops_section(inp: _Inputs) -> Section:
    s, ctx, hw = inp.spec, inp.q.context, inp.hw
    pf = prefill_flops(s, ctx)
    f_pos = attention_flops_per_position(s)
    t = pf.matmul / (inp.gpus * hw.peak_flops(inp.q.weights_fmt)) + pf.attention / (
        inp.gpus * hw.peak_flops(inp.q.kv_dtype))
    cross = attention_crossover_context(s)
    lm_head = s.vocab_size * s.hidden_size
    body = count_params(s).active_matmul - lm_head
    lines = [
        Line("prefill matmul FLOPs", "2 x (matmul params - lm_head) x N + 2 x lm_head",
             pf.matmul, f"{pf.matmul:.4g}", f"2 x {body:,} x {ctx:,} + 2 x {lm_head:,} = "
             f"{pf.matmul:,}"),
        Line("prefill attention FLOPs", "per-position FLOPs x causal positions", pf.attention,
             f"{pf.attention:.4g}", f"{f_pos:,} FLOPs a position (2 x {s.num_heads} heads x "
             f"(d_qk + d_v)) x sum over layers of sum_i min(i, window) for i <= {ctx:,}"),
        Line("attention share of prefill", "attention / (matmul + attention)",
             pf.attention_share, f"{pf.attention_share:.1%}",
             f"{pf.attention:,} / {pf.total:,} = {pf.attention_share:.4f}"),
        Line("context where attention >= matmul", "attention_crossover_context",
             cross, "never (windows cap it)" if cross is None else f"{cross:,}",
             "per decoded token: attention FLOPs at c >= 2 x active matmul params"),
        Line(f"prefill at peak on {inp.gpus} GPUs", "matmul / (g x P_w) + attention / (g x P_kv)",
             t, fmt_seconds(t), f"{pf.matmul:.4g} / ({inp.gpus} x "
             f"{hw.peak_flops(inp.q.weights_fmt):.4g}) + {pf.attention:.4g} / ({inp.gpus} x "
             f"{hw.peak_flops(inp.q.kv_dtype):.4g}) = {t:.4g} s (a floor)"),
    ]
    return Section(f"Prefill FLOPs @ {ctx:,} tokens", tuple(lines))


def _need_explain(x: CPLayout) -> str:
    return (f"weights {fmt_bytes(x.weight_bytes)} + KV {fmt_bytes(x.kv_bytes)} + reserve "
            f"{fmt_bytes(x.reserve_bytes)} = {x.need_bytes:,} B of {x.usable_bytes:,} B usable")


def _layout_line(x: CPLayout, mark: str = "") -> Line:
    over = x.need_bytes - x.usable_bytes
    return Line(f"{x.name}{mark}", "weights(tp) + request_kv(N/cp, tp) + reserve per GPU",
                x.need_bytes, f"{fmt_bytes(x.need_bytes)} {'fits' if x.fits else 'no'}",
                _need_explain(x), "" if x.fits else f"over by {fmt_bytes(over)}")


def _layouts_section(inp: _Inputs, layouts: tuple[CPLayout, ...], lay: CPLayout) -> Section:
    lines = [_layout_line(x, " (chosen)" if x == lay else "") for x in layouts]
    if lay not in layouts:
        lines.append(_layout_line(lay, " (chosen)"))
    mc = max_context(inp.spec, inp.q, lay)
    lines.append(Line(f"longest request on {lay.name}", "max N: request_kv(N/cp, tp) <= free",
                      mc, "unbounded (windows cap the KV)" if mc is None else f"{mc:,} tokens",
                      f"free = {lay.usable_bytes:,} - {lay.weight_bytes:,}"
                      f" - {lay.reserve_bytes:,} B; bisection over the ledger's KV bytes"))
    notes = (f"one request on {inp.gpus} x {inp.hw.name} ({fmt_bytes(lay.usable_bytes)} usable "
             "each): gpus = tp x cp; the smallest TP that fits is chosen, CP takes the rest",
             "per GPU: the TP shard of the weights (every CP rank holds one), the KV of its "
             "ceil(N / cp) tokens, activations of one --chunk and 1 GiB workspace",
             "sliding layers keep only their window (a reclaiming allocator)" if
             inp.q.reclaim_windows else "every layer keeps every token (--windows all-layers)")
    return Section("Layouts: TP x CP on the GPUs", tuple(lines), notes)


def _ring_section(inp: _Inputs, tp: int, cp: int, label: str) -> Section:
    s, hw, ctx = inp.spec, inp.hw, inp.q.context
    r = ring_step(s, hw, context=ctx, cp=cp, tp=tp, kv_dtype=inp.q.kv_dtype)
    f_pos = attention_flops_per_position(s)
    tp_bytes = 2 * 2 * (inp.gpus - 1) / inp.gpus * ctx * s.hidden_size * inp.q.act_dtype_bytes
    cp_bytes = (cp - 1) * r.block_bytes
    lines = [
        Line("ring steps per layer", "cp - 1", cp - 1, f"{cp - 1}",
             f"{cp} - 1 (the first block is the GPU's own)"),
        Line("KV block sent per step per GPU", "ceil(N / cp) x KV per token per layer (TP rank)",
             r.block_bytes, fmt_bytes(r.block_bytes),
             f"{r.shard_tokens:,} tokens x {r.bytes_per_token:,} B = {r.block_bytes:,} B"),
        Line("transfer per step", "link latency + block / link bandwidth", r.transfer_s,
             fmt_seconds(r.transfer_s), f"{hw.link_latency_s * 1e6:g} us + {r.block_bytes:,} B"
             f" / {hw.link_bytes_per_s:.4g} B/s ({hw.link}) = {r.transfer_s:.4g} s"),
        Line("attention per step", "shard^2 / 2 pairs x FLOPs per position / tp / peak",
             r.compute_s, fmt_seconds(r.compute_s),
             f"{r.pairs:,} pairs x {f_pos:,} / {tp} = {r.flops:.4g} FLOPs / {r.peak_flops:.4g}"
             f" = {r.compute_s:.4g} s"),
        Line("compute / transfer", "attention per step / transfer per step", r.ratio,
             f"{r.ratio:.1f}x {'hides' if r.hides else 'EXPOSED'}",
             f"{r.compute_s:.4g} / {r.transfer_s:.4g} = {r.ratio:.4g}",
             "" if r.hides else "the ring's transfer is longer than the attention it overlaps"),
        Line("smallest shard that hides", "root of (n^2/2) F / (tp P) = latency + n b / B",
             r.min_hiding_shard, f"{r.min_hiding_shard:,} tokens",
             f"F = {f_pos:,}, tp = {tp}, P = {r.peak_flops:.4g}, b = {r.bytes_per_token:,} B, "
             f"B = {hw.link_bytes_per_s:.4g} B/s, latency {hw.link_latency_s:g} s"),
        Line("largest CP that still hides", "floor(N / smallest shard)",
             ctx // r.min_hiding_shard, f"{ctx // r.min_hiding_shard:,}",
             f"{ctx:,} // {r.min_hiding_shard:,}"),
        Line("ring bytes per GPU per layer", "(cp - 1) x block", cp_bytes, fmt_bytes(cp_bytes),
             f"{cp - 1} x {r.block_bytes:,} B"),
        Line(f"vs TP{inp.gpus} all-reduces per GPU per layer",
             "2 all-reduces x 2 (g - 1) / g x N x hidden x act bytes", tp_bytes,
             fmt_bytes(tp_bytes), f"2 x 2 x {inp.gpus - 1}/{inp.gpus} x {ctx:,} x "
             f"{s.hidden_size:,} x {inp.q.act_dtype_bytes} B = {tp_bytes:,.0f} B"),
    ]
    notes = (f"ring attention over {r.full_layers} full-attention layers on {hw.link}; a step "
             "sends the KV block the GPU holds to the next GPU while computing on it; the "
             "compute is one off-diagonal zigzag step (half a shard x shard block)",
             "sliding layers need only the previous rank's last window of tokens, once: not "
             "in the ring" if r.full_layers else "the model has no full-attention layer: "
             "no ring is needed, the lines above are for a full layer", f"attention at the {'fp8' if r.peak_flops != hw.bf16_flops else 'bf16'}"
             " peak for a " + inp.q.kv_dtype + " KV cache")
    return Section(f"Context-parallel ring: {label}", tuple(lines), notes)


def _balance_section(inp: _Inputs, tp: int, cp: int) -> Section:
    ctx, s, hw = inp.q.context, inp.spec, inp.hw
    cont, zig = rank_work(contiguous_shards(ctx, cp)), rank_work(zigzag_shards(ctx, cp))
    rc, rz = imbalance(cont), imbalance(zig)
    n = ctx // cp
    scale = attention_flops_per_position(s) * ring_step(
        s, hw, context=ctx, cp=cp, tp=tp, kv_dtype=inp.q.kv_dtype).full_layers / (
        tp * hw.peak_flops(inp.q.kv_dtype))
    tc, tz = max(cont) * scale, max(zig) * scale
    lines = [
        Line("contiguous split: max / mean work", "((2c - 1) n + 1) / (c n + 1)", float(rc),
             f"{float(rc):.4f}", f"rank {cp - 1}: {max(cont):,} causal pairs / mean "
             f"{sum(cont) / cp:,.1f} (n = {n:,}: ((2 x {cp} - 1) x {n:,} + 1) / ({cp} x {n:,} + 1)"
             f"); as n grows (2c - 1) / c = {2 * cp - 1}/{cp} = {(2 * cp - 1) / cp:.4f}"),
        Line("zigzag split: max / mean work", "chunks i and 2c - 1 - i of 2c", float(rz),
             f"{float(rz):.4f}", f"{2 * cp} chunks of ~{ctx // (2 * cp):,} tokens; each rank "
             f"(2c - 1) m^2 + m (m + 1) pairs: max {max(zig):,} / mean {sum(zig) / cp:,.1f}"),
        Line("slowest rank's attention, contiguous", "max pairs x F x full layers / tp / peak",
             tc, fmt_seconds(tc), f"{max(cont):,} x {scale:.4g} s a pair"),
        Line("slowest rank's attention, zigzag", "max pairs x F x full layers / tp / peak",
             tz, fmt_seconds(tz), f"{max(zig):,} x {scale:.4g} s a pair; saves "
             f"{1 - tz / tc:.1%}" if tc else ""),
    ]
    return Section(f"Causal balance over CP{cp}", tuple(lines),
                   ("work = causal (query, key) pairs a rank computes, counted exactly; the "
                    "slowest rank sets the step",))


def _option_line(how: str, x: CPLayout | None) -> Line:
    if x is None:
        return Line(f"try: {how}", "cp_layouts", None, "none fits", "no split fits")
    return Line(f"try: {how}", "weights(tp) + request_kv(N/cp, tp) + reserve per GPU",
                x.need_bytes, f"{x.name}: {fmt_bytes(x.need_bytes)} "
                f"{'fits' if x.fits else 'no'}",
                f"{x.gpus} GPUs; " + _need_explain(x))


def _whatif_section(inp: _Inputs, lay: CPLayout) -> tuple[Section, str]:
    lines, breaking, notes = [], [], []
    for name, spec, q in single_changes(inp.spec, inp.q):
        try:
            x = cp_layout(spec, q, tp=lay.tp, cp=lay.cp)
        except PlanError as e:
            notes.append(f"{name}: not evaluated ({e})")
            continue
        growth = x.kv_bytes / lay.kv_bytes if lay.kv_bytes else 1.0
        lines.append(Line(name, "the chosen layout's need with this one change", x.need_bytes,
                          f"{fmt_bytes(x.need_bytes)} {'fits' if x.fits else 'BREAKS'}",
                          f"KV per GPU x{growth:.3f}: {fmt_bytes(lay.kv_bytes)} -> "
                          f"{fmt_bytes(x.kv_bytes)}; " + _need_explain(x)))
        if not x.fits:
            breaking.append((growth, name, spec, q))
    if not breaking:
        first = "none of these single changes breaks it"
        lines.append(Line("first change that breaks it", "smallest KV growth that no longer fits",
                          None, "none", first))
        return Section(f"What breaks {lay.name}", tuple(lines), tuple(notes)), first
    growth, name, spec, q = min(breaking, key=lambda b: b[0])
    options = replacements(spec, q, inp.gpus, lay)
    repl = first_fit(options, inp.gpus)
    lines += [Line("first change that breaks it", "smallest KV growth that no longer fits",
                   name, name, f"KV per GPU x{growth:.3f}"),
              *(_option_line(how, x) for how, x in options),
              Line("what replaces the layout", "the first option that fits", repl, repl,
                   f"under '{name}'")]
    notes.append("replacements tried in order: fp8 KV on the chosen split, another TP x CP "
                 "split of the same GPUs, then 2x, 4x ... the GPUs (a larger CP degree; same "
                 "KV format, then fp8)")
    return Section(f"What breaks {lay.name}", tuple(lines), tuple(notes)), (
        f"{name} breaks it; replace with {repl}")


def build(args: argparse.Namespace) -> Sheet:
    inp = _resolve(args)
    s, q = inp.spec, inp.q
    layouts = cp_layouts(s, q, inp.gpus)
    if inp.tp is not None:
        lay = cp_layout(s, q, tp=inp.tp, cp=inp.gpus // inp.tp)
    else:
        best = choose_layout(layouts)
        lay = best or min(layouts, key=lambda x: x.need_bytes)
    sections = [_kv_section(inp, lay), _flops_section(inp), _layouts_section(inp, layouts, lay)]
    if inp.gpus > 1:
        tp, cp = (lay.tp, lay.cp) if lay.cp > 1 else (1, inp.gpus)
        label = lay.name if lay.cp > 1 else f"if run as TP1 x CP{inp.gpus} ({lay.name} has no ring)"
        sections += [_ring_section(inp, tp, cp, label), _balance_section(inp, tp, cp)]
    title = (f"{s.name or s.architecture}: one {q.context:,}-token request on {inp.gpus} x "
             f"{inp.hw.name}, KV {q.kv_dtype}, weights {q.weights_fmt}")
    if not lay.fits:
        repl = first_fit(replacements(s, q, inp.gpus, lay), inp.gpus)
        verdict = (f"does not fit: {lay.name} needs {fmt_bytes(lay.need_bytes)} per GPU of "
                   f"{fmt_bytes(lay.usable_bytes)}; replace with {repl}")
        return Sheet(title, tuple(sections), inp.warnings, verdict, False,
                     {"layout": lay.name, "replacement": repl})
    whatif, first = _whatif_section(inp, lay)
    sections.append(whatif)
    verdict = (f"{lay.name} holds the request: {fmt_bytes(lay.need_bytes)} of "
               f"{fmt_bytes(lay.usable_bytes)} per GPU; {first}")
    return Sheet(title, tuple(sections), inp.warnings, verdict, True,
                 {"layout": lay.name, "tp": lay.tp, "cp": lay.cp, "first_break": first})
