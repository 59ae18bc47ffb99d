"""All-reduce bandwidth of a torch.distributed group: the measurement of a slow-link bisection.

    torchrun --nproc-per-node 2 benchmarks/allreduce_bench.py [--bytes 64M] [--iters 20]
    torchrun --nnodes 2 ... benchmarks/allreduce_bench.py --backend nccl   # GPUs

Prints rank 0's median time per all-reduce, the algorithm bandwidth (bytes / time) and the
bus bandwidth (x 2 (p - 1) / p, what each rank's link carries in a ring: compare it with the
link's rate). Run it on all ranks, then on each half of a slow group at the same time, and
recurse into the slow half (README: Hang diagnosis).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from fitserve.ledger.units import parse_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bytes", default="64M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", default="gloo")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, p = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if args.backend == "nccl" else "cpu"
    n = parse_bytes(args.bytes) // 4
    t = torch.ones(n, dtype=torch.float32, device=device)
    times = []
    for i in range(args.iters + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if device != "cpu":
            torch.cuda.synchronize()
        if i >= 2:  # two warm-up calls
            times.append(time.perf_counter() - t0)
    if rank == 0:
        s = statistics.median(times)
        algbw = n * 4 / s
        print(f"{p} ranks, {n * 4 / 2**20:.1f} MiB: {s * 1e3:.3f} ms per all-reduce, algbw "
              f"{algbw / 1e9:.3f} GB/s, busbw {algbw * 2 * (p - 1) / p / 1e9:.3f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
