"""What each held weight format's CPU kernel costs per weight: the step-time model's dequant
term, beside the memory and FLOP floors (fitserve.ledger.speed.decode_step).

    t_dequant(step of M rows) = sum over weight tensors of  elements x ns(fmt, M) / cores
    ns(fmt, M)                = ns1 + (M - 1) x (ns8 - ns1) / 7        (per row of x, linear)

``ns1`` / ``ns8``: CPU nanoseconds of one core per weight at M = 1 / 8 rows of bf16 x, weights in
L2 (no DRAM stream: the decode, the dot products, the scales), measured on the reference CPU
below by ``benchmarks/bench_dequant_cost.py``. Another CPU reads the same figures: run that
script there and compare (NOTE: not scaled by the measured matmul FLOP/s, which a loaded host
measures 18x low and would make this term say the opposite of the truth).

NOTE: a batch-1 step is bound by the larger of the weight stream and this kernel time (they
overlap: the prefetched stream arrives while the previous rows are decoded), so a format whose
kernel is slower than its bytes (IQ4_NL, Q5_0 on a fast memory system) cannot reach its
bandwidth limit; that is what the term tells the planner. Formats without a measured kernel
(GPU formats, f32) cost 0 here: their floors are the roofline's.
"""

from __future__ import annotations

from fitserve.ledger.formats import GGUF_PACKED, weight_format
from fitserve.ledger.weights import WeightBytes

# Measured 2026-12-05 on AMD EPYC Zen 5 (family 26 model 2; AVX-512 VNNI + BF16, tier
# avx512_vnni), 1 thread, K = 512, N 128 -> 512 (the slope), CPU time of the thread (other
# processes' time is not counted; their cache pressure is: repeated runs differ by up to ~15%):
# bf16, int4, int8, fp8: `benchmarks/bench_dequant_cost.py` at commit 08c0158, load average
# 16-19. The ggml block types whose row kernels changed since (Q5_0 / Q5_1 / IQ4_NL / IQ4_XS
# 16 blocks per step, block heads by loads + permutes (1f50a7f), MXFP4 on those rows (3858ce0),
# the K-quant rows' streaming and batch-invariant tiles (8f88f8e, 42baf5e)): the median of 3
# runs of `benchmarks/bench_dequant_cost.py` (the third and fourth with `--formats Q4_K,Q5_K,
# Q6_K,Q5_0,Q5_1,IQ4_NL,IQ4_XS,MXFP4`) at 6ba5633, 2026-12-05 18:35-18:52 UTC, load average
# 3-7 (the values before: docs/benchmarks.md, 'Kernel cost per weight', and git history).
# format -> (ns per weight at M = 1, at M = 8)
DEQUANT_NS_PER_WEIGHT: dict[str, tuple[float, float]] = {
    "bf16": (0.0482, 0.0766),
    "int4-g32-sym": (0.0156, 0.0444),
    "int4-g32-asym": (0.0173, 0.0435),
    "int8-g32": (0.0183, 0.0429),
    "Q4_K": (0.0202, 0.0698),  # (0.0228, 0.0712 before)
    "Q5_K": (0.0234, 0.0811),  # (0.0254, 0.0786)
    "Q6_K": (0.0169, 0.0655),  # (0.0181, 0.0653)
    "Q5_0": (0.0233, 0.0782),  # (0.0303, 0.0906)
    "Q5_1": (0.0269, 0.0797),  # (0.0311, 0.0853)
    "IQ4_NL": (0.0181, 0.0765),  # (0.0267, 0.0747)
    "IQ4_XS": (0.0189, 0.0839),  # (0.0265, 0.0918)
    "mxfp4": (0.0212, 0.0835),  # the MoE experts' rows (not measured before: 0)
    "fp8-ch": (0.0197, 0.1051),
}


def format_ns_per_weight(fmt: str, rows: int) -> float:
    """CPU ns per weight of ``fmt``'s kernel for ``rows`` rows of x on the reference CPU (0 for
    a format without a measured CPU kernel). Q4_0 / Q4_1 / Q8_0 are held packed."""
    if rows < 1:
        raise ValueError(f"a kernel call has at least 1 row of x, got {rows}")
    name = GGUF_PACKED.get(fmt, fmt)
    if name not in DEQUANT_NS_PER_WEIGHT:
        name = weight_format(name).name
    ns1, ns8 = DEQUANT_NS_PER_WEIGHT.get(name, (0.0, 0.0))
    return ns1 + (rows - 1) * (ns8 - ns1) / 7


def _elements(fmt: str, nbytes: int) -> float:
    """Weights held in ``nbytes`` of ``fmt`` (row / tensor scales counted as weights: < 1%)."""
    return nbytes * 8 / weight_format(fmt).bits_per_weight


def dequant_seconds(wb: WeightBytes, *, rows: int, cores: int,
                    read_fraction: float = 1.0) -> float:
    """Seconds the kernels of one step of ``rows`` rows spend on ``wb``'s weights over ``cores``
    CPU cores (0: not a CPU, no such term); ``read_fraction``: the share of the weights the step
    touches (a mixture of experts' routed ones)."""
    if cores < 1:
        return 0.0
    ns = sum(_elements(ln.fmt, ln.bytes) * format_ns_per_weight(ln.fmt, rows) for ln in wb.lines)
    return ns * 1e-9 * read_fraction / cores
