"""A tensor-parallel worker (ranks 1..N-1): load, shard, then run rank 0's step plans.

Spawned by fitserve.dist.group (``python -m fitserve.dist.worker --init URL --config JSON``),
or started by torchrun through the Engine constructor. It holds no scheduler and samples
nothing: each step it receives the plan (fitserve.dist.step_message), runs its shard of the
forward (whose all-reduces meet rank 0's) and takes part in the logits gather.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

import torch

from fitserve import envs
from fitserve.config import EngineConfig
from fitserve.dist.comm import Collectives
from fitserve.dist.layout import rank_spec
from fitserve.dist.step_message import HEADER_LEN, SHUTDOWN, decode_startup, decode_step
from fitserve.dist.tp_model import TPCausalLM, build_tp_model
from fitserve.runner.model_runner import ModelRunner, decode_rows_first, logits_rows

log = logging.getLogger("fitserve.dist")
def _watch_parent() -> None:
    """Spawned workers exit when the engine process is gone (its collectives would fail too,
    but an idle worker waits on the control channel for a long time)."""
    parent = envs.FITSERVE_TP_PARENT()
    if not parent:
        return

    def loop() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=loop, name="fitserve-tp-parent", daemon=True).start()


def build_worker(cfg: EngineConfig, rank: int, world: int, comm: Collectives
                 ) -> tuple[TPCausalLM, ModelRunner]:
    from fitserve.ledger.formats import resolve_engine_weights
    from fitserve.loading import load_model
    from fitserve.runner.placement import (
        check_max_model_len,
        release_freed_host_memory,
        resolve_device,
        resolve_dtype,
    )

    device = resolve_device(cfg.device)
    choice, dtype_arg = resolve_engine_weights(cfg.weights, cfg.quantization, cfg.dtype)
    dtype = resolve_dtype(dtype_arg, device)
    loaded = load_model(cfg.model, dtype=dtype, weights=choice)
    max_len = check_max_model_len(cfg.max_model_len, loaded.spec)
    model = build_tp_model(loaded.spec, loaded.weights, tp=world, rank=rank, comm=comm,
                           dtype=dtype, device=device, max_positions=max_len)
    loaded.weights = {}
    release_freed_host_memory()
    length = comm.broadcast(torch.zeros(1, dtype=torch.int64), "startup", control=True,
                            idle=True)
    num_blocks, groups = decode_startup(comm.broadcast(
        torch.zeros(int(length[0]), dtype=torch.int64), "startup", control=True))
    runner = ModelRunner(model, rank_spec(loaded.spec, world, rank),  # type: ignore[arg-type]
                         num_blocks=num_blocks, block_size=cfg.cache.block_size, kv_dtype=dtype,
                         device=device, compile_decode=False, kv_cache_dtype=cfg.cache.kv_cache_dtype,
                         kv_cache_scales=cfg.cache.kv_cache_scales, kv_groups=groups)
    return model, runner


def serve_steps(comm: Collectives, model: TPCausalLM, runner: ModelRunner) -> None:
    """Run rank 0's step plans until it says SHUTDOWN."""
    while True:
        head = comm.broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64), "control",
                              control=True, idle=True)
        if int(head[0]) == SHUTDOWN:
            return
        payload = comm.broadcast(torch.zeros(int(head[1]), dtype=torch.int64), "control",
                                 control=True)
        plan = decode_step(payload)
        with torch.inference_mode():
            for g, pairs in enumerate(plan.group_block_copies):
                if pairs:
                    runner.copy_blocks(pairs, group=g)
            if plan.block_copies and not plan.group_block_copies:
                runner.copy_blocks(plan.block_copies)
            chunks = decode_rows_first(plan.chunks)
            hidden = runner.forward_chunks(chunks)
            rows, _, verify = logits_rows(chunks)
            if rows:
                model.compute_logits(hidden[torch.tensor(rows)])
            if verify:
                raise RuntimeError("speculative decoding does not run under tensor parallelism")


def run_worker(cfg: EngineConfig, rank: int, world: int, init: str) -> int:
    from fitserve.dist.group import init_group

    _watch_parent()
    comm, dog = init_group(rank, world, init)
    try:
        model, runner = build_worker(cfg, rank, world, comm)
        serve_steps(comm, model, runner)
    except Exception as exc:
        log.error("tensor-parallel worker rank %d: %s", rank, exc)
        print(f"fitserve tp worker rank {rank}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        dog.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fitserve.dist.worker", allow_abbrev=False)
    p.add_argument("--init", required=True, help="the rendezvous, e.g. tcp://127.0.0.1:29500")
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = EngineConfig(**json.loads(args.config))
    return run_worker(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.init)


if __name__ == "__main__":
    sys.exit(main())
