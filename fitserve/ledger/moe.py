"""Mixture-of-experts accounting: bytes a token reads, experts a batch touches, and where most
experts are active.

A token of an MoE model reads, per layer, its attention, the router, the shared expert (if
any) and k of the E routed experts, each tensor in its own stored format (gpt-oss: experts in
MXFP4 = 4.25 bits per weight, the rest bf16). A step of B tokens reads every expert that at
least one of its tokens picked. Under uniform, independent routing (each token picks k of the E
experts uniformly, without repeats) one expert is missed by one token with probability
1 - k/E, by all B tokens with (1 - k/E)^B, so the expected number of distinct experts is

    touched(B) = E x (1 - (1 - k/E)^B)          touched(1) = k, touched(B) -> E

and the weight read of a decode step grows with B until every expert is active::

    read(B) = non-expert bytes + expert bytes x touched(B) / E

NOTE: real routers are skewed (a few hot experts take a larger share, load-balancing losses
only bound it), which touches fewer distinct experts than uniform routing at a given B: the
uniform figures are the upper bound of the bytes read and the earliest batch to saturate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.params import Tensor, tensors
from fitserve.ledger.weights import WeightBytes

DEFAULT_ACTIVE_SHARE = 0.9  # "most experts": the batch where 90% of them are active


def _check_routing(num_experts: int, k: int) -> None:
    if num_experts < 1 or not 1 <= k <= num_experts:
        raise PlanError(f"MoE routing needs 1 <= k <= E experts, got k={k}, E={num_experts}")


def expected_experts_touched(num_experts: int, k: int, batch: int) -> float:
    """E x (1 - (1 - k/E)^B): distinct experts ``batch`` tokens touch (uniform top-k routing)."""
    _check_routing(num_experts, k)
    if batch < 0:
        raise PlanError(f"a batch has >= 0 tokens, got {batch}")
    return num_experts * (1.0 - (1.0 - k / num_experts) ** batch)


def batch_for_active_share(num_experts: int, k: int, share: float = DEFAULT_ACTIVE_SHARE) -> int:
    """The smallest batch whose expected touched experts reach ``share`` of E::

        1 - (1 - k/E)^B >= share   <=>   B >= ln(1 - share) / ln(1 - k/E)

    1 when every token already reads every expert (k = E)."""
    _check_routing(num_experts, k)
    if not 0 < share < 1:
        raise PlanError(f"the share of active experts must be in (0, 1), got {share}")
    if k == num_experts:
        return 1
    b = math.ceil(math.log(1 - share) / math.log(1 - k / num_experts) - 1e-12)
    return max(1, b)


def _group(t: Tensor) -> str:
    """Which part of a layer a tensor belongs to (the lines of ``ActiveBytes``)."""
    if t.name.startswith("expert_"):
        return "routed experts"
    if t.name.startswith("shared_"):
        return "shared expert"
    if t.name.startswith("router"):
        return "router"
    if t.name.startswith("ffn_"):
        return "dense MLP layers"
    if t.name in ("lm_head", "embedding", "final_norm", "norms"):
        return {"lm_head": "lm_head", "embedding": "embedding"}.get(t.name, "norms")
    return "attention"


@dataclass(frozen=True)
class ActiveBytes:
    """Weight bytes one token reads, on one of ``tp`` ranks, part by part (``parts``: name ->
    bytes). The input embedding is a lookup of one row and is left out, as the published
    "active parameters" of gpt-oss and DeepSeek-V3 leave it out."""

    tp: int
    parts: tuple[tuple[str, int], ...]
    expert_bytes_all: int  # every routed expert, one rank (what a saturated step reads)
    num_experts: int
    k: int
    embedding: int = 0  # the untied input embedding table, one rank

    @property
    def per_token(self) -> int:
        return sum(b for _, b in self.parts)

    @property
    def non_expert(self) -> int:
        return self.per_token - self.part("routed experts")

    def part(self, name: str) -> int:
        return next((b for n, b in self.parts if n == name), 0)

    def step_read(self, tokens: int) -> float:
        """Expected weight bytes a step of ``tokens`` tokens reads (uniform routing), as the
        rooflines count it (``moe_step_weight_read``): the embedding table included.

        NOTE: the ledger's rooflines count the untied embedding table as read every step, for
        dense and MoE models alike (an upper bound: a step reads only its tokens' rows)."""
        touched = (expected_experts_touched(self.num_experts, self.k, tokens)
                   if self.num_experts else 0.0)
        experts = self.expert_bytes_all * touched / self.num_experts if self.num_experts else 0
        return self.non_expert + self.embedding + experts


def active_bytes(spec: ModelSpec, wb: WeightBytes) -> ActiveBytes:
    """What one token reads of ``wb`` (``model_weight_bytes``' lines, each tensor in its own
    format, per rank): every tensor's bytes x its active copies / its copies (k of E for routed
    experts, all of the others), the embedding lookup excluded."""
    if wb.mix_is_per_tensor:
        raise PlanError("active bytes need the ledger's tensor lines (model_weight_bytes), not "
                        "a file's per-format totals")
    by_name = {t.name: t for t in tensors(spec)}
    parts: dict[str, int] = {}
    experts_all = embedding = 0
    for line in wb.lines:
        t = by_name[line.name]
        group = _group(t)
        if group == "embedding":
            embedding += line.bytes
            continue
        active = line.bytes * t.active_count // t.count
        parts[group] = parts.get(group, 0) + active
        if group == "routed experts":
            experts_all += line.bytes
    return ActiveBytes(wb.tp, tuple(parts.items()), experts_all, spec.num_experts,
                       spec.num_experts_per_token, embedding)


def moe_step_weight_read(spec: ModelSpec, wb: WeightBytes, tokens: int) -> float:
    """Weight bytes a step of ``tokens`` tokens reads on one rank: all non-expert tensors plus
    the expected touched experts (``wb.total`` for a dense model or a per-tensor file mix)."""
    if not spec.num_experts or wb.mix_is_per_tensor:
        return float(wb.total)
    expert = sum(line.bytes for line in wb.lines if line.name.startswith("expert_"))
    touched = expected_experts_touched(spec.num_experts, spec.num_experts_per_token, tokens)
    return wb.total - expert + expert * touched / spec.num_experts
