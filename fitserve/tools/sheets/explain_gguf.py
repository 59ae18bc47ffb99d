"""`plan explain llamacpp-vs-vllm` and `plan explain q4km-cost`: bandwidth arithmetic of one
user vs many, and what a Q4_K_M file spends per weight.

One user: a decode step reads every weight once per token, so

    tokens/s <= bandwidth / weight bytes            (a 4.9-bit file beats bf16 by 16 / 4.9)

Many users: a batch of b shares that one read, the step turns compute-bound past the ridge
batch, and what limits the batch is KV memory: a contiguous slot reserves its whole context,
a paged cache (vLLM) holds the blocks each sequence has filled.

Q4_K_M (llama.cpp) is a mix over ggml super-blocks of 256 weights:

    Q4_K: d, dmin (2 x f16) + 12 B of 6-bit scales/mins + 128 B of nibbles = 144 B = 4.5 bits
    Q6_K: 128 B low bits + 64 B high bits + 16 B int8 scales + f16 d      = 210 B = 6.5625 bits

Q6_K for lm_head and for attn_v / ffn_down in the layers llama.cpp's use_more_bits picks
(``plan.weights.MIXES``); the average is the model's bytes x 8 / parameters.
"""

from __future__ import annotations

import argparse

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import WEIGHT_FORMATS, weight_format
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.kv import kv_bytes_per_token
from fitserve.ledger.params import tensors
from fitserve.ledger.speed import compute_bound_batch, decode_step
from fitserve.ledger.units import fmt_bytes
from fitserve.ledger.weights import MIXES, WeightBytes, model_weight_bytes, use_more_bits
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.sheets.dequant_cost import dequant_lines, issue_rate, kernel_step
from fitserve.tools.sheets.explain_common import (
    hardware,
    line,
    model,
    model_name,
    opt_int,
    opt_str,
    opt_tokens,
    pct,
)
from fitserve.tools.sheets.sheet import Sheet

LLAMACPP_FLAGS = ("gpu", "model", "weights", "batch", "context", "max_context", "block_size")
Q4KM_FLAGS = ("gpu", "model", "weights")
MAX_CONTEXT = 8192  # NOTE: a common llama-server -c per slot; --max-context changes it
# ggml super-block layouts, field by field (bytes); each must add up to the formats table's
# block (``plan.formats.WEIGHT_FORMATS``), which the sheet checks.
BLOCK_FIELDS: dict[str, tuple[tuple[str, int], ...]] = {
    "Q4_K": (("d, dmin (2 x f16)", 4), ("6-bit scales + mins", 12), ("4-bit codes", 128)),
    "Q5_K": (("d, dmin (2 x f16)", 4), ("6-bit scales + mins", 12), ("high bits", 32),
             ("4-bit low codes", 128)),
    "Q6_K": (("low 4 bits", 128), ("high 2 bits", 64), ("int8 scales", 16), ("d (f16)", 2)),
}


# -- llamacpp-vs-vllm ------------------------------------------------------------------------

def build_llamacpp(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    entry = model(args)
    spec = entry.spec
    qfmt = opt_str(args, "weights", "Q4_K_M")
    batch = opt_int(args, "batch", 256)
    ctx = opt_tokens(args, "context", 1024)
    max_ctx = opt_tokens(args, "max_context", MAX_CONTEXT)
    block = opt_int(args, "block_size", 16)
    ref, quant = model_weight_bytes(spec, "bf16"), model_weight_bytes(spec, qfmt)
    one = _one_user(spec, hw, ref, quant, ctx)
    many, agg, x = _many_users(spec, hw, ref, quant, ctx, batch)
    kv, fits = _kv_section(spec, hw, ref, ctx, max_ctx, block, batch)
    warnings = [f"HYPOTHETICAL: {wb.mix} weights ({fmt_bytes(wb.total)}) exceed one "
                f"{hw.name} ({fmt_bytes(hw.memory_bytes)}): its lines need tensor parallelism"
                for wb in (ref, quant) if wb.total > hw.memory_bytes]
    if fits < batch:
        warnings.append(f"a paged bf16 cache holds {fits:,} sequences of {ctx:,} tokens, not "
                        f"--batch {batch:,}: the batch-{batch} lines assume more memory")
    t1 = decode_step(spec, hw, quant, batch=1, context=ctx, kv_dtype="bf16", weights_fmt=qfmt)
    verdict = (f"{model_name(entry)} on {hw.name}: one user {t1.tokens_per_s:,.0f} tok/s from "
               f"a {qfmt} file; {batch} users share each weight read: {agg:,.0f} tok/s in bf16 "
               f"(x{agg / t1.tokens_per_s:,.1f}); at batch {batch} the {qfmt} file runs "
               f"x{x:.3f} bf16's speed" + (", it no longer pays" if x < 1.05 else ""))
    return Sheet(f"llama.cpp vs vLLM: {model_name(entry)} on {hw.name}", (one, many, kv),
                 tuple(warnings), verdict,
                 data={"batch1_tok_s_quant": t1.tokens_per_s, "batch_tok_s_bf16": agg,
                       "batch_speedup_quant": x})


def _one_user(spec: ModelSpec, hw: Hardware, ref: WeightBytes, quant: WeightBytes,
              ctx: int) -> Section:
    bw = hw.mem_bytes_per_s
    lines: list[Line] = []
    for wb in (ref, quant):
        lines.append(line(f"{wb.mix} weights", f"model_weight_bytes({wb.mix})", wb.total,
                          fmt_bytes(wb.total), f"{wb.total:,} B = {wb.bits_per_weight:.4g} "
                                               f"bits/weight"))
    for wb in (ref, quant):
        lines.append(line(f"{wb.mix} batch-1 ceiling, weights only", "bandwidth / weight bytes",
                          bw / wb.total, f"{bw / wb.total:,.1f} tok/s",
                          f"{bw:.4g} / {wb.total:,} = {bw / wb.total:.2f}"))
    lines.append(line(f"{quant.mix} / bf16 at batch 1", "bf16 bytes / quantized bytes",
                      ref.total / quant.total, f"x{ref.total / quant.total:.2f}",
                      f"{ref.total:,} / {quant.total:,} = {ref.total / quant.total:.3f}"))
    for wb in (ref, quant):
        st = decode_step(spec, hw, wb, batch=1, context=ctx, kv_dtype="bf16",
                         weights_fmt=wb.mix)
        lines.append(line(f"{wb.mix} batch 1 at {ctx:,} tokens (KV too)", "decode_step(1)",
                          st.tokens_per_s, f"{st.tokens_per_s:,.1f} tok/s", st.describe()))
    return Section(f"One user: each token reads all weights ({hw.name}, "
                   f"{bw / 1e12:.3g} TB/s)", tuple(lines))


def _many_users(spec: ModelSpec, hw: Hardware, ref: WeightBytes, quant: WeightBytes, ctx: int,
                batch: int) -> tuple[Section, float, float]:
    lines: list[Line] = []
    agg = 0.0
    ridge = hw.bf16_flops / hw.mem_bytes_per_s
    for wb in (ref, quant):
        b = ridge * wb.bits_per_weight / 16
        lines.append(line(f"{wb.mix} GEMMs compute-bound from batch", "ridge x (bits / 8) / 2",
                          b, f"{b:,.1f}", f"{hw.bf16_flops:.4g} / {hw.mem_bytes_per_s:.4g} = "
                                          f"{ridge:.2f} FLOP/B; x {wb.bits_per_weight:.4g} / 16 "
                                          f"= {b:.2f} (weights only)"))
    for wb in (ref, quant):
        cb = compute_bound_batch(spec, hw, wb, context=ctx, kv_dtype="bf16", weights_fmt="bf16")
        lines.append(line(f"{wb.mix} step compute-bound from batch (KV too)",
                          "compute_bound_batch", cb,
                          f"{cb:,}" if cb else "never (KV reads dominate)",
                          f"smallest b with b x F / {hw.bf16_flops:.4g} >= (W + b x KV) / "
                          f"{hw.mem_bytes_per_s:.4g} at {ctx:,} tokens"))
    lines += dequant_lines(hw, quant, 0.05)
    issue = issue_rate(hw)
    steps = []
    for wb in (ref, quant):
        t_lin, t_att, t_comm = kernel_step(spec, hw, wb, batch=batch, context=ctx, issue=issue)
        step = t_lin + t_att + t_comm
        steps.append(step)
        tok = batch / step
        agg = agg or tok
        lines.append(line(f"{wb.mix} at batch {batch:,}",
                          "kernel by kernel: linear layers + attention + all-reduces", tok,
                          f"{tok:,.0f} tok/s ({tok / batch:,.1f} per user)",
                          f"GEMMs {t_lin * 1e3:.3f} ms (max(weights / bandwidth, b x matmul "
                          f"FLOPs / peak + dequant)) + attention {t_att * 1e3:.3f} ms (KV "
                          f"reads) + {t_comm * 1e3:.3f} ms = {step * 1e3:.3f} ms"))
    x = steps[0] / steps[1]
    lines.append(line(f"{quant.mix} / bf16 at batch {batch:,}", "t_bf16 / t_quant", x,
                      f"x{x:.3f}" + (" (stops paying: < x1.05)" if x < 1.05 else ""),
                      f"{steps[0] * 1e3:.3f} / {steps[1] * 1e3:.3f} ms"))
    notes: tuple[str, ...] = ("past the GEMMs' compute-bound batch a smaller file saves nothing there (both run "
             "at the bf16 peak) and its dequant instructions cost extra; the KV reads of long "
             "contexts are their own kernels, the same in either format",)
    if issue is None:
        notes += (f"no SM data for {hw.name}: dequant cost left out (plan explain "
                  "int4-dequant lists the accelerators it knows)",)
    return Section(f"Many users: batch {batch:,} shares each weight read", tuple(lines),
                   notes), agg, x


def _kv_section(spec: ModelSpec, hw: Hardware, ref: WeightBytes, ctx: int, max_ctx: int,
                block: int, batch: int) -> tuple[Section, int]:
    per_tok = kv_bytes_per_token(spec, "bf16")
    free = max(0, hw.memory_bytes - ref.total)
    slot = per_tok * max_ctx
    blocks = -(-ctx // block)
    paged = per_tok * blocks * block
    n_slot, n_paged = free // slot, free // paged
    lines = (
        line("KV per token (bf16, all layers)", "kv_bytes_per_token", per_tok, fmt_bytes(per_tok),
             f"{per_tok:,} B"),
        line("memory left for KV", "device memory - bf16 weights", free, fmt_bytes(free),
             f"{hw.memory_bytes:,} - {ref.total:,} = {free:,} B (activations left out)"),
        line(f"contiguous slots of {max_ctx:,} tokens", "free // (KV/token x max context)",
             n_slot, f"{n_slot:,} sequences", f"{free:,} // ({per_tok:,} x {max_ctx:,}) = "
                                                f"{n_slot:,}: each slot reserves its maximum"),
        line(f"paged blocks, {ctx:,} tokens each", "free // (KV/token x blocks x block size)",
             n_paged, f"{n_paged:,} sequences",
             f"{free:,} // ({per_tok:,} x {blocks} x {block}) = {n_paged:,}"),
        line("paged / contiguous", "sequences paged / contiguous",
             n_paged / n_slot if n_slot else None,
             f"x{n_paged / n_slot:.1f}" if n_slot else "contiguous fits none",
             f"{n_paged:,} / {n_slot:,}"),
    )
    return Section(f"KV memory for {batch:,} users: contiguous slots vs paged blocks", lines,
                   ("a llama.cpp server reserves each slot's share of its context up front; "
                    "vLLM allocates 16-token blocks as sequences grow and batches continuously",
                    )), n_paged


# -- q4km-cost -------------------------------------------------------------------------------

def _block_lines(fmts: list[str]) -> list[Line]:
    out = []
    for name in fmts:
        f = WEIGHT_FORMATS[name]
        nbytes = f.block_bits // 8
        fields = BLOCK_FIELDS.get(name)
        if fields is not None and sum(b for _, b in fields) != nbytes:
            raise AssertionError(f"{name}: fields add to {sum(b for _, b in fields)}, "
                                 f"table says {nbytes}")
        parts = " + ".join(f"{b} B {what}" for what, b in fields) if fields else f.note
        out.append(line(f"{name} bits per weight", "block bytes x 8 / block weights",
                        f.bits_per_weight, f"{f.bits_per_weight:g}",
                        f"{parts} = {nbytes} B per {f.block_elements}: {nbytes} x 8 / "
                        f"{f.block_elements} = {f.bits_per_weight:g}"))
    return out


def build_q4km(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    entry = model(args)
    spec = entry.spec
    mix_name = opt_str(args, "weights", "Q4_K_M")
    mix = MIXES.get(mix_name) or MIXES.get(mix_name.upper())
    if mix is None or not weight_format(mix.default).gguf:
        gguf = [k for k, m in MIXES.items() if weight_format(m.default).gguf]
        raise PlanError(f"--weights {mix_name}: q4km-cost prices a llama.cpp mix; known: "
                        f"{', '.join(gguf)}")
    wb = model_weight_bytes(spec, mix.name)
    fmts = list(dict.fromkeys([mix.default, *(r.fmt for r in mix.rules)]))
    blocks = Section("ggml super-blocks (plan.formats)", tuple(_block_lines(fmts)))
    n = spec.num_layers
    more = sum(use_more_bits(i, n) for i in range(n))
    lines: list[Line] = [line("layers use_more_bits picks", "i < n/8, i >= 7n/8, (i - n/8) % 3 == 2",
                              more, f"{more} of {n}", f"n = {n}: n/8 = {n // 8}; "
                                                      f"{more} layers get the rule's format")]
    kinds = {t.name: t.kind for t in tensors(spec)}
    for tb in wb.lines:
        if kinds[tb.name] == "other":
            continue  # norms and biases: in the total, not worth a line each
        bits = 8 * tb.bytes / _elements(spec, tb.name, tb.copies)
        lines.append(line(f"{tb.name} in {tb.fmt}", "weight_bytes per copy x copies", tb.bytes,
                          f"{fmt_bytes(tb.bytes)} ({bits:.4g} b/w)",
                          f"{tb.copies} copies: {tb.bytes:,} B"))
    bf16 = model_weight_bytes(spec, "bf16").total
    lines += _totals(wb, bf16, hw)
    dq = dequant_lines(hw, wb, 0.05)
    warnings = _row_warnings(spec)
    stop = dq[-1].value if dq else None
    verdict = (f"{model_name(entry)} as {mix.name}: {wb.bits_per_weight:.4g} bits/weight on "
               f"average, {fmt_bytes(wb.total)} ({wb.total:,} B), x{bf16 / wb.total:.2f} "
               f"smaller than bf16" + (f"; its GEMMs stop paying against bf16 from batch {stop} "
                                       f"on {hw.name} (dequant included)" if dq else ""))
    sections: tuple[Section, ...] = (blocks, Section(f"{mix.name} on {model_name(entry)} ({mix.source})",
                                tuple(lines)))
    if dq:
        sections += (Section(f"Dequant cost on {hw.name}: where the smaller file stops paying",
                             tuple(dq), ("the batch depends on the accelerator's ridge and the "
                                         "dequant count per weight, not on the model",)),)
    return Sheet(f"What {mix.name} costs per weight: {model_name(entry)}", sections, warnings,
                 verdict, data={"bits_per_weight": wb.bits_per_weight, "bytes": wb.total,
                                "gemm_stops_paying_at": stop})


def _elements(spec: ModelSpec, name: str, copies: int) -> int:
    t = next(t for t in tensors(spec) if t.name == name)
    return t.elements * copies


def _totals(wb: WeightBytes, bf16: int, hw: Hardware) -> list[Line]:
    q6 = sum(tb.bytes for tb in wb.lines if tb.fmt == "Q6_K")
    bw = hw.mem_bytes_per_s
    return [
        line("file weight bytes", "sum over tensors", wb.total, fmt_bytes(wb.total),
             f"{wb.total:,} B"),
        line("average bits per weight", "bytes x 8 / parameters", wb.bits_per_weight,
             f"{wb.bits_per_weight:.4g}", f"{wb.total:,} x 8 / {wb.num_params:,} = "
                                          f"{wb.bits_per_weight:.4f}"),
        line("share of bytes in Q6_K", "Q6_K bytes / all bytes", q6 / wb.total, pct(q6 / wb.total),
             f"{q6:,} / {wb.total:,}"),
        line("vs bf16", "bf16 bytes / mix bytes", bf16 / wb.total, f"x{bf16 / wb.total:.3f}",
             f"{bf16:,} / {wb.total:,} = {bf16 / wb.total:.3f}"),
        line(f"batch-1 decode ceiling on {hw.name}", "bandwidth / bytes", bw / wb.total,
             f"{bw / wb.total:,.1f} tok/s", f"{bw:.4g} / {wb.total:,} = {bw / wb.total:.2f}"),
    ]


def _row_warnings(spec: ModelSpec) -> tuple[str, ...]:
    odd = {t.name: t.cols for t in tensors(spec) if t.kind != "other" and t.cols % 256}
    if not odd:
        return ()
    what = ", ".join(f"{name} ({cols})" for name, cols in sorted(odd.items()))
    return (f"row lengths not multiples of 256: {what}; llama.cpp falls back to another type "
            f"for such tensors, the ledger counts whole super-blocks over each tensor",)
