"""The model, weight, KV, sharing and speculative sections of a plan (memory/speed ones are in
sections_run.py)."""

from __future__ import annotations

from fitserve.ledger.formats import GGML_HELD_TYPES, kv_format
from fitserve.ledger.kv import (
    kv_block_bytes,
    kv_block_scale_bytes,
    kv_bytes_per_token,
    kv_heads_per_rank,
    kv_layer_bytes_per_token,
    kv_replication,
    layer_kinds,
    request_kv,
    sharing_blocks,
)
from fitserve.ledger.kv_groups import request_kv_held
from fitserve.ledger.params import count_params, is_mla
from fitserve.ledger.units import fmt_bytes, fmt_count, fmt_seconds
from fitserve.ledger.weights import (
    WeightBytes,
    engine_format_rule,
    engine_held_tensors,
    engine_plan_weight_bytes,
    engine_runs,
    engine_weight_bytes,
    model_weight_bytes,
    stored_format_rule,
    tensor_mix_bytes,
)
from fitserve.tools.planner.report import Line, Resolved, Section
from fitserve.tools.planner.speculative import (
    Speculation,
    SpeculativeEconomics,
    speculative_economics,
)


def weight_bytes_per_gpu(r: Resolved) -> int:
    """Weights on one GPU: the GGUF file's own bytes, or the ledger's for the format.

    On cpu (fitserve's engine) the bytes the engine holds: ``engine_plan_weight_bytes``, the
    function the engine itself counts its weights with."""
    if r.entry.file_weight_bytes is not None and r.req.weights is None and not r.on_cpu:
        return -(-r.entry.file_weight_bytes // r.req.tp)
    if r.on_cpu and r.engine_weights is not None:
        return engine_plan_weight_bytes(r.entry.spec, r.act_dtype, stored=r.entry.stored_formats,
                                        rule=engine_format_rule(r.engine_weights, r.act_dtype))
    return model_weight_bytes(r.entry.spec, r.weights, tp=r.req.tp, base_dtype=r.base_dtype).total


def model_section(r: Resolved) -> Section:
    s, p = r.entry.spec, count_params(r.entry.spec)
    h, v = s.hidden_size, s.vocab_size
    lines = [
        Line("parameters", "count_params.total", p.total, fmt_count(p.total),
             f"matmul {p.matmul:,} + lookup {p.lookup:,} + other {p.other:,} = {p.total:,}"),
        Line("matmul parameters", "count_params.matmul", p.matmul, fmt_count(p.matmul),
             f"projections, MLP/experts, router, lm_head ({v:,} x {h:,} = {v * h:,}"
             + (", tied: counted here once)" if s.tie_word_embeddings else ")")),
        Line("lookup-only parameters", "count_params.lookup", p.lookup, fmt_count(p.lookup),
             "tied: the embedding IS the lm_head (0 extra)" if s.tie_word_embeddings
             else f"embedding {v:,} x {h:,}"),
        Line("other (norms, biases)", "count_params.other", p.other, fmt_count(p.other)),
    ]
    if s.num_experts:
        lines.append(Line("active matmul per token", "count_params.active_matmul",
                          p.active_matmul, fmt_count(p.active_matmul),
                          f"{s.num_experts_per_token} of {s.num_experts} routed experts"))
    if r.entry.published_params:
        ratio = p.total / r.entry.published_params
        lines.append(Line("published size", "catalog", r.entry.published_params,
                          fmt_count(r.entry.published_params), f"counted / published = {ratio:.4f}"))
    return Section(f"Model {s.name} ({s.architecture})", tuple(lines), (r.entry.source,))


def whole_model_weights(r: Resolved) -> WeightBytes:
    """The weights of the whole model (tp=1), tensor by tensor where the file says each
    tensor's format (a GGUF file's real mix; on cpu what the engine holds of it), else the
    ledger's count of the format or mix ``r.weights``."""
    s, stored = r.entry.spec, r.entry.stored_formats
    if stored is not None and engine_runs(s):
        if r.on_cpu and r.engine_weights is not None:
            rule = engine_format_rule(r.engine_weights, r.act_dtype)
            return tensor_mix_bytes(r.weights, engine_held_tensors(s, r.act_dtype,
                                                                   stored=stored, rule=rule))
        if r.entry.file_weight_bytes is not None and r.req.weights is None:
            return tensor_mix_bytes(r.weights, engine_held_tensors(
                s, r.base_dtype, stored=stored, rule=stored_format_rule(r.base_dtype)))
    return model_weight_bytes(s, r.weights, tp=1, base_dtype=r.base_dtype)


def runs_ggml_kernels(r: Resolved) -> bool:
    """Whether the engine on cpu runs some projection through the ggml block kernels (a
    tensor held as the file's ggml blocks, bf16 activations, the C++ kernels built), as
    ``fitserve.model.ggml_linear.runs_ggml_kernels`` says of the built model: the ledger's
    "output staging" line."""
    from fitserve.ledger.scratch import cpp_kernels_disabled
    from fitserve.ledger.weights import engine_held_formats

    if not (r.on_cpu and r.engine_weights is not None and engine_runs(r.entry.spec)
            and r.act_dtype == "bf16") or cpp_kernels_disabled():
        return False
    held = engine_held_formats(r.entry.spec, r.act_dtype, stored=r.entry.stored_formats,
                               rule=engine_format_rule(r.engine_weights, r.act_dtype))
    return any(f in GGML_HELD_TYPES for f in held)


def prepacked_panel_bytes(r: Resolved) -> int:
    """Of the engine's weights on cpu, the prepacked M > 1 panels (``ledger.weights.panel_bytes``;
    0 with FITSERVE_PREPACK_PANELS=0 or where the engine does not run the model)."""
    if not (r.on_cpu and r.engine_weights is not None and engine_runs(r.entry.spec)):
        return 0
    rule = engine_format_rule(r.engine_weights, r.act_dtype)
    kw = {"stored": r.entry.stored_formats, "rule": rule}
    return (engine_weight_bytes(r.entry.spec, r.act_dtype, **kw)  # type: ignore[arg-type]
            - engine_weight_bytes(r.entry.spec, r.act_dtype, panels=False, **kw))  # type: ignore[arg-type]


def _more_than_whole(r: Resolved, per_gpu: int, whole: int) -> str:
    """Why one GPU holds more than the whole model ("" when it does not)."""
    if per_gpu <= whole:
        return ""
    why = (f"; MORE than the whole model ({per_gpu:,} > {whole:,} B): ")
    panels = prepacked_panel_bytes(r)
    if panels and per_gpu - panels <= whole:
        return why + (f"{panels:,} B of it are the packed projections laid out again for the "
                      f"M > 1 kernels (FITSERVE_PREPACK_PANELS=0: one copy)")
    if r.on_cpu and not engine_runs(r.entry.spec):
        return why + (f"fitserve's engine cannot run {r.entry.spec.architecture}, so its "
                      f"--weights rule does not apply: this line is the whole model in "
                      f"{r.act_dtype}, the line above the ledger's {r.weights} count")
    if r.req.tp > 1:
        return why + "tensors replicated on every rank"
    return why + ("the engine holds tensors the ledger's count of the format keeps smaller "
                  "(see the weights note)")


def weights_section(r: Resolved) -> Section:
    tp = r.req.tp
    per_gpu = weight_bytes_per_gpu(r)
    wb = whole_model_weights(r)
    fmts = sorted({line.fmt for line in wb.lines})
    lines = [
        Line("format", "formats.weight_format", r.weights, r.weights, "per tensor: " + ", ".join(fmts)),
        Line("bits per weight", "weight_bytes x 8 / params", wb.bits_per_weight,
             f"{wb.bits_per_weight:.3f}", f"{wb.total:,} B x 8 / {wb.num_params:,}"),
        Line("weights, whole model", "tensor_mix_bytes (per tensor)" if wb.mix_is_per_tensor
             else "model_weight_bytes(tp=1)", wb.total, fmt_bytes(wb.total)),
        Line("weights per GPU", "gguf file tensor bytes / tp" if r.entry.file_weight_bytes
             is not None and r.req.weights is None and not r.on_cpu
             else "engine_plan_weight_bytes" if r.on_cpu and (
                 r.weights == r.act_dtype or r.engine_weights is not None)
             else f"model_weight_bytes(tp={tp})", per_gpu, fmt_bytes(per_gpu),
             (r.weights_note or "column/row splits divide by tp; norms, routers and MLA "
              "down-projections replicate; KV projections replicate past the KV-head count")
             + _more_than_whole(r, per_gpu, wb.total)),
    ]
    if r.on_cpu and r.entry.file_weight_bytes is not None:
        fb = r.entry.file_weight_bytes
        lines.append(Line("file tensor bytes", "GGUF header: sum of tensor n_bytes", fb,
                          fmt_bytes(fb), "the file as stored (not what the engine holds)"))
    return Section("Weights", tuple(lines))


def sharing_section(r: Resolved) -> Section | None:
    """Blocks and bytes of ``--share`` sequences over one prompt, without and with sharing."""
    q = r.req
    if q.share <= 1:
        return None
    prompt = q.prompt_tokens if q.prompt_tokens is not None else max(0, q.context - q.new_tokens)
    sb = sharing_blocks(prompt, q.new_tokens, q.share, q.block_size)
    block = kv_block_bytes(r.entry.spec, q.block_size, r.kv_dtype, tp=q.tp)
    total = -(-(prompt + q.new_tokens) // q.block_size)
    k, bs = q.share, q.block_size
    lines = [
        Line("blocks, unshared", "sharing_blocks.unshared", sb.unshared, f"{sb.unshared:,}",
             f"{k} x ceil(({prompt} + {q.new_tokens}) / {bs}) = {k} x {total}"),
        Line("blocks, shared", "sharing_blocks.shared", sb.shared, f"{sb.shared:,}",
             f"floor({prompt} / {bs}) = {sb.shared_prompt_blocks} prompt blocks once + {k} x "
             f"{sb.private_blocks_each} private (the partial prompt block copied on write, "
             "then the new tokens)"),
        Line("KV bytes, unshared", "sharing_blocks.unshared x block_bytes", sb.unshared * block,
             fmt_bytes(sb.unshared * block), f"{sb.unshared:,} x {block:,} B (per GPU, tp={q.tp})"),
        Line("KV bytes, shared", "sharing_blocks.shared x block_bytes", sb.shared * block,
             fmt_bytes(sb.shared * block), f"{sb.shared:,} x {block:,} B (per GPU, tp={q.tp}); "
             "exact for n samples, an upper bound for beams"),
        Line("blocks, beam floor", "sharing_blocks.beam_floor", sb.beam_floor,
             f"{sb.beam_floor:,}", f"floor(({prompt} + {q.new_tokens} - 1) / {bs}) blocks of "
             f"the common history once + {k} x the rest (beams that all descend from one beam "
             "share every token but their last)"),
        Line("KV bytes, beam floor", "sharing_blocks.beam_floor x block_bytes",
             sb.beam_floor * block, fmt_bytes(sb.beam_floor * block),
             f"{sb.beam_floor:,} x {block:,} B (per GPU, tp={q.tp})"),
    ]
    saved = 1 - sb.shared / sb.unshared if sb.unshared else 0.0
    return Section(f"KV sharing: {k} sequences over one {prompt:,}-token prompt, "
                   f"{q.new_tokens:,} new tokens each", tuple(lines),
                   (f"sharing saves {saved:.1%} of the blocks; every block of a sequence is "
                    "held (no window trimming), as fitserve's engine does",
                    "beams: the engine holds between the beam floor and the shared figure (beams "
                    "that forked earlier keep private copies of their history since the fork)"))


def speculative_section(r: Resolved) -> Section | None:
    """``--speculative k,alpha,draft_cost``: tokens per verification, its cost, the speedup
    at each batch size and the batch where speculation stops paying (roofline floors)."""
    if r.req.speculative is None:
        return None
    k, alpha, cost = r.req.speculative
    wb = model_weight_bytes(r.entry.spec, r.weights, tp=r.req.tp, base_dtype=r.base_dtype)
    ec = speculative_economics(r.entry.spec, r.hw, wb, Speculation(k, alpha, cost),
                               context=r.req.context, kv_dtype=r.kv_dtype, weights_fmt=r.weights)
    t1 = ec.points[0].t_decode
    e_how = (f"alpha = 1: all {k} drafts kept, + 1 = {k + 1}" if alpha == 1 else
             f"(1 - {alpha:g}^{k + 1}) / (1 - {alpha:g}) = {ec.expected_tokens:.4f}")
    lines = [
        Line("expected tokens per step", "expected_tokens_per_step", ec.expected_tokens,
             f"{ec.expected_tokens:.4f}", e_how),
        Line("draft cost per verification", "k x draft_cost", ec.draft_cost_per_verify,
             f"{ec.draft_cost_per_verify:.4g} decode steps",
             f"{k} draft steps x {cost:g} of a target decode step (batch {ec.points[0].batch}: "
             f"{fmt_seconds(ec.draft_cost_per_verify * t1)})"),
        Line("verification extra FLOPs per token", "(k + 1) / expected_tokens - 1",
             ec.extra_flops_fraction, f"+{ec.extra_flops_fraction:.1%} "
             f"({fmt_count(ec.extra_flops_per_token)} FLOPs)",
             f"({k} + 1) / {ec.expected_tokens:.4f} - 1 = {ec.extra_flops_fraction:.4f} x "
             f"flops_per_token({ec.context}) {ec.flops_per_token:,} = "
             f"{ec.extra_flops_per_token:,.0f} FLOPs (the draft's own not counted)"),
        *_speedup_lines(ec),
        Line("stops paying from batch", "crossover_batch", ec.crossover_batch,
             f"never (up to {ec.max_batch:,})" if ec.crossover_batch is None
             else f"{ec.crossover_batch:,}", "smallest batch with speedup < 1"),
    ]
    notes = ["the crossover is where verification turns the step compute-bound: it computes "
             f"{k} + 1 positions per sequence for one read of the weights, which is free while "
             "the step is memory-bound and costs (k + 1)x once FLOPs set it; KV reads, once per "
             "sequence either way, keep long contexts memory-bound",
             f"roofline floors at context {ec.context:,}, per TP group of {r.req.tp}: each draft "
             "token accepted independently with probability alpha; the draft model's weights "
             "and KV are not in the memory lines"]
    if ec.pays_again_at is not None:
        notes.append(f"MoE: it pays again at batch {ec.pays_again_at}: {k} + 1 positions per "
                     "sequence touch more experts than one until the batch touches them all")
    return Section(f"Speculative decoding: k={k}, alpha={alpha:g}, draft cost {cost:g}",
                   tuple(lines), tuple(notes))


def _speedup_lines(ec: SpeculativeEconomics) -> list[Line]:
    e, kc = ec.expected_tokens, ec.draft_cost_per_verify
    return [Line(f"speedup, batch {p.batch}", "speculative_speedup", p.speedup,
                 f"x{p.speedup:.3f}",
                 f"{e:.4f} x {fmt_seconds(p.t_decode)} decode / ({fmt_seconds(p.t_verify)} "
                 f"verify, {p.verify_bound}-bound + {kc:g} x {fmt_seconds(p.t_decode)} draft)")
            for p in ec.points]


def kv_section(r: Resolved) -> Section:
    s, tp, kv, ctx = r.entry.spec, r.req.tp, r.kv_dtype, r.req.context
    f = kv_format(kv)
    layer = kv_layer_bytes_per_token(s, kv, tp=tp)
    if is_mla(s):
        how = (f"MLA latent: ({s.kv_lora_rank} + {s.qk_rope_head_dim}) x {f.element_bytes} B"
               f" + {f.scale_bytes_per_head} B scale = {layer} B, replicated on each of {tp} ranks")
    else:
        hr = kv_heads_per_rank(s, tp)
        how = (f"2 x ceil({s.num_kv_heads}/{tp})={hr} heads x ({s.head_dim} x {f.element_bytes} B"
               f" + {f.scale_bytes_per_head} B scale) = {layer} B")
        if f.key_scales == "channel":
            how = (f"ceil({s.num_kv_heads}/{tp})={hr} heads x (2 x {s.head_dim} x "
                   f"{f.element_bytes} B + {f.scale_bytes_per_head} B V scale) = {layer} B, plus "
                   f"per block {hr} heads x {s.head_dim} channels x {f.scale_bytes} B K scales "
                   f"per layer ({kv_block_scale_bytes(s, kv, tp=tp)} B a block, all layers)")
    per_tok = kv_bytes_per_token(s, kv, tp=tp)
    unsharded = kv_bytes_per_token(s, kv, tp=1)
    dup = per_tok * tp - unsharded
    req = request_kv(s, ctx, kv, tp=tp)
    kinds = layer_kinds(s)
    lines = [
        Line("KV per token per layer", "kv_layer_bytes_per_token", layer, fmt_bytes(layer), how),
        Line("KV per token, all layers", "kv_bytes_per_token", per_tok, fmt_bytes(per_tok),
             f"{s.num_layers} layers x {layer} B (per GPU, tp={tp})"),
        Line("TP replication", "kv_replication", kv_replication(s, tp),
             f"x{kv_replication(s, tp):g}",
             f"duplicate KV per token across the {tp} GPUs: {per_tok} x {tp} - {unsharded} = "
             f"{dup} B"),
        Line(f"KV per request @ {ctx} tokens", "request_kv.bytes_all_layers",
             req.bytes_all_layers, fmt_bytes(req.bytes_all_layers),
             f"{s.num_layers} layers x {layer} B x {ctx} tokens (per GPU)"),
    ]
    if tp > 1:
        whole = req.bytes_all_layers * tp
        unsharded_req = request_kv(s, ctx, kv, tp=1).bytes_all_layers
        lines.append(Line(f"KV per request @ {ctx} tokens, all {tp} GPUs",
                          "request_kv.bytes_all_layers x tp", whole, fmt_bytes(whole),
                          f"{req.bytes_all_layers:,} B x {tp} GPUs = {whole:,} B = unsharded "
                          f"{unsharded_req:,} B + {whole - unsharded_req:,} B TP replication"))
    notes = [f"KV format {kv}: {f.note}"]
    if req.sliding_layers:
        lines.append(Line("KV per request, windows reclaimed", "request_kv.bytes_reclaimed",
                          req.bytes_reclaimed, fmt_bytes(req.bytes_reclaimed),
                          f"{req.full_layers} full x {ctx} + {req.sliding_layers} sliding x "
                          f"min({ctx}, {req.window}) tokens x {layer} B; saving "
                          f"{req.window_saving:.1%} = ({req.sliding_layers}/{s.num_layers}) x "
                          f"(1 - {min(ctx, req.window or ctx)}/{ctx})"))
        blocks, held = request_kv_held(s, ctx, r.req.block_size, kv, tp=tp)
        lines.append(Line("KV per request, as the engine holds it", "request_kv_held", held,
                          fmt_bytes(held),
                          f"blocks of {r.req.block_size} per layer group (full first): "
                          f"{', '.join(map(str, blocks))}; a windowed group keeps the blocks its "
                          "window reads and frees the rest as the request moves on"))
        notes.append(f"{kinds.count('sliding')} of {len(kinds)} layers use a {req.window}-token "
                     "window: the engine gives them a pool of their own and frees their blocks "
                     "behind the window (fitserve.kv.group)")
    return Section("KV cache", tuple(lines), tuple(notes))
