"""What the catalog's spec-sheet figures leave out: SM counts, per-clock pipe rates and DRAM
latency, per accelerator, as data with their sources.

Only per-SM, per-clock architecture facts live here; the clock is not stored but derived from
the catalog's dense bf16 peak (``catalog/gpus.json``), so that the explain sheets and the
roofline use one figure:

    clock = bf16_flops / (SMs x tensor bf16 FLOPs per clock per SM)
    e.g. H100 SXM: 989.4e12 / (132 x 4,096) = 1.830 GHz (the clock NVIDIA quotes peaks at;
    its maximum boost, 1.98 GHz, is higher)

Per-clock rates are "results per clock cycle per multiprocessor" as in the CUDA C++ Programming
Guide's table "Throughput of Native Arithmetic Instructions" (one warp instruction = 32 results).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import Hardware

# NOTE: sources, cited once for the table below.
_GUIDE = ("CUDA C++ Programming Guide, 'Throughput of Native Arithmetic Instructions': per SM "
          "per clock, 16 for exp2/rcp/rsqrt/log2/sin/cos (MUFU) and for 'all other type "
          "conversions', 64 for 32-bit integer add/logical (LOP3) on cc 8.0-9.0, FP32 "
          "FMA 64 (cc 8.0) or 128 (cc 8.6-9.0); 4 warp schedulers per SM each issue one warp "
          "instruction (32 threads) per clock")
_LATENCY = ("DRAM latency is an ASSUMPTION of loaded latency (pointer-chase microbenchmarks "
            "report several hundred ns unloaded on A100/H100; queues under full load add "
            "more); use --latency-ns to try other values")


@dataclass(frozen=True)
class GpuMicro:
    """Per-SM, per-clock facts of one accelerator (results per clock per SM)."""

    name: str  # catalog name (``catalog/gpus.json``)
    arch: str  # CUDA compute capability, "sm90"
    sm_count: int
    tensor_flops_per_clk_sm: int  # dense bf16 tensor-core FLOPs (2 per FMA)
    fp32_per_clk_sm: int  # FP32 FMA results
    max_threads_per_sm: int
    smem_per_sm_kib: int  # largest shared memory one SM can give its blocks
    dram_latency_ns: float
    source: str
    mufu_per_clk_sm: int = 16  # exp2, rcp, rsqrt ... (special function unit)
    int_per_clk_sm: int = 64  # 32-bit integer add / shift / logical (LOP3)
    cvt_per_clk_sm: int = 16  # type conversions (I2F, F2F)
    issue_per_clk_sm: int = 128  # 4 schedulers x 32 threads


_A100 = ("A100 whitepaper: 108 SMs (SXM4), third-gen tensor cores 1,024 dense FP16/BF16 FMA "
         "per clock per SM, 2,048 threads and up to 164 KB shared memory per SM. ")
_H100 = ("H100 whitepaper: 132 SMs (SXM5), fourth-gen tensor cores 2x A100 per SM per clock "
         "(4,096 dense BF16 FLOPs), 2,048 threads and up to 228 KB shared memory per SM. ")
_L40S = ("Ada (AD102) whitepaper: 142 SMs on L40S, 512 dense FP16 FMA per clock per SM with "
         "FP32 accumulate on the data-center part, 1,536 threads and up to 100 KB shared "
         "memory per SM. ")
_B200 = ("B200: 148 SMs as CUDA reports them; per-SM dense BF16 rate taken as 2x Hopper "
         "(8,192 FLOPs/clock), integer and conversion rates taken as sm90's: ASSUMPTIONS "
         "until the Blackwell tuning guide tabulates them. ")

MICRO: dict[str, GpuMicro] = {
    m.name: m
    for m in (
        GpuMicro("a100-40gb", "sm80", 108, 2048, 64, 2048, 164, 600.0, _A100 + _GUIDE + ". "
                 + _LATENCY),
        GpuMicro("a100-80gb", "sm80", 108, 2048, 64, 2048, 164, 600.0, _A100 + _GUIDE + ". "
                 + _LATENCY),
        GpuMicro("h100", "sm90", 132, 4096, 128, 2048, 228, 600.0, _H100 + _GUIDE + ". "
                 + _LATENCY),
        GpuMicro("h200", "sm90", 132, 4096, 128, 2048, 228, 600.0, "H200: the H100 SXM5 die "
                 "with HBM3e; " + _H100 + _GUIDE + ". " + _LATENCY),
        GpuMicro("l40s", "sm89", 142, 1024, 128, 1536, 100, 700.0, _L40S + _GUIDE + ". "
                 + _LATENCY + " (GDDR6: 700 ns assumed)"),
        GpuMicro("b200", "sm100", 148, 8192, 128, 2048, 228, 600.0, _B200 + _GUIDE + ". "
                 + _LATENCY),
    )
}


def gpu_micro(hw: Hardware) -> GpuMicro:
    """The micro-architecture row of a catalog accelerator (PlanError if the table has none)."""
    m = MICRO.get(hw.name)
    if m is None:
        raise PlanError(f"no SM-level data for {hw.name!r} (SM count, pipe rates, DRAM latency); "
                        f"this sheet knows: {', '.join(MICRO)}")
    return m


def clock_hz(hw: Hardware, m: GpuMicro) -> float:
    """The clock the catalog's dense bf16 peak implies: peak / (SMs x FLOPs per clock per SM)."""
    return hw.bf16_flops / (m.sm_count * m.tensor_flops_per_clk_sm)


def per_second(hw: Hardware, m: GpuMicro, per_clk_sm: int) -> float:
    """A per-SM per-clock rate over the whole device: rate x SMs x clock."""
    return per_clk_sm * m.sm_count * clock_hz(hw, m)


def clock_explain(hw: Hardware, m: GpuMicro) -> str:
    return (f"{hw.bf16_flops:.4g} FLOP/s / ({m.sm_count} SMs x {m.tensor_flops_per_clk_sm:,} "
            f"FLOPs/clk/SM) = {clock_hz(hw, m) / 1e9:.4g} GHz")
