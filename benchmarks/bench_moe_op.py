"""The expert op alone (fitserve::moe_experts_ggml): GB/s of the active experts' bytes at a few
tokens per step, beside a plain read of the same bytes, caches evicted.

    .venv/bin/python benchmarks/bench_moe_op.py                    # bench_moe's default shape
    .venv/bin/python benchmarks/bench_moe_op.py --tokens 1 2 8 --threads 1 2 --calls 300
    .venv/bin/python benchmarks/bench_moe_op.py --block      # one token's whole block: 1 op vs 3
    .venv/bin/python benchmarks/bench_moe_op.py --hot --threads 1   # the op's own work (cached)

Weights: bench_moe.py's default layer (hidden 1024, 64 experts top-8, expert intermediate 256),
gate_up Q4_K and down Q6_K / Q4_K (a Q4_K_M file's two kinds of layer), random blocks with a sane
fp16 scale, --layers distinct layers (256 MB+ together: far over the L3) cycled so each call's
experts come from DRAM, as in a decode step. Each call draws fresh top-k routing (distinct
experts per token). The plain read sums the same active experts' bytes as int64 (torch, same
threads), one call per layer in the same order. Method: the two alternate in blocks of --calls
calls, --rounds times; one thread is timed by ``time.thread_time`` (this thread's CPU: robust on a
loaded host), more threads by wall time (loaded-host figures are then a floor). Medians printed,
with the load average.

``--hot``: one layer and one routing for every call, so the active experts' bytes stay in the
caches: the op's own decode and dot work, without DRAM (set beside the default run's figure, how
much of the op's time is memory stalls).

``--block``: one token's whole MoE block (router [E, H] bf16 per layer, routing, experts) as
fitserve::moe_block_ggml (one parallel region) against the three ops it fuses (bf16_gemv,
moe_route, moe_experts_ggml), alternated the same way; both read the same bytes and give the same
bits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fitserve.kernels.cpu.dense_gemv import bf16_gemv_available
from fitserve.kernels.cpu.ggml_blocks import _BLOCK
from fitserve.kernels.cpu.moe_experts import moe_block_ggml, moe_experts_ggml, moe_route

H, E, K_TOP, INTER = 1024, 64, 8, 256
# byte offset of the fp16 super-block scale d (and of dmin, Q4_K) in each block
SCALE_AT = {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_K": (0, 2)}


def random_stack(t: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [E, rows, bytes] of random ggml blocks whose fp16 scales are 2^-8 (finite)."""
    block, size = _BLOCK[t]
    w = torch.randint(0, 256, (E, rows, cols // block, size), dtype=torch.uint8, generator=gen)
    for at in SCALE_AT[t]:
        w[..., at], w[..., at + 1] = 0x00, 0x1C  # fp16 0x1C00 = 2^-8
    return w.view(E, rows, -1).contiguous()


def routing(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:K_TOP] for _ in range(n)])
    w = torch.rand(n, K_TOP, generator=gen)
    return ids, w / w.sum(-1, keepdim=True)


def timed(fn, calls: int, wall: bool) -> float:  # type: ignore[no-untyped-def]
    clock = time.perf_counter if wall else time.thread_time
    t = clock()
    for i in range(calls):
        fn(i)
    return (clock() - t) / calls


def measure(layers: list[tuple[torch.Tensor, torch.Tensor]], down_t: str, n: int,
            threads: list[int], calls: int, rounds: int, gen: torch.Generator,
            hot: bool = False) -> None:
    """Print one line per thread count: the op and the plain read on n tokens per call."""
    x = torch.randn(n, H).bfloat16()
    routes = [routing(n, gen)] * calls if hot else [routing(n, gen) for _ in range(calls)]
    if hot:
        layers = layers[:1]
    per_expert = layers[0][0][0].numel() + layers[0][1][0].numel()
    nbytes = statistics.mean(len(set(ids.flatten().tolist())) * per_expert for ids, _ in routes)

    def op(i: int) -> None:
        gu, dn = layers[i % len(layers)]
        ids, w = routes[i]
        moe_experts_ggml(x, ids, w, gu, "Q4_K", dn, down_t)

    def read(i: int) -> None:
        gu, dn = layers[i % len(layers)]
        for e in routes[i][0].flatten().unique().tolist():
            gu[e].view(-1).view(torch.int64).sum()
            dn[e].view(-1).view(torch.int64).sum()

    for t in threads:
        torch.set_num_threads(t)
        op(0), read(0)
        ts: dict[str, list[float]] = {"op": [], "read": []}
        for _ in range(rounds):
            ts["op"].append(timed(op, calls, t > 1))
            ts["read"].append(timed(read, calls, t > 1))
        t_op, t_read = (statistics.median(v) for v in ts.values())
        print(f"{down_t:<6}{n:>3}{t:>4}{nbytes / 1e6:10.2f}{t_op * 1e6:9.1f}"
              f"{nbytes / t_op / 1e9:9.1f}{nbytes / t_read / 1e9:10.1f}{t_read / t_op:8.2f}")


def measure_block(layers: list[tuple[torch.Tensor, torch.Tensor]], down_t: str,
                  threads: list[int], calls: int, rounds: int, gen: torch.Generator) -> None:
    """Print one line per thread count: the fused block and the three ops, one token per call."""
    assert bf16_gemv_available(), "--block needs the dense_gemv build"
    routers = [(0.05 * torch.randn(E, H, generator=gen)).bfloat16() for _ in layers]
    xs = [torch.randn(1, H, generator=gen).bfloat16() for _ in range(calls)]

    def fused(i: int) -> None:
        gu, dn = layers[i % len(layers)]
        moe_block_ggml(xs[i], routers[i % len(layers)], K_TOP, True, gu, "Q4_K", dn, down_t)

    def three(i: int) -> None:
        gu, dn = layers[i % len(layers)]
        logits = torch.ops.fitserve_dense.bf16_gemv(xs[i], routers[i % len(layers)], None)
        w, ids = moe_route(logits, K_TOP, True)
        moe_experts_ggml(xs[i], ids, w, gu, "Q4_K", dn, down_t, out_x_dtype=True)

    for t in threads:
        torch.set_num_threads(t)
        fused(0), three(0)
        ts: dict[str, list[float]] = {"fused": [], "three": []}
        for _ in range(rounds):
            ts["fused"].append(timed(fused, calls, t > 1))
            ts["three"].append(timed(three, calls, t > 1))
        t_f, t_3 = (statistics.median(v) for v in ts.values())
        print(f"{down_t:<6}{t:>4}{t_3 * 1e6:12.1f}{t_f * 1e6:12.1f}{t_3 / t_f:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--down", nargs="+", default=["Q6_K", "Q4_K"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--calls", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hot", action="store_true", help="one layer and routing: experts cached")
    ap.add_argument("--block", action="store_true", help="one token's block: 1 op vs 3 (doc)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    if args.block:
        print(f"one token's MoE block: hidden {H}, {E} experts top-{K_TOP}; load "
              f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}")
        print(f"{'down':<6}{'thr':>4}{'3 ops us':>12}{'fused us':>12}{'3/fused':>8}")
        for down_t in args.down:
            layers = [(random_stack("Q4_K", 2 * INTER, H, gen),
                       random_stack(down_t, H, INTER, gen)) for _ in range(args.layers)]
            measure_block(layers, down_t, args.threads, args.calls, args.rounds, gen)
        print("one thread: CPU time of this thread; two: wall time (a loaded host lowers them)")
        return
    print(f"expert op alone{' (hot: one layer and routing, cached)' if args.hot else ''}: "
          f"hidden {H}, {E} experts top-{K_TOP}, intermediate {INTER}; "
          f"load {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"{'down':<6}{'N':>3}{'thr':>4}{'active MB':>10}{'op us':>9}{'op GB/s':>9}"
          f"{'read GB/s':>10}{'op/read':>8}")
    for down_t in args.down:
        layers = [(random_stack("Q4_K", 2 * INTER, H, gen), random_stack(down_t, H, INTER, gen))
                  for _ in range(args.layers)]
        for n in args.tokens:
            measure(layers, down_t, n, args.threads, args.calls, args.rounds, gen, args.hot)
    print("one thread: CPU time of this thread; more: wall time (a loaded host lowers them)")


if __name__ == "__main__":
    main()
