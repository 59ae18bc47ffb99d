"""Two ways to split a mixture-of-experts model over ``tp`` ranks, priced side by side.

Megatron-style (what fitserve's engine runs): every expert's intermediate dimension is split
over the ranks (gate/up by rows, down by columns), as a dense MLP; each layer ends its attention
and its MoE block in partial sums, one all-reduce each::

    per layer   2 all-reduces of the hidden state, ring: each rank sends 2 (tp-1)/tp x H x b
                per token per all-reduce, the group 2 (tp-1) x H x b
    weights     every rank reads 1/tp of every active expert: the load is even by construction

Expert-parallel: whole experts, E/tp per rank. Attention stays tensor-parallel but ends in a
reduce-scatter (each rank keeps 1/tp of the tokens) and starts with an all-gather: together
the wire bytes of one all-reduce. Each token's hidden state is dispatched to its k experts'
ranks and their outputs combined back: two all-to-alls, (tp-1)/tp of the k copies off-rank::

    per layer   reduce-scatter + all-gather (2 (tp-1) H b per token, group) and
                all-to-all dispatch + combine: H x b x k x 2 x (tp-1)/tp per token (group)
    weights     the step waits for the busiest rank: its expected active experts (below),
                more than touched(B)/tp when routing lands unevenly

Dense layers (DeepSeek's first_k_dense) are Megatron-split in both; under expert parallelism
the shared expert and the router are replicated (each rank runs them on the tokens it owns).

Busiest rank, under uniform independent top-k routing (fitserve.ledger.moe): the set of experts
a step touches is, given its size D, a uniformly random D-subset of the E experts, so

    P(D = d) by adding tokens one at a time (a token picks j new experts: hypergeometric)
    P(max rank count <= m | D = d) = [x^d] (sum_{j<=m} C(E/tp, j) x^j)^tp / C(E, d)
    E[max] = sum_{m >= 0} (1 - P(max <= m))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.moe import active_bytes, expected_experts_touched
from fitserve.ledger.weights import WeightBytes

ENGINE_MOE_TP = "megatron-style"  # what fitserve's engine implements (fitserve.model.moe)


def touched_distribution(num_experts: int, k: int, batch: int) -> list[float]:
    """P(D = d), d = 0..E: distinct experts touched by ``batch`` tokens each picking k of E."""
    if not 1 <= k <= num_experts or batch < 0:
        raise PlanError(f"need 1 <= k <= E and a batch >= 0, got k={k}, E={num_experts}, "
                        f"B={batch}")
    e = num_experts
    picks = math.comb(e, k)
    dist = [0.0] * (e + 1)
    dist[0] = 1.0
    for _ in range(batch):
        new = [0.0] * (e + 1)
        for d, p in enumerate(dist):
            if p == 0.0:
                continue
            for j in range(max(0, k - d), min(k, e - d) + 1):  # j experts not touched before
                new[d + j] += p * math.comb(e - d, j) * math.comb(d, k - j) / picks
        dist = new
        if dist[e] >= 1.0 - 1e-15:  # every expert touched from here on
            return [0.0] * e + [1.0]
    return dist


def expected_busiest_rank_experts(num_experts: int, k: int, batch: int, tp: int) -> float:
    """Expected active experts on the busiest of ``tp`` ranks holding E/tp whole experts each."""
    if tp < 1 or num_experts % tp:
        raise PlanError(f"expert parallelism needs E divisible by tp, got E={num_experts}, "
                        f"tp={tp}")
    g = num_experts // tp
    dist = touched_distribution(num_experts, k, batch)
    total = 0.0
    for m in range(g):  # P(max > m); P(max > g - 1 and beyond) handled as max <= g always
        base = [float(math.comb(g, j)) for j in range(m + 1)]
        poly = [1.0]
        for _ in range(tp):
            out = [0.0] * (len(poly) + m)
            for i, a in enumerate(poly):
                if a:
                    for j, c in enumerate(base):
                        out[i + j] += a * c
            poly = out
        at_most = sum(p * poly[d] / math.comb(num_experts, d)
                      for d, p in enumerate(dist) if p and d < len(poly))
        total += 1.0 - at_most
    return total


@dataclass(frozen=True)
class MoeTpScheme:
    """One way to split the experts: collectives and weight read of one decode step."""

    name: str  # "megatron-style" | "expert-parallel"
    calls_per_layer: str  # the collectives of one MoE layer, in words
    calls_per_step: int  # collective calls of one forward step (all layers)
    group_bytes_per_token: float  # bytes on the wire per token, all ranks, whole forward
    rank_bytes_per_token: float  # bytes one rank sends per token of the step
    weight_read_per_rank: float  # expected weight bytes the slowest rank reads at ``batch``
    busiest_rank_experts: float  # per MoE layer, in whole experts (megatron: touched / tp)
    batch: int

    @property
    def implemented(self) -> bool:
        return self.name == ENGINE_MOE_TP


def moe_tp_schemes(spec: ModelSpec, wb_tp: WeightBytes, wb_whole: WeightBytes, *, batch: int,
                   act_dtype_bytes: int) -> tuple[MoeTpScheme, MoeTpScheme | None]:
    """(Megatron-style, expert-parallel) at ``wb_tp.tp`` ranks for a decode step of ``batch``
    tokens; ``wb_tp``/``wb_whole``: ``model_weight_bytes`` at tp and at 1 (module docstring).
    Expert-parallel is None when the E experts do not split evenly over the ranks."""
    tp, e, k = wb_tp.tp, spec.num_experts, spec.num_experts_per_token
    if not e:
        raise PlanError(f"{spec.name or spec.architecture} has no routed experts")
    if tp < 2:
        raise PlanError("the MoE tensor-parallel schemes need tp >= 2")
    hb, n, moe_layers = spec.hidden_size * act_dtype_bytes, spec.num_layers, (
        spec.num_layers - spec.first_k_dense)
    ring = 2 * (tp - 1) / tp
    touched = expected_experts_touched(e, k, batch)
    mega_active = active_bytes(spec, wb_tp)
    mega = MoeTpScheme(ENGINE_MOE_TP, "2 all-reduces (after o_proj, after the experts' down)",
                       2 * n, 2 * n * tp * ring * hb, 2 * n * ring * hb,
                       mega_active.step_read(batch), touched / tp, batch)
    if e % tp:
        return mega, None
    a2a = hb * k * 2 * (tp - 1) / tp  # dispatch + combine, per token, all ranks
    whole = active_bytes(spec, wb_whole)
    shared_extra = whole.part("shared expert") - mega_active.part("shared expert")
    per_expert = whole.expert_bytes_all / (moe_layers * e)
    busiest = expected_busiest_rank_experts(e, k, batch, tp)
    ep_read = (mega_active.non_expert + mega_active.embedding + shared_extra
               + busiest * per_expert * moe_layers)
    ep = MoeTpScheme("expert-parallel",
                     "reduce-scatter + all-gather around attention, all-to-all dispatch + "
                     "combine", 2 * spec.first_k_dense + 4 * moe_layers,
                     2 * spec.first_k_dense * tp * ring * hb
                     + moe_layers * (tp * ring * hb + a2a),
                     2 * spec.first_k_dense * ring * hb + moe_layers * (ring * hb + a2a / tp),
                     ep_read, busiest, batch)
    return mega, ep
