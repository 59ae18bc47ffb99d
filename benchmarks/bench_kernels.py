"""Time the engine's attention backend, shape class by shape class, and check the dispatch rule.

What is timed is exactly what a decoder layer runs: ``fitserve.model.attention.paged.paged_attention``
on an ``AttentionBatch`` whose ``DecodeBatch`` / ``PrefillSeq`` come from the backends' own
builders (``AttentionBackend.build_decode`` / ``build_prefill``, as the runner calls them), over the engine's
head-major paged cache [Hkv, num_blocks, block_size, D] in the engine's dtype (``auto``: bf16 on
CPUs with AVX512-BF16/AMX), with shuffled block tables (blocks come from a pool, not in order),
q a strided slice of the fused q/k projection as in the model, and the SmolLM2-135M geometry
(9 query heads, 3 KV heads, head_dim 64, block_size 16). Only the backend changes between
rows: ``eager_gather`` (gather + matmul + fp32 softmax + matmul), ``torch_sdpa`` (gather + torch
SDPA), ``cpu_paged_decode`` (the fused C++ kernel, when it built).

Method: every variant first runs once and is compared with a float64 reference (blocks
gathered by hand in float64, plain softmax); a wrong variant is printed WRONG and never counts
as fastest. Then ``--warmup`` untimed and ``--repeats`` timed calls (time.perf_counter, each call
ends by reading an output element; CPU ops run synchronously); median and min reported, the
dispatch check on ``--stat`` (median by default; on a loaded machine the 2-thread medians are
multiples of the scheduler's time slice, so ``--stat min`` ranks the kernels instead). "prep" is
the per-step cost of building the batch tensors (paid once per step, not per layer).

The last table puts the dispatch rule's pick (fitserve.model.attention.dispatch) next to the measured
fastest for every case; ``--partitions`` also times the C++ kernel's partition sizes.

Run: .venv/bin/python benchmarks/bench_kernels.py [--quick] [--threads N] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
from fitserve.kernels.cpu.paged_attention import (
    DEFAULT_PARTITION,
    paged_attention_available,
    paged_decode_attention,
)
from fitserve.model.attention.backend import AttentionBackend
from fitserve.model.attention.cpu_paged import CPU_PAGED_DECODE
from fitserve.model.attention.dispatch import ShapeClass, choose_attention_backend, classify
from fitserve.model.attention.gather import EAGER_GATHER, TORCH_SDPA
from fitserve.model.attention.paged import AttentionBatch, paged_attention
from fitserve.runner.placement import resolve_dtype

HQ, HKV, D, BS = 9, 3, 64, 16  # SmolLM2-135M; the engine's default block size
LAYERS = 30
DEVICE = torch.device("cpu")


@dataclass(slots=True)
class Case:
    """One attention call: ``q_lens`` new tokens per sequence after ``cached`` tokens."""

    name: str
    q_lens: list[int]
    cached: list[int]

    @property
    def k_lens(self) -> list[int]:
        return [c + t for c, t in zip(self.cached, self.q_lens, strict=True)]

    @property
    def decode(self) -> bool:
        return all(t == 1 for t in self.q_lens)


def make_cases(quick: bool) -> list[Case]:
    """Decode at batch 1 / 2..8 / >8 and short / long / very long caches; prefill chunks."""
    gen = torch.Generator().manual_seed(0)

    def ragged(b: int, lo: int, hi: int) -> list[int]:
        return torch.randint(lo, hi + 1, (b,), generator=gen).tolist()

    def dec(name: str, lens: list[int]) -> Case:
        return Case(name, [1] * len(lens), [n - 1 for n in lens])

    cases = [
        dec("decode b=1 L=300", [300]),
        dec("decode b=1 L=2000", [2000]),
        dec("decode b=8 L<=512", ragged(8, 64, 512)),
        dec("decode b=32 L=129..256 (W2)", ragged(32, 129, 256)),
        dec("decode b=32 L<=4096", ragged(32, 1024, 4096)),
        Case("prefill T=128", [128], [0]),
        Case("prefill T=1024", [1024], [0]),
    ]
    if not quick:
        cases[5:5] = [
            dec("decode b=1 L=8192", [8192]),
            dec("decode b=4 L<=4096", ragged(4, 1024, 4096)),
            dec("decode b=16 L>4096", ragged(16, 4097, 8192)),
        ]
        cases += [Case("prefill T=512", [512], [0]),
                  Case("chunk T=256 S=1792", [256], [1792]),
                  Case("chunk T=512 S=7680", [512], [7680])]
    return cases


@dataclass(slots=True)
class Inputs:
    """A filled paged cache, the block tables that address it, and the step's queries."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list[list[int]]
    q: torch.Tensor  # [N, HQ, D], a strided view like the model's


def make_inputs(case: Case, dtype: torch.dtype, seed: int) -> Inputs:
    """Random K/V in shuffled blocks (the pool's order), garbage in every unused slot."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = [-(-n // BS) for n in case.k_lens]
    total = sum(n_blocks) + 8
    order = torch.randperm(total, generator=gen).tolist()
    tables, used = [], 0
    for n in n_blocks:
        tables.append(order[used : used + n])
        used += n
    k_cache = torch.randn(HKV, total, BS, D, generator=gen).to(dtype)
    v_cache = torch.randn(HKV, total, BS, D, generator=gen).to(dtype)
    qk = torch.randn(sum(case.q_lens), HQ + HKV, D, generator=gen).to(dtype)
    return Inputs(k_cache, v_cache, tables, qk[:, :HQ])


def make_batch(case: Case, inputs: Inputs, backend: AttentionBackend) -> AttentionBatch:
    """The AttentionBatch the runner would build for this case with ``backend`` chosen."""
    slots = torch.empty(0, dtype=torch.long)
    if case.decode:
        d = backend.build_decode(inputs.tables, case.k_lens, block_size=BS, window=None,
                                 device=DEVICE)
        return AttentionBatch(slot_mapping=slots, decode=d)
    seqs, offset = [], 0
    for t, c, table in zip(case.q_lens, case.cached, inputs.tables, strict=True):
        seqs.append(backend.build_prefill(offset, c, t, table, block_size=BS, window=None,
                                          device=DEVICE))
        offset += t
    return AttentionBatch(slot_mapping=slots, decode=None, prefills=seqs)


def reference(case: Case, inputs: Inputs) -> torch.Tensor:
    """Float64: each sequence's blocks gathered by hand, bottom-right causal, plain softmax."""
    outs, offset = [], 0
    g = HQ // HKV
    for t, c, table in zip(case.q_lens, case.cached, inputs.tables, strict=True):
        n = c + t
        k = inputs.k_cache.double()[:, table].reshape(HKV, -1, D)[:, :n]
        v = inputs.v_cache.double()[:, table].reshape(HKV, -1, D)[:, :n]
        q = inputs.q[offset : offset + t].double().view(t, HKV, g, D)
        s = torch.einsum("thgd,hld->hgtl", q, k) * D**-0.5
        keep = torch.arange(n)[None, :] <= (c + torch.arange(t))[:, None]
        p = s.masked_fill(~keep, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hgtl,hld->thgd", p, v).reshape(t, HQ, D))
        offset += t
    return torch.cat(outs)


def time_call(fn: Callable[[], torch.Tensor], warmup: int, repeats: int) -> tuple[float, float]:
    """(median, min) seconds of ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        out.reshape(-1)[0].item()  # NOTE: forces completion before the clock stops
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def backends_for(case: Case) -> list[AttentionBackend]:
    """The CPU backends that run this phase."""
    if case.decode and paged_attention_available():
        return [EAGER_GATHER, TORCH_SDPA, CPU_PAGED_DECODE]
    return [EAGER_GATHER, TORCH_SDPA]


def run_case(case: Case, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, float]:
    """Print one block of the table; return median seconds per correct backend (by name)."""
    inputs = make_inputs(case, dtype, seed=len(case.name))
    ref = reference(case, inputs)
    tol = 2e-2 if dtype != torch.float32 else 1e-4  # of max |ref|: 16-bit outputs round
    k_lens = case.k_lens
    print(f"\n{case.name}  (B={len(k_lens)}, new={sum(case.q_lens)}, keys={sum(k_lens)}, "
          f"max keys={max(k_lens)})")
    print(f"  {'backend':<16} {'rel err':>9} {'median ms':>10} {'min ms':>9} {'ms/step':>9} "
          f"{'prep ms':>8}")
    results: dict[str, float] = {}
    for backend in backends_for(case):
        t0 = time.perf_counter()
        batch = make_batch(case, inputs, backend)
        prep = time.perf_counter() - t0

        def call(batch: AttentionBatch = batch) -> torch.Tensor:
            return paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, batch, D**-0.5)

        err = float((call().double() - ref).abs().max() / ref.abs().max())
        med, low = time_call(call, args.warmup, args.repeats)
        sec = med if args.stat == "median" else low
        ok = err < tol
        print(f"  {backend.name:<16} {err:>9.1e} {med * 1e3:>10.3f} {low * 1e3:>9.3f} "
              f"{sec * LAYERS * 1e3:>9.2f} {prep * 1e3:>8.3f}{'' if ok else '  WRONG'}")
        if ok:
            results[backend.name] = sec
    if case.decode and args.partitions and paged_attention_available():
        d = make_batch(case, inputs, CPU_PAGED_DECODE).decode
        assert d is not None and d.seq_lens is not None
        for part in (64, 128, 256, 512, 1024, 1 << 20):
            def op(part: int = part) -> torch.Tensor:
                assert d is not None and d.seq_lens is not None
                return paged_decode_attention(inputs.q, inputs.k_cache, inputs.v_cache,
                                              d.block_tables, d.seq_lens, D**-0.5,
                                              partition_size=part)
            med, low = time_call(op, args.warmup, args.repeats)
            label = "none" if part == 1 << 20 else str(part)
            print(f"  {'  partition ' + label:<26} {med * 1e3:>10.3f} {low * 1e3:>9.3f}")
    return results


def header(dtype: torch.dtype) -> str:
    """Machine, software and method line printed above the tables."""
    cpu = cpu_model_name()
    isa = detect_isa()
    return (f"{datetime.date.today()}  {cpu}  ISA {isa.describe()}, tier {isa.tier}\n"
            f"torch {torch.__version__}, threads={torch.get_num_threads()}, cache {dtype}, "
            f"Hq={HQ} Hkv={HKV} D={D} block={BS}, C++ kernel: "
            f"{'loaded' if paged_attention_available() else 'unavailable'}")


def main() -> None:
    """Run every case, then report the dispatch rule against the measured winners."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", default="auto", help="cache/activation dtype (auto = engine's)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic for ms/step and the dispatch check (min: least-disturbed "
                         "run, for a loaded machine where medians measure the scheduler)")
    ap.add_argument("--partitions", action="store_true",
                    help=f"also time the C++ kernel's partition sizes (default {DEFAULT_PARTITION})")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, DEVICE)
    print(header(dtype))
    print(f"warm-up {args.warmup}, {args.repeats} timed calls; ms/step = {LAYERS} layers x "
          f"the {args.stat}; dispatch check on the {args.stat}")
    rows = []
    with torch.inference_mode():
        for case in make_cases(args.quick):
            res = run_case(case, args, dtype)
            sc = classify("cpu", case.q_lens, case.k_lens, cpp=paged_attention_available())
            rows.append((case.name, sc, choose_attention_backend(sc).name, res))
    print(f"\ndispatch check: rule pick vs measured fastest ({args.stat} ms per layer)")
    print(f"  {'case':<28} {'shape class':<24} {'pick':<16} {'fastest':<16} "
          f"{'pick ms':>8} {'best ms':>8}  verdict")
    for name, sc, pick, res in rows:
        best = min(res, key=res.__getitem__)
        p, b = res.get(pick, float("nan")), res[best]
        verdict = "ok" if pick == best else (
            f"within {100 * (p / b - 1):.0f}%" if p <= 1.05 * b else "MISPICK")
        print(f"  {name:<28} {_describe(sc):<24} {pick:<16} {best:<16} "
              f"{p * 1e3:>8.3f} {b * 1e3:>8.3f}  {verdict}")


def _describe(sc: ShapeClass) -> str:
    return f"{sc.device}/{sc.phase}/{sc.batch_bucket}/{sc.length_bucket}"


if __name__ == "__main__":
    main()
