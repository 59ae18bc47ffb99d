"""Start and stop the processes of a tensor-parallel group, from rank 0 (the engine's process).

Two launches:
- **spawned** (``LLM(..., tensor_parallel_size=N)``, ``fitserve generate|serve --tp N``): rank 0
  is the engine process; it starts ranks 1..N-1 as ``python -m fitserve.dist.worker`` on this
  machine, and they meet at a TCP rendezvous on 127.0.0.1.
- **external** (torchrun, one or several nodes): every process runs the same command with
  RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set; rank 0 becomes the engine, every other
  rank becomes a worker inside the Engine constructor and exits when rank 0 shuts down.

The group has two gloo process groups: the default one for the model's collectives (timeout:
the watchdog's, so a stall fails) and a control one with a long timeout for the step plans (a
worker waits there while the engine is idle).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from fitserve import envs
from fitserve.config import EngineConfig
from fitserve.dist.comm import Collectives
from fitserve.dist.step_message import SHUTDOWN, STEP, encode_startup, encode_step, header
from fitserve.dist.watchdog import Watchdog, watchdog_seconds
from fitserve.kv.group import KVGroup
from fitserve.types import SchedulerOutput

log = logging.getLogger("fitserve.dist")
CONTROL_TIMEOUT = timedelta(days=365)
WORKER_MODULE = "fitserve.dist.worker"  # what the spawned ranks run (`python -m`); tests swap it


def launched_externally(tp: int) -> bool:
    """True under torchrun (or any launcher that sets RANK and WORLD_SIZE = tp)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == tp > 1


def collective_timeout() -> timedelta:
    # NOTE: past the watchdog's deadline, so the report is in before the collective fails
    return timedelta(seconds=2 * watchdog_seconds() + 5)


def init_group(rank: int, world: int, init_method: str) -> tuple[Collectives, Watchdog]:
    """Join the process group; the Collectives of this rank and its running watchdog."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=collective_timeout())
    comm = Collectives(rank, world)
    comm.control_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    # NOTE: the default group's key-value store (private in torch, stable for years) carries
    # the watchdog's reports: it is reachable from every node, and not stuck with the collectives
    store = dist.distributed_c10d._get_default_store()
    dog = Watchdog(comm, store, timeout_s=watchdog_seconds())
    dog.start()
    return comm, dog


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_config_json(cfg: EngineConfig, model_path: str) -> str:
    d = cfg.flat_kwargs()
    d["model"] = model_path
    return json.dumps(d)


class TPGroup:
    """Rank 0's handle on the group: the workers it spawned, the control channel, shutdown."""

    def __init__(self, cfg: EngineConfig, tp: int, model_path: str) -> None:
        self.tp = tp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.closed = False
        if launched_externally(tp):  # ranks > 0 never get here: start_tensor_parallel
            init = "env://"
        else:
            port = _free_port()
            init = f"tcp://127.0.0.1:{port}"
            threads = max(1, (os.cpu_count() or 1) // tp)
            for rank in range(1, tp):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank),
                           OMP_NUM_THREADS=str(threads), **{envs.FITSERVE_TP_PARENT.name: str(os.getpid())})
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", WORKER_MODULE, "--init", init, "--config",
                     worker_config_json(cfg, model_path)], env=env))
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            torch.set_num_threads(threads)
        try:
            self.comm, self.watchdog = init_group(0, tp, init)
        except Exception:
            self.kill()
            raise
        self.comm.peer_check = self.dead_worker

    def dead_worker(self) -> str:
        """A message naming a spawned worker that exited, or ""."""
        time.sleep(0.2)  # a peer's socket closes a moment before its exit status is in
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                return f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with status {code}"
        return ""

    def send_startup(self, num_blocks: int, groups: list[KVGroup]) -> None:
        """The KV pool rank 0 sized (and a hybrid model's KV groups): its length, then it."""
        # NOTE: unwatched (idle): the workers may still be loading the model; one that fails
        # to load exits, which breaks this broadcast at once
        payload = encode_startup(num_blocks, groups)
        self.comm.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), "startup",
                            control=True, idle=True)
        self.comm.broadcast(payload, "startup", control=True)

    def send_step(self, out: SchedulerOutput) -> None:
        payload = encode_step(out)
        self.comm.broadcast(header(STEP, payload.numel()), "control", control=True)
        self.comm.broadcast(payload, "control", control=True)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell the workers to exit, wait for them (kill after ``timeout_s``), leave the group."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.dead_worker():
                self.comm.broadcast(header(SHUTDOWN), "control", control=True)
        except Exception as exc:
            log.warning("tensor-parallel shutdown: %s", exc)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        self.watchdog.stop()
        with contextlib.suppress(Exception):  # a broken group cannot always be torn down
            dist.destroy_process_group()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()


