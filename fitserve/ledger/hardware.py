"""Accelerators as data (catalog/gpus.json) and ``cpu`` = this machine, measured and cached."""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fitserve.envs import fitserve_home
from fitserve.ledger import cpu_measure
from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import GGUF_PACKED

# 4: the engine rates (one thread's CPU time x threads) beside the bandwidth; 5: + the
# element-wise cost per token and the cost per sampled sequence; 6: + the one-row linears'
# weight stream rate; 9: the int4 linears measured on the layout the engine holds (panels);
# 10: + the decode attention's rates on the AMX-BF16 tile; 11: + the read bandwidth, which
# becomes the CPU's memory bandwidth (mem_bytes_per_s); 12: + the fp8 one-row linear's stream
# rate (--weights fp8's W1 floor)
CPU_CACHE_VERSION = 12


@dataclass(frozen=True)
class Hardware:
    """One device. Peaks are dense; ``link_bytes_per_s`` is per direction per device."""

    name: str
    memory_bytes: int
    mem_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float | None
    power_w: float | None
    link: str
    link_bytes_per_s: float
    link_latency_s: float
    source: str
    measured: bool = False
    measured_at: float | None = None  # unix time of a measured device's figures
    # a CPU: the cores its figures were measured with (the step-time model's dequant term,
    # fitserve.ledger.dequant, runs over them); 0 for an accelerator (no such term)
    cores: int = 0
    # a CPU: the FLOP/s the engine's own matmul ops reach, per path ("int8act", "bf16", "f32",
    # fitserve.engine.cpu_rates) at each of ``matmul_rows`` rows of x; empty: not measured
    matmul_rows: tuple[int, ...] = ()
    matmul_rates: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # a CPU: the fixed cost of an engine step and of each decoder layer in it (Python, op
    # dispatch, thread wake-ups), measured on a tiny model; 0 for an accelerator's roofline
    # a CPU: the FLOP/s of the engine's paged decode attention (per-key work; 0: its FLOPs run
    # at the matmul rate, as on a GPU's roofline)
    attention_flops: float = 0.0
    step_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    # a CPU: seconds per element of a token's element-wise work in one layer (norms, rotary,
    # KV writes, SwiGLU: speed.elementwise_elements), per sampled sequence besides its bytes
    # and FLOPs, and per logit of its argmax; all over ``cores`` (0 on a GPU's roofline)
    elementwise_s: float = 0.0
    seq_overhead_s: float = 0.0
    logit_s: float = 0.0
    # a CPU: weight bytes/s the engine's one-row linears reach per path ("int8act", "bf16") at
    # each K of ``gemv_k`` (fitserve.engine.cpu_rates); empty: not measured
    gemv_k: tuple[int, ...] = ()
    gemv_rates: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # a CPU: the K (columns) the matmul rates were measured at: each path's rates are then
    # K-major, len(matmul_k) x len(matmul_rows) (empty: one K); and its decode attention's
    # fixed cost per (sequence, KV head, layer) beside its FLOPs at attention_flops
    matmul_k: tuple[int, ...] = ()
    attention_seq_s: float = 0.0
    attention_kv_s: float = 0.0  # decode attention per KV head, key and head dimension
    # a CPU: the decode attention on the AMX-BF16 tile, which the engine runs for models with at
    # least attention_tile_min_group query heads per KV head (0: never on this CPU): its query
    # heads' FLOP/s and its cost per KV head, key and head dimension (in place of the two above)
    attention_tile_flops: float = 0.0
    attention_tile_kv_s: float = 0.0
    attention_tile_min_group: int = 0

    def weight_stream_rate(self, fmt: str, k: int) -> float:
        """Weight bytes/s this CPU's one-row linears reach on weights held as ``fmt`` with rows
        of ``k`` (log-linear between the measured K, flat past them); 0 where that kernel was
        not measured (``gemv_path``: the ggml block kernels, f32), so no floor."""
        path = gemv_path(fmt)
        got = dict(self.gemv_rates).get(path) if path else None
        return _at_rows(self.gemv_k, got, k) if got and self.gemv_k else 0.0

    def peak_flops(self, weights_fmt: str, rows: int | None = None,
                   k: int | None = None) -> float:
        """Matmul rate for a weight format: where the engine's rates were measured (a CPU), the
        rate of the path that format runs on (``cpu_matmul_path``) at ``rows`` rows of x and
        ``k`` columns of the weight (None: the largest measured), log-linear between the
        measured row counts and K and flat past them; else fp8 GEMMs where the device has them,
        else bf16.

        NOTE: on a GPU, weight-only int4/int8 (W4A16, W8A16) dequantize to bf16 and run at the
        bf16 peak.
        """
        if self.matmul_rates:
            rates = dict(self.matmul_rates)
            got = rates.get(cpu_matmul_path(weights_fmt), rates["bf16"])
            n = len(self.matmul_rows)
            per_k = tuple(_at_rows(self.matmul_rows, got[i * n:(i + 1) * n], rows)
                          for i in range(max(1, len(self.matmul_k))))
            return _at_rows(self.matmul_k, per_k, k) if self.matmul_k else per_k[0]
        if weights_fmt.startswith("fp8") and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops

    def step_overhead(self, layers: int) -> float:
        """Seconds every step pays besides its bytes and FLOPs: per step + per layer."""
        return self.step_overhead_s + layers * self.layer_overhead_s


# NOTE: what the engine runs each held format on (fitserve.model.linear): the integer formats
# (int4/int8 RTN, GGUF Q4_0/Q4_1/Q8_0 held packed, the K-quants, IQ4) take int8 activations on
# the VNNI kernels by default (--activation-quant auto); float32 weights run F.linear in f32;
# everything else (bf16, fp8 dequantized per call, mixes) runs at the bf16 rate.
_INT8ACT_PREFIXES = ("int4", "int8", "q4", "q5", "q6", "q8", "iq4")


def gemv_path(fmt: str) -> str | None:
    """The measured one-row kernel (``Hardware.gemv_rates``) a held weight format runs on:
    "int8act" for the packed int4 / int8 group formats (GGUF Q4_0 / Q4_1 / Q8_0 held packed:
    the int8 rows measured within ~10% of the int4 ones per byte, bench_qgemv_stream.py),
    "bf16" for bf16, "fp8" for the fp8 formats (the fp8 GEMV decodes e4m3 and e5m2 codes
    alike); None for the rest (their kernels were not timed at M = 1)."""
    f = GGUF_PACKED.get(fmt, fmt).lower()
    if f.startswith(("int4", "int8")):
        return "int8act"
    if f.startswith("fp8"):
        return "fp8"
    return "bf16" if f in ("bf16", "bfloat16") else None


def cpu_matmul_path(weights_fmt: str) -> str:
    """The engine's matmul path for a weight format: "int8act", "f32" or "bf16"."""
    f = weights_fmt.lower().removeprefix("gguf-file:")
    if f in ("f32", "fp32", "float32"):
        return "f32"
    return "int8act" if f.startswith(_INT8ACT_PREFIXES) else "bf16"


def _at_rows(rows_at: tuple[int, ...], rates: tuple[float, ...], rows: int | None) -> float:
    """``rates`` measured at ``rows_at`` (ascending) read at ``rows``: flat outside, linear in
    log(rows) between two measured row counts."""
    if rows is None or rows >= rows_at[-1]:
        return rates[-1]
    if rows <= rows_at[0]:
        return rates[0]
    i = next(j for j in range(1, len(rows_at)) if rows <= rows_at[j])
    f = math.log(rows / rows_at[i - 1]) / math.log(rows_at[i] / rows_at[i - 1])
    return rates[i - 1] + f * (rates[i] - rates[i - 1])


def _gpu_rows() -> list[dict[str, Any]]:
    text = resources.files("fitserve.ledger").joinpath("catalog/gpus.json").read_text()
    rows: list[dict[str, Any]] = json.loads(text)["gpus"]
    return rows


def _from_row(r: dict[str, Any]) -> Hardware:
    return Hardware(r["name"], int(r["memory_bytes"]), float(r["mem_bytes_per_s"]),
                    float(r["bf16_flops"]), r["fp8_flops"] and float(r["fp8_flops"]),
                    r["power_w"] and float(r["power_w"]), r["link"],
                    float(r["link_bytes_per_s"]), float(r["link_latency_s"]), r["source"])


def gpu_names() -> list[str]:
    return [r["name"] for r in _gpu_rows()] + ["cpu"]


def get_hardware(name: str) -> Hardware:
    """A catalog accelerator by name or alias, or "cpu" (this machine, measured)."""
    key = name.strip().lower()
    if key == "cpu":
        return cpu_hardware()
    table = {}
    for r in _gpu_rows():
        for k in (r["name"], *r.get("aliases", [])):
            table[k.lower()] = r
    if key in table:
        return _from_row(table[key])
    close = difflib.get_close_matches(key, [*table, "cpu"], n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise PlanError(f"unknown GPU {name!r}{hint} Known: {', '.join(gpu_names())}")


def machine_key() -> str:
    """This host, architecture and CPU count: what a per-machine cache is keyed by."""
    return f"{platform.node()}|{platform.machine()}|{os.cpu_count()}"


def _mem_total() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_has_fast_bf16() -> bool:
    """True where the CPU has native bf16 dot products (AVX512-BF16 or AMX): the engine's
    "auto" dtype on CPU is then bf16, else f32 (see ``cpu_engine_dtype``)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """True where the CPU has AMX bf16 tiles: torch's CPU flash attention then repacks K/V for
    its bf16 GEMM (``cpublas::need_pack``); without AMX (Zen 4, AVX2) it never does
    (``fitserve.ledger.scratch.cpu_sdpa_bytes``)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def cpu_engine_dtype() -> str:
    """The dtype the engine picks for ``--dtype auto`` on this CPU: "bf16" or "f32"."""
    return "bf16" if cpu_has_fast_bf16() else "f32"


def cpu_hardware(*, refresh: bool = False) -> Hardware:
    """This machine: read bandwidth (its ``mem_bytes_per_s``: a decode step's weight and KV
    traffic is reads) and matmul FLOP/s (``fitserve.ledger.cpu_measure``), cached
    in $FITSERVE_HOME/hardware-cpu.json and measured again when the cache no longer describes
    this CPU (another model or thread count, stale, or a quick probe > 25% off); ``refresh``
    measures again in any case."""
    path = fitserve_home() / "hardware-cpu.json"
    model, threads = cpu_measure.cpu_model(), cpu_measure.default_threads()
    cached = figures = None if refresh else _read_cached(path)
    if figures is not None:
        usable, _why = cpu_measure.cached_is_usable(
            figures, now=time.time(), model=model, threads=threads,
            probe=lambda: cpu_measure.probe_copy_bandwidth(threads))
        figures = figures if usable else None
    if figures is None:
        engine = cpu_measure.reusable_engine_rates(cached, now=time.time(), model=model,
                                                   threads=threads)
        figures = cpu_measure.measure_figures(threads, engine=engine)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"version": CPU_CACHE_VERSION, **asdict(figures)},
                                       indent=1))
        except OSError:
            pass  # a read-only home only costs a re-measure next time
    rates = tuple((p, tuple(v)) for p, v in sorted(figures.matmul_flops.items()))
    flops = (f"the engine's own matmul ops at M = "
             f"{'/'.join(str(m) for m in figures.matmul_rows)} rows"
             f"{_k_note(tuple(figures.matmul_k))}, each weight format at its "
             f"path's rate, and a tiny model's decode step (overhead per step and per layer; "
             f"fitserve.engine.cpu_rates)" if rates else
             "a 1024^3 float32 numpy matmul (f32 FLOP/s stands in for bf16; no step overhead)")
    return Hardware(
        name="cpu", memory_bytes=_mem_total(), mem_bytes_per_s=figures.stream_bytes_per_s,
        bf16_flops=dict(rates)["bf16"][-1] if rates else figures.flops, fp8_flops=None,
        power_w=None, link="none", link_bytes_per_s=0.0, link_latency_s=0.0,
        source=(f"{figures.describe()}: memory bandwidth = "
                f"{'the read rate' if figures.read_bytes_per_s else 'the copy rate'} "
                f"({figures.threads} parallel numpy sums / copies of 256 MiB, each the median of "
                f"the undisturbed runs of 7); FLOP/s: {flops}; memory = physical RAM"),
        measured=True, measured_at=figures.measured_at, cores=figures.threads,
        matmul_rows=tuple(figures.matmul_rows), matmul_rates=rates,
        attention_flops=figures.attention_flops, step_overhead_s=figures.step_overhead_s,
        layer_overhead_s=figures.layer_overhead_s, elementwise_s=figures.elementwise_s,
        seq_overhead_s=figures.seq_overhead_s, logit_s=figures.logit_s,
        gemv_k=tuple(figures.gemv_k),
        gemv_rates=tuple((p, tuple(v)) for p, v in sorted(figures.gemv_bytes_per_s.items())),
        matmul_k=tuple(figures.matmul_k), attention_seq_s=figures.attention_seq_s,
        attention_kv_s=figures.attention_kv_s, attention_tile_flops=figures.attention_tile_flops,
        attention_tile_kv_s=figures.attention_tile_kv_s,
        attention_tile_min_group=figures.attention_tile_min_group)


def measured_cpu(*, mem_bytes_per_s: float, engine: cpu_measure.EngineRates,
                 threads: int) -> Hardware:
    """This CPU from figures measured just now rather than the cache: what bench_engine.py
    predicts with, measuring both right before each of its fitserve workers (same host, same
    load as what it then measures); ``mem_bytes_per_s`` the read bandwidth, as cpu_hardware's."""
    rates = tuple((p, tuple(v)) for p, v in sorted(engine.matmul_flops.items()))
    return Hardware(
        name="cpu", memory_bytes=_mem_total(), mem_bytes_per_s=mem_bytes_per_s,
        bf16_flops=dict(rates)["bf16"][-1], fp8_flops=None, power_w=None, link="none",
        link_bytes_per_s=0.0, link_latency_s=0.0,
        source=f"measured in this run: {mem_bytes_per_s / 1e9:.1f} GB/s read, engine rates "
               f"{', '.join(f'{p} ' + '/'.join(f'{x / 1e9:.0f}' for x in v) for p, v in rates)} "
               f"GFLOP/s{_k_note(engine.matmul_k)}, decode attention "
               f"{engine.attention_flops / 1e9:.0f} GFLOP/s + "
               f"{engine.attention_seq_s * 1e9:.0f} ns per sequence and KV head + "
               f"{engine.attention_kv_s * 1e12:.2f} ps per KV head, key and dimension"
               f"{cpu_measure.describe_tile(engine)}, "
               f"overhead {engine.step_overhead_s * 1e3:.3f} ms + "
               f"{engine.layer_overhead_s * 1e6:.1f} us per layer + "
               f"{engine.seq_overhead_s * 1e6:.1f} us per sequence, element-wise "
               f"{engine.elementwise_s * 1e12:.0f} ps per element"
               f"{cpu_measure.describe_gemv(engine)}",
        measured=True, measured_at=time.time(), cores=threads,
        matmul_rows=tuple(engine.matmul_rows), matmul_rates=rates,
        attention_flops=engine.attention_flops, step_overhead_s=engine.step_overhead_s,
        layer_overhead_s=engine.layer_overhead_s, elementwise_s=engine.elementwise_s,
        seq_overhead_s=engine.seq_overhead_s, logit_s=engine.logit_s,
        gemv_k=tuple(engine.gemv_k),
        gemv_rates=tuple((p, tuple(v)) for p, v in sorted(engine.gemv_bytes_per_s.items())),
        matmul_k=tuple(engine.matmul_k), attention_seq_s=engine.attention_seq_s,
        attention_kv_s=engine.attention_kv_s, attention_tile_flops=engine.attention_tile_flops,
        attention_tile_kv_s=engine.attention_tile_kv_s,
        attention_tile_min_group=engine.attention_tile_min_group)


def _k_note(ks: tuple[int, ...]) -> str:
    return f" (each at K = {'/'.join(str(k) for k in ks)})" if ks else ""


def _read_cached(path: Path) -> cpu_measure.CpuFigures | None:
    try:
        data = json.loads(path.read_text())
        if data.pop("version", None) != CPU_CACHE_VERSION:
            return None
        data["matmul_rows"] = tuple(data.get("matmul_rows", ()))
        data["gemv_k"] = tuple(data.get("gemv_k", ()))
        data["matmul_k"] = tuple(data.get("matmul_k", ()))
        return cpu_measure.CpuFigures(**data)
    except (OSError, ValueError, TypeError):
        return None  # missing, old-format or damaged: measured again
