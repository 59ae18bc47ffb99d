"""The cluster model behind `plan layouts`: a cluster, one layout's memory and step time, the
latency crossover and the node count a precision needs (pure functions, no I/O)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.flops import flops_per_token
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.kv import check_tp, request_kv
from fitserve.ledger.memory import DEFAULT_GPU_WORKSPACE_BYTES, activation_peak_bytes
from fitserve.ledger.parallel import tp_allreduce
from fitserve.ledger.speed import weight_bytes_read
from fitserve.ledger.weights import model_weight_bytes

MAX_NODES = 64  # nodes_needed looks this far for a node count that fits


@dataclass(frozen=True)
class Cluster:
    spec: ModelSpec
    intra: Hardware  # the catalog GPU and its link
    inter: Hardware  # the same GPU with the inter-node link as its link
    nodes: int
    gpn: int
    m: int
    mb_tokens: int
    context: int
    weights: str
    kv: str
    usable: int
    slow: float
    act_bytes: int = 2

    @property
    def n(self) -> int:
        return self.nodes * self.gpn

    @property
    def batch(self) -> int:
        return self.m * self.mb_tokens


@dataclass(frozen=True)
class Layout:
    """One layout of the cluster: what a GPU holds and how long a step takes."""

    name: str
    tp: int
    pp: int
    dp: int
    m: int  # microbatches flushed per step (1 without PP)
    tokens: int  # per forward: a microbatch (PP) or a replica's share of the batch
    weight_bytes: int  # per GPU
    kv_bytes: int  # per GPU
    reserve_bytes: int
    usable: int
    ring: Hardware  # the link the TP all-reduce runs at
    calls_per_stage: float  # all-reduces per forward on one stage
    allreduce_s: float  # one call at ``tokens`` (plan.parallel.tp_allreduce)
    algorithm: str  # the all-reduce algorithm the ledger priced it with
    slow_allreduce_s: float  # one call with the slow link in its ring
    stages: tuple[float, ...]  # seconds per stage per forward (one stage without PP)
    slow_stages: tuple[float, ...]  # the same with one slow link

    @property
    def need(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.need <= self.usable

    @property
    def bubble(self) -> float:
        return (self.pp - 1) / (self.m + self.pp - 1)

    def step(self, *, slow: bool = False) -> float:
        """sum of stage times + (m - 1) x the slowest stage (a pipeline flush)."""
        t = self.slow_stages if slow else self.stages
        return sum(t) + (self.m - 1) * max(t)


def ring_hw(c: Cluster, tp: int) -> Hardware:
    """A TP group inside a node rings over NVLink; across nodes at the slowest link's rate,
    with the inter-node latency per call."""
    if tp <= c.gpn:
        return c.intra
    return dataclasses.replace(c.inter, link=f"ring across nodes ({c.inter.link})",
                               link_bytes_per_s=min(c.intra.link_bytes_per_s,
                                                    c.inter.link_bytes_per_s))


def slowed(hw: Hardware, f: float) -> Hardware:
    return dataclasses.replace(hw, link_bytes_per_s=hw.link_bytes_per_s * f)


def _send_links(c: Cluster, tp: int, pp: int) -> list[Hardware | None]:
    """The link stage s sends its activations over (None: the last stage sends nothing)."""
    node = [s * tp // c.gpn for s in range(pp)]
    return [None if s == pp - 1 else c.inter if node[s + 1] != node[s] else c.intra
            for s in range(pp)]


def _forward_s(c: Cluster, wb_total_read: float, tp: int, pp: int, tokens: int) -> float:
    """Roofline of one stage's forward over ``tokens`` decode tokens at ``c.context``."""
    kv = tokens * request_kv(c.spec, c.context, c.kv, tp=tp).bytes_reclaimed / pp
    mem = (wb_total_read / pp + kv) / c.intra.mem_bytes_per_s
    flops = tokens * flops_per_token(c.spec, c.context).total / (tp * pp)
    return max(mem, flops / c.intra.peak_flops(c.weights))


def make_layout(c: Cluster, name: str, tp: int, pp: int, dp: int) -> Layout:
    """The layout's memory and stage times (PlanError: tp or pp impossible for the model)."""
    s = c.spec
    check_tp(s, tp)
    if pp > s.num_layers:
        raise PlanError(f"PP{pp} exceeds the {s.num_layers} layers")
    tokens = c.mb_tokens if pp > 1 else -(-c.batch // dp)
    m = c.m if pp > 1 else 1
    wb = model_weight_bytes(s, c.weights, tp=tp)
    kv = -(-tokens * m * request_kv(s, c.context, c.kv, tp=tp).bytes_all_layers // pp)
    reserve = activation_peak_bytes(s, tokens, c.act_bytes, tp) + DEFAULT_GPU_WORKSPACE_BYTES
    ring = ring_hw(c, tp)
    msg = tokens * s.hidden_size * c.act_bytes
    calls = tp_allreduce(s, ring, tp=tp, tokens=tokens, act_dtype_bytes=c.act_bytes)
    slow_ar = tp_allreduce(s, slowed(ring, c.slow), tp=tp, tokens=tokens,
                           act_dtype_bytes=c.act_bytes).seconds_per_call
    per_stage = calls.calls_per_step / pp
    fwd = _forward_s(c, weight_bytes_read(s, wb, tokens), tp, pp, tokens)
    links = _send_links(c, tp, pp)
    # the slow link: in stage 0's ring (TP > 1), else on the first cross-node send
    hit = next((i for i, x in enumerate(links) if x is c.inter), 0) if tp == 1 else 0

    def stage(i: int, slow: bool) -> float:
        link = links[i]
        if link is not None and slow and tp == 1:
            link = slowed(link, c.slow)
        send = 0.0 if link is None else link.link_latency_s + msg / link.link_bytes_per_s
        return fwd + per_stage * (slow_ar if slow and tp > 1 else calls.seconds_per_call) + send

    healthy = tuple(stage(i, False) for i in range(pp))
    slow = tuple(stage(i, i == hit) for i in range(pp))
    return Layout(name, tp, pp, dp, m, tokens, -(-wb.total // pp), kv, reserve, c.usable,
                  ring, per_stage, calls.seconds_per_call, getattr(calls, "algorithm", "ring"),
                  slow_ar, healthy, slow)


def layouts(c: Cluster) -> tuple[list[Layout], list[str]]:
    """TP in a node (a replica per node), TP x PP (hybrid), TP across all, PP across all."""
    g, n, k = c.gpn, c.n, c.nodes
    todo = [(f"TP{g}" + (f" x DP{k}" if k > 1 else ""), g, 1, k)]
    if k > 1:
        todo += [(f"TP{g} x PP{k}", g, k, 1), (f"TP{n}", n, 1, 1), (f"PP{n}", 1, n, 1)]
    out, skipped, seen = [], [], set()
    for name, tp, pp, dp in todo:
        if (tp, pp, dp) in seen:
            continue
        seen.add((tp, pp, dp))
        try:
            out.append(make_layout(c, name, tp, pp, dp))
        except PlanError as e:
            skipped.append(f"{name}: not possible ({e})")
    return out, skipped


def crossover_latency(c: Cluster) -> tuple[float, Layout, Layout] | None:
    """The inter-node latency at which TP-in-node x PP-across-nodes = TP across all GPUs.

    Both steps are linear in it: TP across all pays it 2 x layers times (one per call);
    the pipeline on its (p - 1) sends plus (m - 1) times on the slowest (a sending) stage.
    None: one of the two is impossible for the model (or one node).
    """
    if c.nodes < 2:
        return None
    z = dataclasses.replace(c, inter=dataclasses.replace(c.inter, link_latency_s=0.0))
    try:
        hyb = make_layout(z, f"TP{c.gpn} x PP{c.nodes}", c.gpn, c.nodes, 1)
        tpn = make_layout(z, f"TP{c.n}", c.n, 1, 1)
    except PlanError:
        return None
    slope = tpn.calls_per_stage - (hyb.pp - 1) - (hyb.m - 1)
    return ((hyb.step() - tpn.step()) / slope if slope > 0 else math.inf), hyb, tpn


def nodes_needed(c: Cluster, fmt: str) -> tuple[int | None, Layout]:
    """Fewest nodes whose TP-in-node (x PP across nodes) layout holds the model in ``fmt``."""
    cf = dataclasses.replace(c, weights=fmt)
    first = make_layout(cf, f"TP{c.gpn}", c.gpn, 1, 1)
    if first.fits:
        return 1, first
    for k in range(2, min(MAX_NODES, c.spec.num_layers) + 1):
        x = make_layout(cf, f"TP{c.gpn} x PP{k}", c.gpn, k, 1)
        if x.fits:
            return k, first
    return None, first
