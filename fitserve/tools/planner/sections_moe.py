"""The mixture-of-experts section of a plan: weights whole and per GPU, the bytes a token reads,
the experts a batch touches, the decode roofline from the bytes a step actually reads, and the
two ways to split experts over tensor-parallel ranks (fitserve.ledger.moe, moe_parallel)."""

from __future__ import annotations

from fitserve.ledger.moe import (
    DEFAULT_ACTIVE_SHARE,
    ActiveBytes,
    active_bytes,
    batch_for_active_share,
    expected_experts_touched,
)
from fitserve.ledger.moe_parallel import ENGINE_MOE_TP, MoeTpScheme, moe_tp_schemes
from fitserve.ledger.units import fmt_bytes, fmt_seconds
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.report import Line, Resolved, Section


def _parts(ab: ActiveBytes) -> str:
    shown = [f"{name} {b:,}" for name, b in ab.parts if name != "routed experts"]
    shown.append(f"{ab.k} of {ab.num_experts} routed experts {ab.part('routed experts'):,}")
    return " + ".join(shown) + f" = {ab.per_token:,} B (embedding lookup not counted)"


def _read_line(r: Resolved, ab: ActiveBytes, batch: int, label: str) -> Line:
    e, k = ab.num_experts, ab.k
    touched = expected_experts_touched(e, k, batch)
    read = ab.step_read(batch)
    t = read / r.hw.mem_bytes_per_s
    return Line(f"decode weight read, {label}", "ActiveBytes.step_read", read,
                f"{fmt_bytes(read)} = {fmt_seconds(t)}, {batch / t:,.0f} tok/s",
                f"{ab.non_expert:,} B non-expert + {ab.embedding:,} B embedding table + "
                f"{ab.expert_bytes_all:,} B experts x {touched:.2f} / {e} touched; / "
                f"{r.hw.mem_bytes_per_s:.3g} B/s (weights only, per GPU; the speed section "
                "adds KV and compute)")


def _scheme_line(s: MoeTpScheme, tp: int) -> Line:
    engine = f"engine: {ENGINE_MOE_TP}" if s.implemented else "not in the engine"
    return Line(f"TP {tp}, {s.name}", "moe_tp_schemes", s.group_bytes_per_token,
                f"{s.calls_per_step} collectives/step, {fmt_bytes(s.group_bytes_per_token)}/token; "
                f"{engine}",
                f"per layer {s.calls_per_layer}; each rank sends {s.rank_bytes_per_token:,.0f} B "
                f"per token of the step; at batch {s.batch} the slowest rank reads "
                f"{s.weight_read_per_rank:,.0f} B of weights ({s.busiest_rank_experts:.2f} "
                "experts' worth per layer; expert-parallel: the busiest rank's whole experts, "
                "uniform routing)")


def moe_section(r: Resolved, batch: int) -> Section | None:
    """None for a dense model."""
    s, q = r.entry.spec, r.req
    if not s.num_experts:
        return None
    e, k = s.num_experts, s.num_experts_per_token
    whole = model_weight_bytes(s, r.weights, tp=1, base_dtype=r.base_dtype)
    per_gpu = model_weight_bytes(s, r.weights, tp=q.tp, base_dtype=r.base_dtype)
    ab_whole, ab = active_bytes(s, whole), active_bytes(s, per_gpu)
    sat = batch_for_active_share(e, k, DEFAULT_ACTIVE_SHARE)
    moe_layers = s.num_layers - s.first_k_dense
    lines = [
        Line("routed experts", "spec", e, f"top-{k} of {e} per token",
             f"{moe_layers} MoE layers of {s.num_layers}, expert intermediate "
             f"{s.moe_intermediate_size or s.intermediate_size}"
             + (f", {s.num_shared_experts} shared expert(s)" if s.num_shared_experts else "")),
        Line("routed experts' weights, whole model", "model_weight_bytes(tp=1)",
             ab_whole.expert_bytes_all, fmt_bytes(ab_whole.expert_bytes_all),
             f"of {whole.total:,} B in all ({ab_whole.expert_bytes_all / whole.total:.1%})"),
        Line(f"weights per GPU (tp={q.tp})", f"model_weight_bytes(tp={q.tp})", per_gpu.total,
             fmt_bytes(per_gpu.total), f"experts {ab.expert_bytes_all:,} B (megatron-style: "
             f"1/{q.tp} of every expert)"),
        Line("active bytes per token, whole model", "active_bytes", ab_whole.per_token,
             fmt_bytes(ab_whole.per_token), _parts(ab_whole)),
    ]
    if q.tp > 1:
        lines.append(Line("active bytes per token per GPU", "active_bytes", ab.per_token,
                          fmt_bytes(ab.per_token), _parts(ab)))
    lines += [
        Line(f"experts touched per layer, batch {batch}", "E (1 - (1 - k/E)^B)",
             expected_experts_touched(e, k, batch),
             f"{expected_experts_touched(e, k, batch):.2f} of {e}",
             f"{e} x (1 - (1 - {k}/{e})^{batch}); batch 1 reads exactly {k}"),
        Line(f"batch at which {DEFAULT_ACTIVE_SHARE:.0%} of experts are active",
             "batch_for_active_share", sat, f"{sat:,}",
             f"ceil(ln(1 - {DEFAULT_ACTIVE_SHARE}) / ln(1 - {k}/{e})): past it a step reads "
             "nearly every expert and decode is priced as a dense model of the full size"),
        _read_line(r, ab, 1, "batch 1"),
    ]
    lines += [_read_line(r, ab, b, f"batch {b}") for b in sorted({batch, sat}) if b > 1]
    notes = [
        "experts touched under uniform, independent top-k routing; real routers are skewed "
        "toward a few hot experts, which touches fewer at a given batch: these reads are the "
        "upper bound",
        f"engine: {ENGINE_MOE_TP} expert sharding (each expert's intermediate dimension split "
        "over the TP ranks, 2 all-reduces per layer as a dense model)",
    ]
    if q.tp > 1:
        mega, ep = moe_tp_schemes(s, per_gpu, whole, batch=batch, act_dtype_bytes=r.act_bytes)
        lines.append(_scheme_line(mega, q.tp))
        if ep is None:
            notes.append(f"expert-parallel not priced: {e} experts do not split evenly over "
                         f"{q.tp} ranks")
        else:
            lines.append(_scheme_line(ep, q.tp))
    return Section(f"Mixture of experts: top-{k} of {e}, per token and per step", tuple(lines),
                   tuple(notes))
