"""The collective watchdog: when a collective runs past its timeout, every rank reports where
it is, and rank 0 names the rank that is behind.

Each rank runs one daemon thread. Reports travel through the process group's key-value store
(torch.distributed's TCPStore on rank 0), not through the collectives that are stuck::

    any rank:  in collective #k for > timeout   -> adds 1 to the counter fitserve/hang
    every rank: sees the counter grow to e      -> sets  fitserve/report/<e>/<rank> = JSON
                {rank, pid, host, seq, op, in_flight, idle, seconds, stack of the calling thread}
    rank 0:    reads every report               -> the rank(s) with the lowest sequence number
                                                   are behind; the diagnosis names them

A rank that never reaches collective #k (stalled in Python, a slow link, a swapped-out host)
has started fewer collectives than the ranks waiting in #k: that is what "behind" means.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from fitserve import envs
from fitserve.dist.comm import Collectives

log = logging.getLogger("fitserve.dist")
HANG_KEY = "fitserve/hang"
REPORT_KEY = "fitserve/report/{}/{}"  # episode, rank


def watchdog_seconds() -> float:
    return envs.FITSERVE_TP_WATCHDOG_S()


@dataclass(frozen=True, slots=True)
class RankReport:
    rank: int
    pid: int
    host: str
    seq: int
    op: str
    in_flight: bool
    idle: bool
    seconds: float  # in the current collective (in flight) or since the last one started
    stack: str

    def where(self) -> str:
        if self.in_flight:
            state = "idle, waiting for a step" if self.idle else f"waiting {self.seconds:.1f} s"
            return f"in collective #{self.seq} ({self.op}), {state}"
        if not self.seq:
            return "not in a collective; none started yet"
        return f"not in a collective; last started #{self.seq} ({self.op}) {self.seconds:.1f} s ago"


def report_of(comm: Collectives) -> RankReport:
    with comm.lock:
        s = comm.status
        seq, op, in_flight, idle, started, thread = (s.seq, s.op, s.in_flight, s.idle, s.started,
                                                     s.thread)
    frame = sys._current_frames().get(thread or threading.main_thread().ident or 0)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
    return RankReport(comm.rank, os.getpid(), socket.gethostname(), seq, op, in_flight, idle,
                      time.monotonic() - started, stack)


def diagnose(reports: dict[int, RankReport], world_size: int) -> str:
    """Name the rank(s) behind: the fewest collectives started (missing reports first)."""
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        return (f"rank(s) {', '.join(map(str, missing))} sent no report: the process is gone "
                "or hung outside Python (its watchdog thread cannot run)")
    low = min(r.seq for r in reports.values())
    behind = sorted(r.rank for r in reports.values() if r.seq == low)
    ahead = sorted(set(reports) - set(behind))
    if not ahead:  # all at the same collective: one of them did not enter it
        behind = sorted(r.rank for r in reports.values() if not r.in_flight) or behind
    lines = [f"rank {', '.join(map(str, behind))} is behind: "
             + "; ".join(f"rank {r}: {reports[r].where()}" for r in sorted(reports))]
    for r in behind:
        rep = reports[r]
        lines.append(f"rank {r} (pid {rep.pid} on {rep.host}) is at:\n{rep.stack.rstrip()}")
    return "\n".join(lines)


class Watchdog(threading.Thread):
    """One per rank (see the module docstring)."""

    def __init__(self, comm: Collectives, store: Any, *, timeout_s: float,
                 poll_s: float = 0.2) -> None:
        super().__init__(name=f"fitserve-tp-watchdog-{comm.rank}", daemon=True)
        self.comm, self.store = comm, store
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._stop = threading.Event()
        self.episode = 0  # the last hang episode this rank reported
        self.flagged_seq = -1  # the collective this rank last raised an episode for

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._tick()
            except Exception as exc:  # the store went away: the group is shutting down
                log.debug("watchdog on rank %d stops: %s", self.comm.rank, exc)
                return

    def _tick(self) -> None:
        s = self.comm.status
        if (s.in_flight and not s.idle and time.monotonic() - s.started > self.timeout_s
                and s.seq != self.flagged_seq):
            self.flagged_seq = s.seq
            self.store.add(HANG_KEY, 1)  # a new episode: every rank reports again
        episode = int(self.store.add(HANG_KEY, 0))  # adding 0 reads the counter
        if episode <= self.episode:
            return
        self.episode = episode
        rep = report_of(self.comm)
        self.store.set(REPORT_KEY.format(episode, self.comm.rank), json.dumps(_as_dict(rep)))
        if self.comm.rank == 0:
            self.comm.diagnosis = diagnose(self._collect(episode), self.comm.world_size)
            log.error("tensor-parallel hang (watchdog %.0f s):\n%s", self.timeout_s,
                      self.comm.diagnosis)

    def _collect(self, episode: int, wait_s: float = 3.0) -> dict[int, RankReport]:
        out: dict[int, RankReport] = {}
        deadline = time.monotonic() + wait_s
        pending = set(range(self.comm.world_size))
        while pending and time.monotonic() < deadline:
            for r in sorted(pending):
                key = REPORT_KEY.format(episode, r)
                if self.store.check([key]):
                    out[r] = RankReport(**json.loads(self.store.get(key)))
                    pending.discard(r)
            time.sleep(0.05)
        return out


def _as_dict(rep: RankReport) -> dict[str, object]:
    return {k: getattr(rep, k) for k in rep.__slots__}
