"""The paged decode attention's time per key and KV head, K/V in cache vs from DRAM.

    PYTHONPATH=$PWD python benchmarks/bench_decode_attention_stream.py [--blocks 16,64]

One thread, timed by its CPU clock; SmolLM2-135M's heads (9 query / 3 KV heads of 64), bf16
cache, blocks of 16 interleaved as W2's sequences get them. Each case calls the op on `layers`
caches in turn: one layer's cache stays in cache, 30 or 60 layers' caches come from DRAM, so
the two rows of a batch size show the kernel's own work and how near it streams to it. Prints
ns per (key, KV head) and the K/V bytes read per second; ``--blocks`` repeats every case at each
KV block size (tokens per block; the engine's default is 16). ``--block-order`` instead times
one 4,096-key sequence whose blocks sit in a pool of the engine's size in ascending, descending
or random order (a fresh engine hands a sequence ascending ids; a long-running server's freed
and reused blocks scatter), 30 layers' caches, wall clock at ``--threads``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_engine import cpu_description  # noqa: E402

from fitserve.kernels.cpu.paged_attention import paged_decode_attention  # noqa: E402

CASES = ((8, 256, 1, 300), (8, 256, 60, 10), (32, 256, 30, 10), (1, 4096, 1, 300),
         (1, 4096, 30, 20))  # (sequences, keys, layers' caches, repeats)


def decode_inputs(batch: int, keys: int, hq: int, hkv: int, d: int, layers: int,
                  block: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """(q, block tables, lengths, [(k_cache, v_cache)] x layers) of a decode attention call:
    ``batch`` sequences of ``keys`` keys, bf16, blocks interleaved as W2's sequences growing
    together get them (block j of sequence s is the (j x batch + s)-th)."""
    nblk = -(-keys // block)
    q = torch.randn(batch, hq, d).bfloat16()
    tables = torch.arange(batch * nblk, dtype=torch.int32).reshape(nblk, batch).T.contiguous()
    lens = torch.full((batch,), keys, dtype=torch.int32)
    caches = [(torch.randn(hkv, batch * nblk, block, d).bfloat16(),
               torch.randn(hkv, batch * nblk, block, d).bfloat16()) for _ in range(layers)]
    return q, tables, lens, caches


def case(batch: int, keys: int, layers: int, reps: int, block: int = 16) -> None:
    hkv, d = 3, 64
    q, tables, lens, caches = decode_inputs(batch, keys, 9, hkv, d, layers, block)

    def step() -> None:
        for k, v in caches:
            paged_decode_attention(q, k, v, tables, lens, d ** -0.5)

    for _ in range(3):
        step()
    t = time.thread_time()
    for _ in range(reps):
        step()
    dt = (time.thread_time() - t) / reps / layers
    items = batch * hkv * keys
    print(f"block {block:3d}, {batch:3d} sequences x {keys:5d} keys, {layers:2d} layers' caches: "
          f"{dt * 1e6:8.1f} us a layer, {dt / items * 1e9:5.1f} ns per key and KV head, "
          f"K/V {2 * items * d * 2 / dt / 1e9:5.1f} GB/s")


def block_orders(threads: int, pool_blocks: int = 2912, keys: int = 4096, layers: int = 30,
                 reps: int = 15) -> None:
    """One sequence's decode attention with its block table in each order (median wall time)."""
    torch.set_num_threads(threads)
    hkv, d, block = 3, 64, 16
    q, _, lens, _ = decode_inputs(1, keys, 9, hkv, d, 1, block)
    nblk = -(-keys // block)
    caches = [(torch.randn(hkv, pool_blocks, block, d).bfloat16(),
               torch.randn(hkv, pool_blocks, block, d).bfloat16()) for _ in range(layers)]
    gen = torch.Generator().manual_seed(0)
    orders = {"ascending": torch.arange(nblk),
              "descending": torch.arange(pool_blocks - 1, pool_blocks - 1 - nblk, -1),
              "random": torch.randperm(pool_blocks, generator=gen)[:nblk]}
    for name, ids in orders.items():
        table = ids.to(torch.int32).reshape(1, nblk)

        def step(table: torch.Tensor = table) -> None:
            for k, v in caches:
                paged_decode_attention(q, k, v, table, lens, d ** -0.5)

        for _ in range(3):
            step()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) / layers)
        dt = sorted(times)[reps // 2]
        print(f"{threads} thread(s), 1 x {keys} keys, blocks {name:10s}: {dt * 1e6:7.1f} us a layer, "
              f"K/V {2 * hkv * keys * d * 2 / dt / 1e9:5.1f} GB/s")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="16", help="KV block sizes (tokens), comma-separated")
    ap.add_argument("--block-order", action="store_true",
                    help="one sequence's blocks ascending / descending / random (wall clock)")
    ap.add_argument("--threads", type=int, default=2, help="threads for --block-order")
    args = ap.parse_args()
    print(f"CPU: {cpu_description()}")
    if args.block_order:
        block_orders(args.threads)
        return
    torch.set_num_threads(1)
    for block in (int(b) for b in args.blocks.split(",")):
        for c in CASES:
            case(*c, block=block)


if __name__ == "__main__":
    main()
