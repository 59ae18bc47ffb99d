"""The bf16 attention on AMX-BF16 tiles against the default VDPBF16PS tile, op by op.

    PYTHONPATH=$PWD python benchmarks/bench_attention_amx.py [--threads 2] [--runs 5]

3 KV heads of 64 (SmolLM2-135M's) with G query heads each (--groups: SmolLM2's 3, and the
larger groups of bigger models), bf16 q and cache, blocks of 16. For each case the two tiles
alternate in one process (``paged_attention.set_amx``), medians of --runs timed calls each
(wall clock): the prefill op over a 2,048-token prompt (ms and GFLOP/s of the causal QK^T +
PV), and the decode op at W2's 32 x 256 keys and at one 4,096-key sequence (ns per key and KV
head; caches stay in cache). Prints each tile's figure and AMX / default: where the decode
ratio crosses 1 is what "auto" (paged_attention.AMX_MIN_GROUP) follows. Exits early where this
CPU or build has no AMX-BF16 tile.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_decode_attention_stream import decode_inputs  # noqa: E402
from bench_engine import cpu_description  # noqa: E402
from timing import median_seconds  # noqa: E402

from fitserve.kernels.cpu import paged_attention as pa  # noqa: E402

HKV, D, BLOCK = 3, 64, 16


def both(fn, runs: int) -> tuple[float, float]:
    """Median seconds of fn on the AMX tile, then on the default tile (twice each, alternated:
    the lower median of each kept)."""
    amx, dflt = [], []
    for _ in range(2):
        pa.set_amx("all")
        amx.append(median_seconds(fn, runs))
        pa.set_amx("off")
        dflt.append(median_seconds(fn, runs))
    return min(amx), min(dflt)


def prefill(tokens: int, group: int, runs: int) -> None:
    hq = HKV * group
    nblk = -(-tokens // BLOCK)
    k = torch.randn(HKV, nblk, BLOCK, D).bfloat16()
    v = torch.randn(HKV, nblk, BLOCK, D).bfloat16()
    q = torch.randn(tokens, hq, D).bfloat16()
    table = torch.randperm(nblk).to(torch.int32)
    a, b = both(lambda: pa.paged_prefill_attention(q, k, v, table, 0, D ** -0.5), runs)
    flops = 2 * 2 * hq * D * tokens * (tokens + 1) / 2
    print(f"G {group:2d} prefill {tokens} tokens: AMX {a * 1e3:7.1f} ms ({flops / a / 1e9:5.0f} GFLOP/s), "
          f"default {b * 1e3:7.1f} ms ({flops / b / 1e9:5.0f} GFLOP/s); AMX / default time "
          f"{a / b:.2f}")


def decode(batch: int, keys: int, group: int, runs: int) -> None:
    q, tables, lens, [(k, v)] = decode_inputs(batch, keys, HKV * group, HKV, D, 1, BLOCK)
    a, b = both(lambda: pa.paged_decode_attention(q, k, v, tables, lens, D ** -0.5), runs * 4)
    items = batch * keys * HKV
    print(f"G {group:2d} decode {batch} x {keys} keys: AMX {a / items * 1e9:5.1f} ns per key and KV head, "
          f"default {b / items * 1e9:5.1f}; AMX / default time {a / b:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--groups", default="3,4,6,8,16", help="query heads per KV head")
    args = ap.parse_args()
    print(f"CPU: {cpu_description()}; threads {args.threads}")
    was = pa.amx_mode()
    if pa.set_amx("all") != "all":
        print("no AMX-BF16 attention tile on this CPU / build: nothing to compare")
        return
    torch.set_num_threads(args.threads)
    try:
        for group in (int(x) for x in args.groups.split(",")):
            prefill(args.tokens, group, args.runs)
            decode(32, 256, group, args.runs)
            decode(1, 4096, group, args.runs)
    finally:
        pa.set_amx(was)


if __name__ == "__main__":
    main()
