"""The fleet's routing decision as a pure function of what the router knows (no Ray here).

::

    prompt text --chunks of CHUNK chars--> h1 -> h2 -> h3 ...   (chained hashes)
    PrefixIndex: hash -> replicas that were sent a prompt starting with that chain
    match(replica) = chars of the longest chain prefix sent to it

    load(r) = (max(in_flight(r), running + waiting it reported) + 1) / capacity(r)
    affinity: among replicas whose load is within balance_abs of the least loaded, the one
              holding the longest prefix (if it covers >= match_threshold of the prompt);
              otherwise, and for the fallback ranks, the least loaded first (kv usage breaks ties)

The index is what SGLang's cache-aware router and Ray Serve LLM's PrefixCacheAffinityRouter keep
(a tree of the text each replica was sent), as hashed chunks: the same answer to "who holds the
longest prefix" at chunk granularity, in O(prompt length).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

RoutingMode = Literal["affinity", "round-robin", "least-load"]
ROUTING_MODES: tuple[RoutingMode, ...] = ("affinity", "round-robin", "least-load")


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """How the router ranks replicas (``--routing`` and its bounds)."""

    mode: RoutingMode = "affinity"
    # NOTE: the load bound, in requests per capacity unit: affinity may pick a replica at most this
    # far above the least loaded one (SGLang's balance_abs_threshold, there in requests).
    balance_abs: float = 4.0
    match_threshold: float = 0.1  # the least share of the prompt a match must cover to count
    chunk_chars: int = 64  # prefix granularity: about 16 tokens, one KV block of 16

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_MODES:
            raise ValueError(f"routing mode must be one of {ROUTING_MODES}, got {self.mode!r}")
        if self.balance_abs < 0 or not 0 <= self.match_threshold <= 1 or self.chunk_chars < 1:
            raise ValueError("balance_abs >= 0, 0 <= match_threshold <= 1 and chunk_chars >= 1 are required")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica as the router sees it at a routing decision."""

    replica: str
    in_flight: int  # requests this router sent to it that have not completed
    capacity: float = 1.0  # capacity units (its share of the fleet's throughput at the SLO)
    kv_usage: float = 0.0  # 0..1, from the replica's last routing stats
    reported: int = 0  # running + waiting in the replica's last routing stats (any router's)

    def load_if_added(self) -> float:
        # NOTE: in_flight is exact and immediate for this router's requests; the replica's own
        # count (up to a stats period old) also covers other routers' (several ingresses)
        return (max(self.in_flight, self.reported) + 1) / max(self.capacity, 1e-9)


class PrefixIndex:
    """Which replicas were sent which prompt prefixes, by chained hashes of fixed-size chunks;
    least recently used chains are forgotten past ``max_entries``."""

    def __init__(self, chunk_chars: int = 64, max_entries: int = 200_000) -> None:
        self.chunk_chars = chunk_chars
        self.max_entries = max_entries
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()

    def chain(self, text: str) -> list[bytes]:
        """The chained hash of every whole chunk of ``text`` (a partial last chunk is left out)."""
        out: list[bytes] = []
        prev = b""
        data = text.encode("utf-8", "surrogatepass")
        for i in range(0, len(data) - self.chunk_chars + 1, self.chunk_chars):
            prev = hashlib.blake2b(prev + data[i:i + self.chunk_chars], digest_size=12).digest()
            out.append(prev)
        return out

    def match(self, text: str, replicas: list[str]) -> dict[str, int]:
        """For each replica, the bytes of ``text``'s longest indexed prefix it holds."""
        best = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for n, h in enumerate(self.chain(text), start=1):
            holders = self._holders.get(h)
            alive &= holders if holders is not None else set()
            if not alive:
                break
            for r in alive:
                best[r] = n * self.chunk_chars
        return best

    def insert(self, text: str, replica: str) -> None:
        for h in self.chain(text):
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = set()
            else:
                self._holders.move_to_end(h)
            holders.add(replica)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def remove(self, replica: str) -> None:
        """Forget a replica (it died or was removed: its cache is gone)."""
        for h in [h for h, s in self._holders.items() if replica in s]:
            s = self._holders[h]
            s.discard(replica)
            if not s:
                del self._holders[h]


def rank_replicas(policy: RoutingPolicy, loads: list[ReplicaLoad], matched: dict[str, int],
                  prompt_bytes: int, turn: int) -> list[list[str]]:
    """Replica ids in ranks, most preferred first (Ray Serve tries rank by rank).

    ``matched``: each replica's prefix match in bytes (PrefixIndex.match); ``turn``: a counter the
    caller increments per request (round-robin's position).
    """
    if not loads:
        return []
    by_load = sorted(loads, key=lambda r: (r.load_if_added(), r.kv_usage, r.replica))
    if policy.mode == "round-robin":
        order = sorted(r.replica for r in loads)
        k = turn % len(order)
        return [[rid] for rid in order[k:] + order[:k]]
    ranked = [r.replica for r in by_load]
    if policy.mode == "least-load" or prompt_bytes == 0:
        return [[rid] for rid in ranked]
    floor = by_load[0].load_if_added()
    eligible = [r for r in by_load if r.load_if_added() <= floor + policy.balance_abs]
    best = max(eligible, key=lambda r: (matched.get(r.replica, 0), -r.load_if_added()))
    if matched.get(best.replica, 0) < policy.match_threshold * prompt_bytes:
        return [[rid] for rid in ranked]
    return [[best.replica]] + [[rid] for rid in ranked if rid != best.replica]
