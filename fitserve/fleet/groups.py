"""Which replica group (Serve deployment) takes a request, when a fleet has several (e.g. one per
accelerator type, or a canary): the replica ranking of :mod:`fitserve.fleet.routing` applied to
groups, each weighted by its capacity units (replicas x units per replica), with its own prefix
index; a canary group (:mod:`fitserve.fleet.canary`) takes its stage's exact share first. The
group's FleetRouter then picks the replica inside it. No Ray here."""

from __future__ import annotations

import itertools

from fitserve.fleet.canary import CanarySplit
from fitserve.fleet.routing import PrefixIndex, ReplicaLoad, RoutingPolicy, rank_replicas


class GroupPicker:
    """The ingress's choice among replica groups; call ``started``/``finished`` around each request."""

    def __init__(self, capacities: dict[str, float], policy: RoutingPolicy) -> None:
        self.capacities = capacities
        self.policy = policy
        self.index = PrefixIndex(policy.chunk_chars)
        self.in_flight = dict.fromkeys(capacities, 0)
        self.peak_load = dict.fromkeys(capacities, 0.0)  # most in-flight requests per capacity unit seen
        self.canary: CanarySplit | None = None
        self._turn = itertools.count()

    def start_canary(self, split: CanarySplit) -> None:
        """Send ``split``'s share to its group (a deployment name, or the fleet file's group name)."""
        named = [g for g in self.capacities if g.endswith(f"-{split.group}")]
        if split.group not in self.capacities and len(named) == 1:
            split.group = named[0]
        if split.group not in self.capacities:
            raise ValueError(f"no replica group {split.group!r} for the canary; groups: {sorted(self.capacities)}")
        if len(self.capacities) < 2:
            raise ValueError("a canary needs another replica group beside it to take the rest")
        self.canary = split

    def order(self, prompt: str, routing: str | None = None) -> list[str]:
        """The groups, the one to try first first (a retry takes the next)."""
        if len(self.capacities) == 1:
            return list(self.capacities)
        canary = self.canary
        groups = [g for g in self.capacities if canary is None or g != canary.group]
        ranked = self._ranked(groups, prompt, routing)
        if canary is None:
            return ranked
        # NOTE: the canary is the baseline's last fallback (and it its): a refused request is
        # retried rather than lost, at the cost of the share's exactness on retries only
        return [canary.group, *ranked] if canary.take() else [*ranked, canary.group]

    def _ranked(self, groups: list[str], prompt: str, routing: str | None) -> list[str]:
        if len(groups) == 1:
            return groups
        policy = self.policy if routing is None else RoutingPolicy(
            routing, self.policy.balance_abs, self.policy.match_threshold, self.policy.chunk_chars)  # type: ignore[arg-type]
        loads = [ReplicaLoad(g, self.in_flight[g], self.capacities[g]) for g in groups]
        matched = self.index.match(prompt, groups) if prompt else {}
        ranks = rank_replicas(policy, loads, matched, len(prompt.encode("utf-8", "surrogatepass")), next(self._turn))
        return [g for rank in ranks for g in rank]

    def started(self, group: str, prompt: str) -> None:
        self.in_flight[group] += 1
        self.peak_load[group] = max(self.peak_load[group], self.in_flight[group] / self.capacities[group])
        if prompt and len(self.capacities) > 1:
            self.index.insert(prompt, group)

    def finished(self, group: str) -> None:
        self.in_flight[group] = max(0, self.in_flight[group] - 1)
