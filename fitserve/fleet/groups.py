"""Which replica group (Serve deployment) takes a request, when a fleet has several (e.g. one per
accelerator type): the replica ranking of :mod:`fitserve.fleet.routing` applied to groups, each
weighted by its capacity units (replicas x units per replica), with its own prefix index. The
group's FleetRouter then picks the replica inside it. No Ray here."""

from __future__ import annotations

import itertools

from fitserve.fleet.routing import PrefixIndex, ReplicaLoad, RoutingPolicy, rank_replicas


class GroupPicker:
    """The ingress's choice among replica groups; call ``started``/``finished`` around each request."""

    def __init__(self, capacities: dict[str, float], policy: RoutingPolicy) -> None:
        self.capacities = capacities
        self.policy = policy
        self.index = PrefixIndex(policy.chunk_chars)
        self.in_flight = dict.fromkeys(capacities, 0)
        self._turn = itertools.count()

    def order(self, prompt: str, routing: str | None = None) -> list[str]:
        """The groups, the one to try first first."""
        if len(self.capacities) == 1:
            return list(self.capacities)
        policy = self.policy if routing is None else RoutingPolicy(
            routing, self.policy.balance_abs, self.policy.match_threshold, self.policy.chunk_chars)  # type: ignore[arg-type]
        loads = [ReplicaLoad(g, self.in_flight[g], c) for g, c in self.capacities.items()]
        matched = self.index.match(prompt, list(self.capacities)) if prompt else {}
        ranks = rank_replicas(policy, loads, matched, len(prompt.encode("utf-8", "surrogatepass")), next(self._turn))
        return [g for rank in ranks for g in rank]

    def started(self, group: str, prompt: str) -> None:
        self.in_flight[group] += 1
        if prompt and len(self.capacities) > 1:
            self.index.insert(prompt, group)

    def finished(self, group: str) -> None:
        self.in_flight[group] = max(0, self.in_flight[group] - 1)
