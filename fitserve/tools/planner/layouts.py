"""Layouts of N GPUs for a target context and concurrency: TP x PP x DP and attention-DP.

For each layout, per GPU: weight bytes, KV bytes for its share of the sequences, the KV it
duplicates (TP past the KV-head count, or MLA's latent on every TP rank), communication per
token and the pipeline bubble; then a roofline decode step for the whole batch.

Assumptions (stated in the output): PP splits weights and layers evenly, runs pp micro-batches
so the pipeline stays full in steady decode (each micro-batch re-reads the stage's weights),
and pays (pp - 1) / (m + pp - 1) as a bubble on every prefill flush of m micro-batches;
attention-DP (MLA models) keeps attention weights whole on every GPU, splits experts N ways and
moves k x hidden activations per token per MoE layer in an all-to-all.

Throughput is what the workload gets: C requests dealt round-robin over the DP replicas (at
most max_num_seqs running on each), each running request one token per step of its replica:

    aggregate = sum over replicas of min(assigned, max_num_seqs) / step(that many)
    per user  = 1 / step of the busiest replica

so a replica with no request adds nothing (one request on TP2xDP4 is one TP2 replica's speed).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.flops import flops_per_token
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.kv import request_kv
from fitserve.ledger.memory import activation_peak_bytes
from fitserve.ledger.parallel import ring_allreduce_seconds
from fitserve.ledger.params import is_mla
from fitserve.ledger.speed import experts_touched_fraction
from fitserve.ledger.tp_split import check_tp_split
from fitserve.ledger.weights import model_weight_bytes


@dataclass(frozen=True)
class LayoutQuery:
    n_gpus: int
    context: int
    concurrency: int
    weights_fmt: str
    kv_dtype: str
    base_dtype: str = "bf16"
    memory_utilization: float = 0.9
    act_dtype_bytes: int = 2
    step_tokens: int = 2048  # activation reserve: one step's token budget
    max_num_seqs: int = 256  # per replica (the engine's default); the rest of C wait


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    pp: int
    dp: int
    attention_dp: bool
    weight_bytes_per_gpu: int
    kv_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    duplicated_kv_bytes: int  # over all N GPUs
    comm_bytes_per_token: float  # sent per GPU per generated token
    bubble: float
    fits: bool
    step_seconds: float  # the busiest replica's decode step
    tokens_per_s: float  # the workload's aggregate: sum over replicas of running seqs / step
    per_user_tokens_per_s: float  # what the slowest running request sees
    busy_replicas: int  # replicas with at least one request (the rest add nothing)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _roofline(hw: Hardware, q: LayoutQuery, nbytes: float, flops: float) -> float:
    return max(nbytes / hw.mem_bytes_per_s, flops / hw.peak_flops(q.weights_fmt))


def replica_loads(concurrency: int, replicas: int, max_seqs: int) -> list[int]:
    """Sequences each replica runs at once: ``concurrency`` requests dealt round-robin (as a
    load balancer does), each replica capped at ``max_seqs`` (the rest wait in its queue);
    a replica with no request runs nothing and adds nothing to throughput."""
    base, extra = divmod(concurrency, replicas)
    return [min(base + (i < extra), max_seqs) for i in range(replicas)]


def _workload_rates(loads: list[int], step_of: dict[int, float]) -> tuple[float, float]:
    """(aggregate tok/s, per-user tok/s of the slowest user): each running sequence emits one
    token per step of its replica; sum over replicas of load / step(load)."""
    busy = [n for n in loads if n > 0]
    if not busy:
        return 0.0, 0.0
    return sum(n / step_of[n] for n in busy), min(1.0 / step_of[n] for n in busy)


def _link_seconds(hw: Hardware, nbytes: float) -> float:
    """One message of ``nbytes`` over the device link; inf on hardware with no link figure
    (the CPU: as ring_allreduce_seconds prices its all-reduces)."""
    if hw.link_bytes_per_s <= 0:
        return float("inf")
    return hw.link_latency_s + nbytes / hw.link_bytes_per_s


def _tp_pp_dp_step(spec: ModelSpec, hw: Hardware, q: LayoutQuery, tp: int, pp: int,
                   seqs: int) -> tuple[float, float]:
    """(decode step seconds, bubble) of one TP x PP replica running ``seqs`` sequences."""
    wb = model_weight_bytes(spec, q.weights_fmt, tp=tp, base_dtype=q.base_dtype)
    expert = sum(line.bytes for line in wb.lines if line.name.startswith("expert_"))
    m = max(1, min(pp, seqs))  # micro-batches in flight
    mb = -(-seqs // m)
    w_read = (wb.total - expert + expert * experts_touched_fraction(spec, mb)) / pp
    kv_read = mb * request_kv(spec, q.context, q.kv_dtype, tp=tp).bytes_reclaimed / pp
    flops = mb * flops_per_token(spec, q.context).total / (tp * pp)
    h_bytes = spec.hidden_size * q.act_dtype_bytes
    comm_t = 2 * spec.num_layers / pp * ring_allreduce_seconds(mb * h_bytes, tp, hw)
    send_t = _link_seconds(hw, mb * h_bytes) if pp > 1 else 0.0
    stage = _roofline(hw, q, w_read + kv_read, flops) + comm_t + send_t
    step = m * stage if m == pp else pp * stage  # fewer micro-batches than stages: idle stages
    return step, (pp - 1) / (m + pp - 1)


def _tp_pp_dp(spec: ModelSpec, hw: Hardware, q: LayoutQuery, tp: int, pp: int) -> Layout:
    dp = q.n_gpus // (tp * pp)
    loads = replica_loads(q.concurrency, dp, q.max_num_seqs)
    seqs = max(1, loads[0])  # the busiest replica (memory is sized for it)
    wb = model_weight_bytes(spec, q.weights_fmt, tp=tp, base_dtype=q.base_dtype)
    per_seq = request_kv(spec, q.context, q.kv_dtype, tp=tp)
    kv_gpu = seqs * per_seq.bytes_all_layers // pp
    unsharded = request_kv(spec, q.context, q.kv_dtype, tp=1).bytes_all_layers
    dup = sum(loads) * (per_seq.bytes_all_layers * tp - unsharded)
    reserve = activation_peak_bytes(spec, q.step_tokens, q.act_dtype_bytes, tp)
    w_gpu = wb.total // pp
    steps = {n: _tp_pp_dp_step(spec, hw, q, tp, pp, n) for n in set(loads) | {seqs} if n > 0}
    step, bubble = steps[seqs]
    agg, per_user = _workload_rates(loads, {n: st for n, (st, _) in steps.items()})
    h_bytes = spec.hidden_size * q.act_dtype_bytes
    comm = (2 * spec.num_layers / pp * 2 * (tp - 1) / tp * h_bytes if tp > 1 else 0.0) + (
        h_bytes if pp > 1 else 0.0)
    name = "x".join(f"{k}{v}" for k, v in (("TP", tp), ("PP", pp), ("DP", dp)) if v > 1) or "1 GPU"
    usable = int(hw.memory_bytes * q.memory_utilization)
    return Layout(name, tp, pp, dp, False, w_gpu, kv_gpu, reserve, dup, comm, bubble,
                  w_gpu + kv_gpu + reserve <= usable, step, agg, per_user,
                  sum(1 for n in loads if n > 0))


def _attention_dp(spec: ModelSpec, hw: Hardware, q: LayoutQuery) -> Layout:
    n = q.n_gpus
    loads = replica_loads(q.concurrency, n, q.max_num_seqs)
    seqs = max(1, loads[0])
    wb = model_weight_bytes(spec, q.weights_fmt, tp=1, base_dtype=q.base_dtype)
    split = sum(line.bytes for line in wb.lines
                if line.name.startswith(("expert_", "ffn_", "shared_")))
    w_gpu = wb.total - split + split // n
    per_seq = request_kv(spec, q.context, q.kv_dtype, tp=1)
    kv_gpu = seqs * per_seq.bytes_all_layers
    reserve = activation_peak_bytes(spec, q.step_tokens, q.act_dtype_bytes, 1)
    expert = sum(line.bytes for line in wb.lines if line.name.startswith("expert_"))
    # NOTE: the experts see every rank's tokens (sum(loads)); an idle attention rank still
    # serves its experts, so every rank steps together at the busiest rank's pace.
    touched = expert * experts_touched_fraction(spec, max(1, sum(loads))) / n
    w_read = wb.total - split + (split - expert) / n + touched
    kv_read = seqs * per_seq.bytes_reclaimed
    flops = seqs * flops_per_token(spec, q.context).total
    moe_layers = spec.num_layers - spec.first_k_dense
    h_bytes = spec.hidden_size * q.act_dtype_bytes
    a2a = 2 * spec.num_experts_per_token * h_bytes * (n - 1) / n  # dispatch + combine
    comm_t = moe_layers * (hw.link_latency_s + _link_seconds(hw, seqs * a2a))
    step = _roofline(hw, q, w_read + kv_read, flops) + comm_t
    usable = int(hw.memory_bytes * q.memory_utilization)
    return Layout(f"attention-DP{n} + EP{n}", 1, 1, n, True, w_gpu, kv_gpu, reserve, 0,
                  moe_layers * a2a, 0.0, w_gpu + kv_gpu + reserve <= usable, step,
                  sum(loads) / step, 1.0 / step, sum(1 for x in loads if x > 0))


def candidate_layouts(spec: ModelSpec, hw: Hardware, q: LayoutQuery) -> list[Layout]:
    """Every valid TP x PP x DP factorisation of n_gpus (and attention-DP for MLA + MoE)."""
    if q.n_gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {q.n_gpus}")
    out: list[Layout] = []
    for tp in _divisors(q.n_gpus):
        try:
            check_tp_split(spec, tp, q.weights_fmt, q.base_dtype)
        except PlanError:
            continue
        for pp in _divisors(q.n_gpus // tp):
            if pp <= spec.num_layers:
                out.append(_tp_pp_dp(spec, hw, q, tp, pp))
    if is_mla(spec) and spec.num_experts and q.n_gpus > 1:
        out.append(_attention_dp(spec, hw, q))
    return out


@dataclass(frozen=True)
class LayoutChoice:
    layouts: tuple[Layout, ...]
    recommended: Layout | None
    reason: str


def recommend_layout(spec: ModelSpec, hw: Hardware, q: LayoutQuery) -> LayoutChoice:
    """The layout that fits and gives the workload (C requests of the context) the most tokens
    per second, and why; ties go to the layout whose slowest user is faster."""
    layouts = sorted(candidate_layouts(spec, hw, q),
                     key=lambda x: (-x.tokens_per_s, -x.per_user_tokens_per_s))
    fitting = [x for x in layouts if x.fits]
    if not fitting:
        need = min(layouts, key=lambda x: x.weight_bytes_per_gpu + x.kv_bytes_per_gpu)
        return LayoutChoice(tuple(layouts), None,
                            f"no layout fits {q.concurrency} x {q.context} tokens on {q.n_gpus} "
                            f"GPUs; the smallest per-GPU need is {need.name}")
    best = fitting[0]
    why = [f"{best.name} fits and gives {q.concurrency} request(s) the highest roofline "
           f"throughput ({best.tokens_per_s:,.0f} tok/s over {q.n_gpus} GPUs, "
           f"{best.per_user_tokens_per_s:,.0f} tok/s per user)"]
    idle = [x.name for x in fitting if x.busy_replicas < x.dp]
    if idle:
        why.append(f"{q.concurrency} request(s) leave DP replicas idle in {', '.join(idle)}: "
                   "an idle replica adds nothing")
    if best.duplicated_kv_bytes == 0:
        why.append("it stores no duplicate KV")
    if len(fitting) > 1:
        nxt = fitting[1]
        why.append(f"next: {nxt.name} at {nxt.tokens_per_s:,.0f} tok/s "
                   f"({nxt.per_user_tokens_per_s:,.0f} per user)")
    crowded = [x.name for x in layouts if not x.fits]
    if crowded:
        why.append(f"does not fit: {', '.join(crowded)}")
    return LayoutChoice(tuple(layouts), best, "; ".join(why))
