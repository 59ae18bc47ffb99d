"""fitserve's Ray Serve request router: prefix affinity under a load bound, weighted by each
replica's capacity units, with per-request exclusions (retries) and pins.

Ray Serve calls :meth:`FleetRouter.choose_replicas` for each request (it then sends the request to
the first replica of the best rank that has room under ``max_ongoing_requests``) and tells it when
a request was routed and when it completed; the replicas' ``record_routing_stats`` (KV usage,
capacity) reach it through Serve's controller as ``RunningReplica.routing_stats``.
"""

from __future__ import annotations

import itertools
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from fitserve.fleet.registry import register_router
from fitserve.fleet.request import FleetRequest
from fitserve.fleet.routing import PrefixIndex, ReplicaLoad, RoutingPolicy, rank_replicas


class FleetRouter(RequestRouter):
    """Prefix-cache affinity with a load bound, capacity-weighted load, retries' exclusions."""

    def initialize_state(self, policy: dict[str, Any] | None = None, **_: Any) -> None:
        self.policy = RoutingPolicy(**(policy or {}))
        self.index = PrefixIndex(self.policy.chunk_chars)
        self.in_flight: dict[str, int] = {}
        self._request_replica: dict[str, str] = {}
        self._turn = itertools.count()
        register_router(self._deployment_id.name, self)  # the ingress lists replicas through it

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        req = _fleet_request(pending_request)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        if req is None:
            return [candidate_replicas]
        if req.pin is not None:
            return [[by_id[req.pin]]] if req.pin in by_id else []
        # NOTE: when every replica was excluded, all are candidates again (the ingress caps retries)
        allowed = [rid for rid in by_id if rid not in req.exclude] or list(by_id)
        policy = self.policy
        if req.routing is not None and req.routing != policy.mode:
            policy = RoutingPolicy(req.routing, policy.balance_abs, policy.match_threshold,  # type: ignore[arg-type]
                                   policy.chunk_chars)
        loads = [self._load(by_id[rid]) for rid in allowed]
        matched = self.index.match(req.prompt, allowed) if req.prompt else {}
        ranks = rank_replicas(policy, loads, matched, len(req.prompt.encode("utf-8", "surrogatepass")),
                              next(self._turn))
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        rid = replica.replica_id.to_full_id_str()
        stats = replica.routing_stats or {}
        return ReplicaLoad(rid, self.in_flight.get(rid, 0), float(stats.get("capacity", 1.0)),
                           float(stats.get("kv_usage", 0.0)),
                           int(stats.get("running", 0)) + int(stats.get("waiting", 0)))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        rid = replica_id.to_full_id_str()
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        self._request_replica[pending_request.metadata.internal_request_id] = rid
        req = _fleet_request(pending_request)
        if req is not None and req.prompt and req.pin is None:
            self.index.insert(req.prompt, rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._request_replica.pop(internal_request_id, replica_id.to_full_id_str())
        if self.in_flight.get(rid, 0) > 0:
            self.in_flight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.to_full_id_str()
        self.index.remove(rid)  # its KV cache died with it
        self.in_flight.pop(rid, None)

    def replicas(self) -> dict[str, dict[str, Any]]:
        """Each live replica's id -> its last routing stats plus this router's in-flight count."""
        return {rid: {**(r.routing_stats or {}), "in_flight": self.in_flight.get(rid, 0)}
                for rid, r in ((r.replica_id.to_full_id_str(), r) for r in self.curr_replicas.values())}


def _fleet_request(pending: PendingRequest | None) -> FleetRequest | None:
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, FleetRequest):
            return arg
    return None
