"""The replica kinds ``fitserve plan capacity`` compares: a catalog GPU, or a CPU replica of N
threads (``cpu:N``; ``cpu`` = every core the CPU's figures were measured with), each in every
weight format of ``--weights`` (one format: named by the device alone, as before; several:
``DEVICE/FORMAT``, e.g. ``cpu:1/int4``).

A CPU replica of t threads on a CPU measured with T (``fitserve.ledger.cpu_measure``) gets t/T of
its measured throughput figures (copy bandwidth, the engine's matmul and attention rates, RAM)
and t cores for the weight kernels; the per-step and per-layer overhead stays whole.

NOTE: t/T is the replica's share of the host when replicas fill it (co-located replicas share
its DRAM bandwidth and RAM); the engine rates are one thread's rate x T already, so t/T of them
is exact; a lone 1-thread replica on an idle host reads more than 1/T of the bandwidth, so its
capacity here is a floor. The overhead is one thread's fixed cost per step (Python, dispatch),
which more threads do not share out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import Hardware, get_hardware

_CPU = re.compile(r"^cpu(?::(\d+))?$")


@dataclass(frozen=True)
class ReplicaKind:
    """One column of the sheet: a device (and a CPU replica's threads) in one weight format."""

    name: str  # "h100", "cpu:2", "cpu:1/int4"
    device: str  # the catalog name, or "cpu"
    threads: int  # a CPU replica's threads; 0 for a GPU
    weights: str


def _device(text: str) -> tuple[str, int]:
    """("h100", 0) or ("cpu", threads) for one --gpus entry (catalog aliases accepted)."""
    key = text.strip().lower()
    m = _CPU.match(key)
    if m is None:
        return get_hardware(key).name, 0
    if m.group(1) is None:
        from fitserve.ledger.cpu_measure import default_threads

        return "cpu", default_threads()
    threads = int(m.group(1))
    if threads < 1:
        raise PlanError(f"--gpus {text}: a CPU replica needs at least 1 thread")
    return "cpu", threads


def replica_kinds(gpus: str, weights: list[str]) -> list[ReplicaKind]:
    """Every (device, weight format) pair of --gpus x --weights, in that order, without repeats."""
    devices = list(dict.fromkeys(_device(x) for x in gpus.split(",") if x.strip()))
    if not devices:
        raise PlanError("--gpus is empty: name at least one catalog GPU or cpu:THREADS")
    out = []
    for dev, threads in devices:
        label = f"cpu:{threads}" if dev == "cpu" else dev
        for fmt in weights:
            out.append(ReplicaKind(label if len(weights) == 1 else f"{label}/{fmt}", dev, threads, fmt))
    return out


def find_kind(flag: str, text: str, kinds: list[ReplicaKind], missing: str | None = None
              ) -> ReplicaKind:
    """The kind ``text`` names (``h100``, ``cpu:2``, ``cpu:1/int4``, aliases accepted); a
    device alone names its only kind. ``missing``: the error where none matches."""
    dev_text, _, fmt = text.strip().lower().partition("/")
    dev, threads = _device(dev_text)
    found = [k for k in kinds if (k.device, k.threads) == (dev, threads)
             and (not fmt or k.weights.lower() == fmt)]
    names = ", ".join(k.name for k in kinds)
    if not found:
        raise PlanError(missing or f"{flag} {text} is not one of --gpus ({names})")
    if len(found) > 1:
        raise PlanError(f"{flag} {text} names several of the replica kinds compared ({names}): "
                        f"add /FORMAT")
    return found[0]


def kind_hardware(kind: ReplicaKind) -> Hardware:
    """The device one replica of ``kind`` runs on: a catalog GPU, or its share of this CPU."""
    hw = get_hardware(kind.device)
    if kind.device != "cpu":
        return hw
    if kind.threads > hw.cores:
        raise PlanError(f"--gpus {kind.name}: this CPU's figures were measured with {hw.cores} "
                        f"threads (its cores); a replica can have at most that many")
    return cpu_replica_hardware(hw, kind.threads)


def cpu_replica_hardware(hw: Hardware, threads: int) -> Hardware:
    """``threads`` of the measured CPU ``hw``: threads / hw.cores of its throughput figures."""
    f = threads / hw.cores
    return replace(
        hw, name=f"cpu:{threads}", memory_bytes=int(hw.memory_bytes * f),
        mem_bytes_per_s=hw.mem_bytes_per_s * f, bf16_flops=hw.bf16_flops * f,
        matmul_rates=tuple((p, tuple(x * f for x in v)) for p, v in hw.matmul_rates),
        attention_flops=hw.attention_flops * f, attention_seq_s=hw.attention_seq_s / f,
        attention_kv_s=hw.attention_kv_s / f, attention_tile_flops=hw.attention_tile_flops * f,
        attention_tile_kv_s=hw.attention_tile_kv_s / f, cores=threads,
        source=f"{threads} of the {hw.cores} threads of {hw.source}")
