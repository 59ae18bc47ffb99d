"""The step-time section of a plan: the roofline's ``t = a + b*new_tokens + c*seqs +
d*kv_tokens_read`` (the shape the engine fits on this machine for ``--scheduling-policy slo``),
the prompt tokens a step may take beside the decodes within a TPOT target, and the request
rate that target sustains (``fitserve plan ... --slo-tpot-ms T [--new-tokens O]``)."""

from __future__ import annotations

from fitserve.ledger.step_time import predicted_knee, roofline_step_model
from fitserve.ledger.units import fmt_seconds
from fitserve.tools.planner.report import Line, Resolved, Section


def step_time_section(r: Resolved, batch: int) -> Section | None:
    """None unless the plan asks for a TPOT target (``--slo-tpot-ms``)."""
    q = r.req
    if q.slo_tpot_ms is None:
        return None
    s, tpot = r.entry.spec, q.slo_tpot_ms / 1000
    # NOTE: an MoE model's weight read is that of the decode step priced here (batch tokens)
    m = roofline_step_model(s, r.hw, weight_fmt=r.weights, kv_dtype=r.kv_dtype, tp=q.tp,
                            step_tokens=batch)
    ctx = q.context
    kv = batch * ctx
    decode = m.predict(batch, batch, kv)
    cap = m.max_new_tokens(tpot, new_tokens=batch, seqs=batch, kv_tokens_read=kv)
    lines = [
        Line("step-time model", "roofline_step_model", m.describe(), m.describe(),
             f"a = weights / {r.hw.mem_bytes_per_s:.3g} B/s; b = FLOPs per token / "
             f"{r.hw.peak_flops(r.weights):.3g} FLOP/s; c = 0; d = KV bytes per token / bandwidth "
             "(memory and compute added: an upper bound, exact where one dominates)"),
        Line(f"decode step, {batch} seqs @ {ctx:,}", "StepTimeModel.predict", decode,
             fmt_seconds(decode), f"a + b x {batch} + c x {batch} + d x {kv:,}"),
        Line(f"prompt tokens per step beside {batch} decodes", "StepTimeModel.max_new_tokens", cap,
             f"{cap:,}" if decode <= tpot else f"0 (the decodes alone take {fmt_seconds(decode)})",
             f"floor((TPOT {fmt_seconds(tpot)} - a - b x {batch} - c x {batch + 1} - d x {kv:,}) / "
             "(b + d)): the slo policy's chunk cap"),
    ]
    if q.new_tokens > 0:
        prompt = q.prompt_tokens if q.prompt_tokens is not None else max(1, ctx - q.new_tokens)
        knee = predicted_knee(m, prompt_tokens=prompt, output_tokens=q.new_tokens, tpot_s=tpot)
        lines.append(Line(f"requests/s sustained at TPOT {fmt_seconds(tpot)}", "predicted_knee", knee,
                          f"{knee:,.2f} req/s",
                          f"{prompt:,} prompt + {q.new_tokens:,} new tokens each: (T - a - c - d P) "
                          "/ (T (b (P + O) + c O + d O (P + O/2))); above it queues grow"))
    return Section(f"Step time (roofline on {r.hw.name}) and SLO scheduling", tuple(lines),
                   ("the engine fits the same shape on its own steps: fitserve profile "
                    "--workload calibrate",))
