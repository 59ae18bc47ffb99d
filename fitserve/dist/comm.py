"""The collectives of a tensor-parallel rank: counted by kind, numbered, and watched.

Every call gets a sequence number; ``status`` says which one is in flight since when, so the
watchdog (fitserve.dist.watchdog) can tell a rank that waits inside a collective from one that
never reached it. Counters are what `fitserve generate --tp N -v` prints next to the ledger.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed: a peer died or stalled past the timeout (the message says which)."""


@dataclass(slots=True)
class OpCount:
    calls: int = 0
    bytes: int = 0  # the tensor each call reduces / sends (per rank), summed


@dataclass(slots=True)
class CollectiveStatus:
    """Where this rank is: the last collective started, and whether it is still running."""

    seq: int = 0  # collectives started so far
    op: str = ""  # the latest one's "kind op" ("layer all_reduce")
    in_flight: bool = False
    started: float = 0.0  # time.monotonic() of the latest start
    # a worker waiting for rank 0's next command: idle, not hung, however long it lasts
    idle: bool = False
    thread: int = 0  # threading.get_ident() of the thread that called it (its stack is reported)


@dataclass
class Collectives:
    """Wraps torch.distributed on the default group for one rank."""

    rank: int
    world_size: int
    counts: dict[str, OpCount] = field(default_factory=dict)
    status: CollectiveStatus = field(default_factory=CollectiveStatus)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # set by the watchdog when it diagnosed a hang: the message a failing collective raises
    diagnosis: str = ""
    # set by the launcher (rank 0): returns a message naming a dead worker, or ""
    peer_check: object = None
    seconds: float = 0.0  # wall time spent inside collectives

    # the control channel (rank 0's step plans): a gloo group whose timeout is long, since a
    # worker may wait for the next step for as long as the engine is idle
    control_group: object = None

    def _begin(self, kind: str, op: str, t: torch.Tensor, *, idle: bool = False) -> None:
        key = f"{kind} {op}"
        c = self.counts.setdefault(key, OpCount())
        c.calls += 1
        c.bytes += t.numel() * t.element_size()
        with self.lock:
            s = self.status
            s.seq += 1
            s.op, s.in_flight, s.started, s.idle = key, True, time.monotonic(), idle
            s.thread = threading.get_ident()

    def _wait(self, work: dist.Work) -> None:
        t0 = self.status.started
        try:
            work.wait()
        except RuntimeError as exc:
            raise CollectiveError(self._explain(exc)) from exc
        finally:
            with self.lock:
                self.status.in_flight = False
            self.seconds += time.monotonic() - t0

    def _explain(self, exc: Exception) -> str:
        dead = self.peer_check() if callable(self.peer_check) else ""
        if dead:
            return f"tensor-parallel collective #{self.status.seq} ({self.status.op}) failed: {dead}"
        # give the watchdog a moment to finish the report it is collecting
        deadline = time.monotonic() + 5.0
        while not self.diagnosis and time.monotonic() < deadline:
            time.sleep(0.05)
        return (f"tensor-parallel collective #{self.status.seq} ({self.status.op}) on rank "
                f"{self.rank} failed: {self.diagnosis or exc}")

    def all_reduce(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place."""
        self._begin(kind, "all_reduce", t)
        self._wait(dist.all_reduce(t, async_op=True))
        return t

    def broadcast(self, t: torch.Tensor, kind: str, *, control: bool = False,
                  idle: bool = False) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t``, in place; ``control``: on the control group."""
        self._begin(kind, "broadcast", t, idle=idle)
        group = self.control_group if control else None
        self._wait(dist.broadcast(t, src=0, group=group, async_op=True))  # type: ignore[arg-type]
        return t

    def gather(self, t: torch.Tensor, kind: str) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape) on rank 0, in rank order; None elsewhere."""
        self._begin(kind, "gather", t)
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        self._wait(dist.gather(t, parts, dst=0, async_op=True))
        return parts

    def snapshot(self) -> dict[str, OpCount]:
        return {k: OpCount(v.calls, v.bytes) for k, v in self.counts.items()}
