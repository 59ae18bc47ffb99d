"""Shape-by-shape attention timing table on this CPU, with correctness checks in the same run.

Method: fp32 inputs; every variant first runs once on the ragged inputs and is compared with the
float64 naive reference (max abs error; a wrong kernel is printed as WRONG, never as fast); then
``--warmup`` untimed calls and ``--repeats`` timed calls with time.perf_counter, median reported.
PyTorch CPU kernels execute eagerly and synchronously (no lazy work is queued), and each timed
call ends by reading one output element (``.item()``), so nothing is left to run after the clock
stops. Thread count: torch.set_num_threads(--threads), printed in the header.

Variants (all GQA-correct, bottom-right causal, ragged batches):
  naive       per sequence, K/V expanded to every query head, full fp32 score matrix
  tiled       online-softmax varlen kernel with K/V expanded per query head (no GQA folding)
  gqa-folded  the same kernel with the G query heads of a KV head packed as one matrix
  split-kv    decode only: key axis cut into P splits (wave-efficiency rule), exact LSE merge
  paged       the engine interface (block table, block_size 16)
  sdpa        torch.nn.functional.scaled_dot_product_attention per sequence (enable_gqa)

Run: .venv/bin/python benchmarks/bench_kernels.py [--threads N] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fitserve.kernels.counters import AttnShape, naive_forward, split_kv_decode, tiled_forward
from fitserve.kernels.dispatch import ShapeClass, choose_attention_impl, classify
from fitserve.kernels.masks import bottom_right_positions, visible_mask
from fitserve.kernels.paged import paged_attention
from fitserve.kernels.reference import naive_attention
from fitserve.kernels.split_kv import choose_num_splits
from fitserve.kernels.split_kv import split_kv_decode as split_kv_kernel
from fitserve.kernels.varlen import varlen_attention

HQ, HKV, D = 8, 2, 64
G = HQ // HKV


@dataclass(slots=True)
class Case:
    """One ragged batch: per-sequence query and key counts."""

    name: str
    q_lens: list[int]
    k_lens: list[int]


def make_cases(quick: bool) -> list[Case]:
    """Prefill and decode shapes, batch 1 and 32, several lengths, ragged caches."""
    gen = torch.Generator().manual_seed(0)
    ragged_k = torch.randint(256, 2049, (32,), generator=gen).tolist()
    ragged_p = torch.randint(64, 129, (32,), generator=gen).tolist()
    cases = [Case("prefill b=1 L=256", [256], [256]),
             Case("prefill b=32 L<=128 ragged", ragged_p, ragged_p),
             Case("decode b=1 S=1024", [1], [1024]),
             Case("decode b=32 S<=2048 ragged", [1] * 32, ragged_k)]
    if not quick:
        cases += [Case("prefill b=1 L=1024", [1024], [1024]),
                  Case("chunk b=1 T=128 S=2048", [128], [2048]),
                  Case("decode b=1 S=8192", [1], [8192])]
    return cases


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def build_variants(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, workers: int
                   ) -> dict[str, Callable[[], torch.Tensor]]:
    """Callables returning [total_q, HQ, D] for the packed inputs of ``case``."""
    cq, ck = _cu(case.q_lens), _cu(case.k_lens)
    k_exp, v_exp = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    qs = [q[a:b] for a, b in zip(cq[:-1].tolist(), cq[1:].tolist(), strict=True)]
    ks = [k[a:b] for a, b in zip(ck[:-1].tolist(), ck[1:].tolist(), strict=True)]
    vs = [v[a:b] for a, b in zip(ck[:-1].tolist(), ck[1:].tolist(), strict=True)]
    masks = [visible_mask(*bottom_right_positions(len(x), len(y)), causal=True)
             for x, y in zip(qs, ks, strict=True)]

    def naive() -> torch.Tensor:
        outs = []
        for qi, ki, vi, mi in zip(qs, ks, vs, masks, strict=True):
            s = torch.matmul(qi.transpose(0, 1), ki.repeat_interleave(G, 1).permute(1, 2, 0))
            p = torch.softmax((s * D ** -0.5).masked_fill(~mi, float("-inf")), dim=-1)
            outs.append(torch.matmul(p, vi.repeat_interleave(G, 1).transpose(0, 1)).transpose(0, 1))
        return torch.cat(outs)

    def sdpa() -> torch.Tensor:
        outs = []
        for qi, ki, vi, mi in zip(qs, ks, vs, masks, strict=True):
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1),
                                               vi.transpose(0, 1), attn_mask=mi, enable_gqa=True)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "naive": naive,
        "tiled": lambda: varlen_attention(q, k_exp, v_exp, cq, ck)[0],
        "gqa-folded": lambda: varlen_attention(q, k, v, cq, ck)[0],
        "sdpa": sdpa,
    }
    bs = 16
    n_blocks = [-(-n // bs) for n in case.k_lens]
    k_cache = torch.zeros(sum(n_blocks) + 1, bs, HKV, D)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(len(case.k_lens), max(n_blocks), dtype=torch.int32)
    page = 1
    for b, n in enumerate(case.k_lens):
        for j in range(n_blocks[b]):
            rows = slice(int(ck[b]) + j * bs, int(ck[b]) + min(n, (j + 1) * bs))
            k_cache[page, : rows.stop - rows.start] = k[rows]
            v_cache[page, : rows.stop - rows.start] = v[rows]
            table[b, j] = page
            page += 1
    seq_lens = torch.tensor(case.k_lens)
    variants["paged"] = lambda: paged_attention(q, k_cache, v_cache, table, seq_lens, cq,
                                                scale=D ** -0.5)  # type: ignore[return-value]
    if all(t == 1 for t in case.q_lens):
        s_max = max(case.k_lens)
        kp = torch.zeros(len(case.k_lens), s_max, HKV, D)
        vp = torch.zeros_like(kp)
        for b, (kb, vb) in enumerate(zip(ks, vs, strict=True)):
            kp[b, : len(kb)], vp[b, : len(vb)] = kb, vb
        splits = choose_num_splits(workers, len(case.k_lens), HKV, -(-s_max // 64))
        variants[f"split-kv(P={splits})"] = lambda: split_kv_kernel(
            q, kp, vp, seq_lens, num_splits=splits)[0]
    return variants


def reference(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 per-sequence reference."""
    cq, ck = _cu(case.q_lens), _cu(case.k_lens)
    outs = []
    for b in range(len(case.q_lens)):
        qi = q[cq[b]:cq[b + 1]].transpose(0, 1)
        ki = k[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(G, 0)
        vi = v[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(G, 0)
        outs.append(naive_attention(qi, ki, vi, causal=True)[0].transpose(0, 1))
    return torch.cat(outs)


def time_call(fn: Callable[[], torch.Tensor], warmup: int, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        out.reshape(-1)[0].item()                 # NOTE: forces completion before the clock
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def counts_for(name: str, case: Case) -> tuple[float, float]:
    """(MB moved, GFLOP executed) summed over the ragged batch, from counters.py."""
    mb = gf = 0.0
    for t, n in zip(case.q_lens, case.k_lens, strict=True):
        s = AttnShape(1, HQ, HKV, t, n, D, 4)
        if name == "naive":
            c = naive_forward(s)
        elif name.startswith("split-kv"):
            c = split_kv_decode(s, int(name.split("=")[1].rstrip(")")))
        elif name == "tiled":
            c = tiled_forward(s, 64, 64, gqa_fold=False)
        else:                                     # gqa-folded, paged, sdpa (fused, ideal)
            c = tiled_forward(s, 64, 64, reread=name != "sdpa")
        mb += c.bytes_total / 1e6
        gf += c.flops_executed / 1e9
    return mb, gf


def run_case(case: Case, args: argparse.Namespace) -> dict[str, float]:
    """Print one block of the table; return median seconds per variant (correct ones only)."""
    gen = torch.Generator().manual_seed(len(case.name))
    q = torch.randn(sum(case.q_lens), HQ, D, generator=gen)
    k, v = (torch.randn(sum(case.k_lens), HKV, D, generator=gen) for _ in range(2))
    ref = reference(case, q, k, v)
    print(f"\n{case.name}  (B={len(case.q_lens)}, queries={sum(case.q_lens)}, "
          f"keys={sum(case.k_lens)}, Hq={HQ}, Hkv={HKV}, D={D})")
    print(f"  {'variant':<16} {'max err':>9} {'median ms':>10} {'MB moved':>10} "
          f"{'GFLOP':>8} {'GFLOP/s':>8}")
    results: dict[str, float] = {}
    for name, fn in build_variants(case, q, k, v, args.threads).items():
        err = float((fn().double() - ref).abs().max())
        ok = err < 1e-3
        sec = time_call(fn, args.warmup, args.repeats)
        mb, gf = counts_for(name, case)
        flag = "" if ok else "  WRONG"
        print(f"  {name:<16} {err:>9.1e} {sec * 1e3:>10.2f} {mb:>10.1f} {gf:>8.3f} "
              f"{gf / sec:>8.1f}{flag}")
        if ok:
            results[name.split("(")[0]] = sec
    return results


def main() -> None:
    """Run every case, then report the dispatch rule against the measured winners."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller shapes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, fp32, "
          f"warm-up {args.warmup}, median of {args.repeats}")
    print("\ndispatch check: rule pick vs measured best (ms); choosing costs microseconds")
    rows = []
    for case in make_cases(args.quick):
        res = run_case(case, args)
        shape_class = classify("cpu", case.q_lens, case.k_lens)
        t0 = time.perf_counter()
        for _ in range(1000):
            pick = choose_attention_impl(shape_class)
        choose_us = (time.perf_counter() - t0) * 1e3
        best = min(res, key=res.__getitem__)
        rows.append((case.name, shape_class, pick, best, res, choose_us))
    print("\nshape class -> rule pick | measured best | pick ms | best ms | paged ms | choose us")
    for name, sc, pick, best, res, us in rows:
        print(f"  {name:<28} {_describe(sc):<22} {pick:<10} {best:<10} "
              f"{res.get(pick, float('nan')) * 1e3:>8.2f} {res[best] * 1e3:>8.2f} "
              f"{res.get('paged', float('nan')) * 1e3:>8.2f} {us:>8.2f}")


def _describe(sc: ShapeClass) -> str:
    return f"{sc.device}/{sc.phase}/{sc.batch_bucket}/{sc.length_bucket}"


if __name__ == "__main__":
    main()
