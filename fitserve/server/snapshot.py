"""What the engine thread publishes for the dashboard (GET /dashboard/state): a typed record of
the KV pool, who holds which block, and the requests in flight.

:meth:`DashboardSnapshot.to_json` writes the JSON object the dashboard's ``app.js`` reads; its
keys are the records' fields, in their order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from fitserve.kv.group import GroupStats
from fitserve.kv.manager import KVStats

if TYPE_CHECKING:
    from fitserve.engine.core import EngineStats


@dataclass(slots=True, frozen=True)
class KVSnapshot:
    """The KV pool: blocks, slots and sharing."""

    num_blocks: int
    used_blocks: int
    free_blocks: int
    block_size: int
    used_slots: int
    allocated_slots: int
    fragmentation: float  # rounded to 4 decimals
    shared_blocks: int
    evictable_cached_blocks: int
    # every layer group's pool: kind, window, layers, blocks held / usable / free, and the blocks
    # its window has released so far (hybrid Gemma 2/3 have a full and a sliding group)
    groups: tuple[GroupStats, ...]

    @classmethod
    def of(cls, kv: KVStats, block_size: int) -> KVSnapshot:
        return cls(num_blocks=kv.num_blocks, used_blocks=kv.used_blocks, free_blocks=kv.free_blocks,
                   block_size=block_size, used_slots=kv.used_slots, allocated_slots=kv.allocated_slots,
                   fragmentation=round(kv.fragmentation, 4), shared_blocks=kv.shared_blocks,
                   evictable_cached_blocks=kv.evictable_cached_blocks, groups=kv.groups)


@dataclass(slots=True, frozen=True)
class RequestRow:
    """One engine request in flight, as the dashboard's table shows it."""

    id: str
    group: str  # the client request it belongs to
    state: Literal["running", "waiting"]  # running: it holds KV blocks
    prompt_tokens: int
    output_tokens: int
    blocks: int  # KV blocks it holds (a beam search: all its beams')
    age_s: float  # since its HTTP request arrived, rounded to 2 decimals


@dataclass(slots=True, frozen=True)
class DashboardSnapshot:
    """The engine's state at one moment (published at most every 0.25 s, and when idle)."""

    time: float  # time.time() when it was taken
    kv: KVSnapshot
    owners: list[tuple[int, list[str]]]  # (block, the scheduler entries holding it), by block
    cached: list[int]  # free blocks still holding a reusable prefix
    requests: list[RequestRow]
    num_running: int
    num_waiting: int
    total_preemptions: int

    @classmethod
    def of(cls, st: EngineStats, request_of: Callable[[str], str], block_size: int,
           live: Iterable[tuple[str, str, int, int, float]], now: float) -> DashboardSnapshot:
        """From the engine's stats (with owners), who each scheduler entry belongs to, and the
        live requests as (id, group, prompt tokens, output tokens, arrival) at ``now``
        (time.monotonic())."""
        holders: dict[str, int] = {}  # request -> blocks it holds (a beam search: all its beams')
        for owners in st.block_owners.values():
            for rid in {request_of(o) for o in owners}:
                holders[rid] = holders.get(rid, 0) + 1
        requests = [
            RequestRow(id=rid, group=group, state="running" if rid in holders else "waiting",
                       prompt_tokens=prompt, output_tokens=output, blocks=holders.get(rid, 0),
                       age_s=round(now - arrival, 2))
            for rid, group, prompt, output, arrival in live
        ]
        return cls(time=time.time(), kv=KVSnapshot.of(st.kv, block_size),
                   owners=sorted(st.block_owners.items()), cached=st.evictable_blocks,
                   requests=requests, num_running=st.num_running, num_waiting=st.num_waiting,
                   total_preemptions=st.total_preemptions)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of GET /dashboard/state (before the server adds its own keys)."""
        return asdict(self)
