"""`fitserve plan fleet`: loading one model's bytes onto many replicas at once.

    S = bytes of one replica's weights, R replicas of G GPUs, n GPUs per node
    nodes N = ceil(R G / n); each GPU holds s = S / G (tensor-parallel shards)

Naive: every replica reads its own copy from object storage. Four stages in series, each a
bound (the slowest one sets the time, the others overlap it as the bytes stream through):

    storage egress   R S / E            (aggregate, shared by the whole fleet)
    node NIC         s min(n, R G) / NIC (the busiest node's bytes)
    local disk       same bytes / disk   (staged on local NVMe; --direct skips it)
    PCIe to GPU      s / PCIe            (each GPU on its own host link)

Pipelined broadcast: each distinct byte leaves storage once and is relayed node to node down a
chain, in chunks, so storage pays S instead of R S and a node's link carries only the bytes
that node holds (U = S min(n, G) / G). A chunk crosses H stages (storage -> first node, the
relays, then disk and PCIe inside the last node), each at least ``chunk / b*`` where b* is the
slowest stage's rate:

    T = (C + H - 1) x chunk / b*,  C = ceil(U / chunk)   ->   U / b* as C >> H

and U / b* is the tightest per-node bound: no schedule beats it.

                  storage
                     | S, once (per distinct shard)
        node1 --> node2 --> node3 --> ... --> nodeL      chunk i+1 leaves node1 while
          |         |         |                 |        chunk i crosses node1 -> node2
        disk/PCIe disk/PCIe disk/PCIe       disk/PCIe
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.units import fmt_bytes, fmt_bytes_both, parse_bytes, parse_size
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.model_source import resolve_model
from fitserve.tools.planner.report import ENGINE_DEFAULTS, Line, Section
from fitserve.tools.sheets._rates import (
    GBIT_S,
    GBYTE_S,
    count,
    fmt_duration,
    fmt_rate,
    non_negative,
    positive,
)
from fitserve.tools.sheets.sheet import Sheet

# Stated defaults (override each with its flag). Network figures in Gb/s (bits), as NICs and
# storage services are quoted; local figures in GB/s (bytes), as disks and PCIe are.
DEFAULT_STORAGE_GBPS = 400.0  # aggregate object-storage egress to the fleet
DEFAULT_NIC_GBPS = 200.0  # per node, the front-end / storage network
DEFAULT_DISK_GBYTE_S = 20.0  # per node, local NVMe array, streaming write-then-read path
DEFAULT_PCIE_GBYTE_S = 50.0  # per GPU, PCIe Gen5 x16 host-to-device from pinned memory
DEFAULT_CHUNK = "64M"
# start-up work (seconds); the first two overlap the transfer, the last two need the weights
STARTUP = (
    ("process-start-s", 10.0, True, "python, torch and engine imports, config, tokenizer"),
    ("cuda-context-s", 3.0, True, "CUDA context and communicator set-up on each GPU"),
    ("kv-reserve-s", 5.0, False, "profiling forward pass, then the KV pool allocated from "
                                 "what it leaves (needs the weights in place)"),
    ("graph-capture-s", 30.0, False, "torch.compile / CUDA-graph capture over batch sizes "
                                     "(runs the loaded model)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model-bytes", help="bytes of one replica's weights, unit spelled out: "
                                            "500GB = 500e9 B, 500GiB = 536,870,912,000 B, or "
                                            "500e9 (a bare 500G is refused as ambiguous)")
    what.add_argument("--model", help="a catalog model (or config.json / .gguf): its weight "
                                      "bytes from the ledger in --weights")
    p.add_argument("--weights", default=None, help="weight format with --model (default: the "
                                                   "checkpoint's own)")
    p.add_argument("--replicas", type=int, required=True, help="replicas loading at once")
    p.add_argument("--gpus-per-replica", type=int, default=8,
                   help="GPUs of one replica (tensor-parallel shards); default 8")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; default 8")
    p.add_argument("--gpu", default=None, help="optional: check a GPU's shard fits this device")
    p.add_argument("--storage-gbps", type=float, default=DEFAULT_STORAGE_GBPS,
                   help=f"object-storage egress to the whole fleet, gigabits/s (10^9 bit/s); "
                        f"default {DEFAULT_STORAGE_GBPS:g} Gb/s")
    p.add_argument("--nic-gbps", type=float, default=DEFAULT_NIC_GBPS,
                   help=f"network per node, gigabits/s (10^9 bit/s), full duplex; default "
                        f"{DEFAULT_NIC_GBPS:g} Gb/s")
    p.add_argument("--disk-gbyte-s", type=float, default=DEFAULT_DISK_GBYTE_S,
                   help=f"local staging disk per node, gigabytes/s (10^9 B/s); default "
                        f"{DEFAULT_DISK_GBYTE_S:g} GB/s")
    p.add_argument("--direct", action="store_true",
                   help="stream into GPU memory without staging on local disk")
    p.add_argument("--pcie-gbyte-s", type=float, default=DEFAULT_PCIE_GBYTE_S,
                   help=f"host-to-GPU link per GPU, gigabytes/s (10^9 B/s); default "
                        f"{DEFAULT_PCIE_GBYTE_S:g} GB/s (PCIe Gen5 x16, pinned memory)")
    p.add_argument("--chunk", default=DEFAULT_CHUNK,
                   help=f"pipelined broadcast chunk, binary units; default {DEFAULT_CHUNK}iB")
    for flag, default, overlaps, what_ in STARTUP:
        p.add_argument(f"--{flag}", type=float, default=default,
                       help=f"{what_}; default {default:g} s "
                            f"({'overlaps the transfer' if overlaps else 'after the weights'})")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="answer 'no' (exit 1) if the pipelined fleet is not serving by then")


@dataclass(frozen=True)
class Layout:
    """Where the bytes go: replicas, GPUs, nodes and the bytes each holds."""

    model_bytes: int  # S
    replicas: int  # R
    gpus_per_replica: int  # G
    gpus_per_node: int  # n
    nodes: int  # N
    shard_bytes: float  # s = S / G
    naive_node_bytes: float  # s x GPUs on the busiest node
    unique_node_bytes: float  # U = S min(n, G) / G
    chains: int  # distinct node payloads, each broadcast down its own chain
    chain_nodes: int  # nodes per chain


def layout(model_bytes: int, replicas: int, g: int, n: int) -> Layout:
    if n % g and g % n:
        raise PlanError(f"--gpus-per-replica {g} and --gpus-per-node {n}: one must divide the "
                        f"other (a replica fills whole nodes, or a node holds whole replicas)")
    gpus = replicas * g
    nodes = -(-gpus // n)
    s = model_bytes / g
    chains = max(1, g // n)
    return Layout(model_bytes, replicas, g, n, nodes, s, s * min(n, gpus), s * min(n, g),
                  chains, nodes // chains)


@dataclass(frozen=True)
class Links:
    storage: float  # B/s, whole fleet
    nic: float  # B/s per node
    disk: float | None  # B/s per node, None = --direct
    pcie: float  # B/s per GPU


def _payload(args: argparse.Namespace) -> tuple[int, str]:
    if args.model_bytes is not None:
        b = parse_size(args.model_bytes, "--model-bytes")
        if b <= 0:
            raise PlanError(f"--model-bytes must be > 0, got {args.model_bytes!r}")
        return b, f"--model-bytes {args.model_bytes} = {b:,} B = {fmt_bytes_both(b)}"
    entry = resolve_model(args.model)
    fmt = args.weights or entry.native_weights.removeprefix("gguf-file:")
    if entry.file_weight_bytes is not None and args.weights is None:
        return entry.file_weight_bytes, f"{entry.spec.name}: the GGUF file's tensor bytes"
    wb = model_weight_bytes(entry.spec, fmt)
    return wb.total, f"{entry.spec.name} in {wb.mix}: model_weight_bytes (whole model, tp=1)"


def _bytes_section(ly: Layout, how: str) -> Section:
    s, r, g, n = ly.model_bytes, ly.replicas, ly.gpus_per_replica, ly.gpus_per_node
    lines = (
        Line("model bytes per replica", "S", s, fmt_bytes_both(s), how),
        Line("nodes", "N = ceil(R G / n)", ly.nodes, f"{ly.nodes:,}",
             f"ceil({r:,} replicas x {g} GPUs / {n} per node)"),
        Line("bytes per GPU", "s = S / G", ly.shard_bytes, fmt_bytes(ly.shard_bytes),
             f"{s:,} B / {g} (even tensor-parallel shards; replicated vectors ignored)"),
        Line("bytes from storage, every replica its own", "R S", r * s, fmt_bytes(r * s),
             f"{r:,} x {s:,} B"),
        Line("bytes into the busiest node, naive", "s min(n, R G)", ly.naive_node_bytes,
             fmt_bytes(ly.naive_node_bytes),
             f"{ly.shard_bytes:,.0f} B x {min(n, r * g)} GPUs on the node"),
        Line("distinct bytes a node holds", "U = S min(n, G) / G", ly.unique_node_bytes,
             fmt_bytes(ly.unique_node_bytes),
             f"{s:,} B x {min(n, g)} / {g}" + (" (the node's replicas share one copy)"
                                               if g < n else "")),
    )
    return Section("Bytes to move", lines)


def _naive(ly: Layout, ln: Links) -> tuple[Section, float]:
    node = ly.naive_node_bytes
    bounds = [
        ("storage egress", "R S / E", ly.replicas * ly.model_bytes / ln.storage,
         f"{ly.replicas * ly.model_bytes:,} B / {fmt_rate(ln.storage)}"),
        ("node NIC", "s min(n, R G) / NIC", node / ln.nic, f"{node:,.0f} B / {fmt_rate(ln.nic)}"),
    ]
    if ln.disk is not None:
        bounds.append(("local disk", "s min(n, R G) / disk", node / ln.disk,
                       f"{node:,.0f} B / {fmt_rate(ln.disk)}"))
    bounds.append(("PCIe to GPU", "s / PCIe", ly.shard_bytes / ln.pcie,
                   f"{ly.shard_bytes:,.0f} B / {fmt_rate(ln.pcie)} (one link per GPU)"))
    worst = max(bounds, key=lambda b: b[2])
    lines = [Line(f"{name} bound", f, t, fmt_duration(t), ex) for name, f, t, ex in bounds]
    lines.append(Line("naive load time", "max(bounds)", worst[2], fmt_duration(worst[2]),
                      f"max({', '.join(f'{t:.4g}' for _, _, t, _ in bounds)}) s: set by "
                      f"{worst[0]} (the stages stream, so the others hide behind it)"))
    return Section("Naive: every replica reads its own copy from storage", tuple(lines)), worst[2]


def _gb(bytes_per_s: float) -> str:
    return f"{bytes_per_s / GBYTE_S:.4g} GB/s"


def _stage_rates(ly: Layout, ln: Links) -> list[tuple[str, float, str]]:
    """Each pipeline stage's rate in payload bytes per second, with how it is made."""
    k, gpus = ly.chains, min(ly.gpus_per_node, ly.gpus_per_replica)
    head = min(ln.storage / k, ln.nic)
    out = [("storage -> first node", head,
            f"min(E / {k} chain{'s' if k > 1 else ''}, NIC) = min({_gb(ln.storage / k)}, "
            f"{_gb(ln.nic)})"),
           ("node -> node relay", ln.nic, f"NIC {_gb(ln.nic)} (receive and send at once)")]
    if ln.disk is not None:
        out.append(("local disk", ln.disk, f"disk {_gb(ln.disk)}"))
    out.append(("PCIe into the node's GPUs", ln.pcie * gpus,
                f"{gpus} GPU links x {_gb(ln.pcie)} (each GPU takes its share of U)"))
    return out


def _pipelined(ly: Layout, ln: Links, chunk: int, naive: float) -> tuple[Section, float]:
    stages = _stage_rates(ly, ln)
    slow = min(stages, key=lambda st: st[1])
    b = slow[1]
    u = ly.unique_node_bytes
    c = math.ceil(u / chunk)
    t_chunk = u / c / b
    hops = ly.chain_nodes + len(stages) - 2  # storage hop + (L - 1) relays + local stages
    total = (c + hops - 1) * t_chunk
    bound = u / b
    lines = [Line(f"rate: {name}", "payload B/s", rate, fmt_rate(rate), ex)
             for name, rate, ex in stages]
    lines += [
        Line("bytes from storage, once", "S", ly.model_bytes, fmt_bytes(ly.model_bytes),
             f"{ly.chains} distinct node payload(s) of {u:,.0f} B, each read once: saves "
             f"{(ly.replicas - 1) * ly.model_bytes:,} B of egress"),
        Line("chains x nodes per chain", "k = max(1, G / n), L = N / k", ly.chain_nodes,
             f"{ly.chains} x {ly.chain_nodes:,}", f"max(1, {ly.gpus_per_replica} // "
             f"{ly.gpus_per_node}) = {ly.chains}; {ly.nodes:,} / {ly.chains}"),
        Line("chunks", "C = ceil(U / chunk)", c, f"{c:,} of {fmt_bytes(u / c)}",
             f"ceil({u:,.0f} / {chunk:,}) = {c:,}, equal chunks of {u / c:,.0f} B"),
        Line("stages a chunk crosses", "H = L + local stages", hops, f"{hops:,}",
             f"1 storage hop + {ly.chain_nodes - 1:,} relays + {len(stages) - 2} local "
             f"stage(s)"),
        Line("slowest stage", "b* = min(stage rates)", b, fmt_rate(b), f"{slow[0]}"),
        Line("chunk time", "t = (U / C) / b*", t_chunk, f"{t_chunk * 1e3:.3f} ms",
             f"{u / c:,.0f} B / {_gb(b)}"),
        Line("pipelined broadcast time", "T = (C + H - 1) t", total, fmt_duration(total),
             f"({c:,} + {hops:,} - 1) x {t_chunk * 1e3:.4f} ms = {total:.4g} s"),
        Line("tightest per-node bound", "U / b*", bound, fmt_duration(bound),
             f"{u:,.0f} B / {_gb(b)}: the pipeline is {total / bound - 1:.2%} above it "
             f"(the fill of H - 1 chunks)"),
        Line("speed-up over naive", "naive / T", naive / total, f"x{naive / total:,.1f}",
             f"{naive:.4g} s / {total:.4g} s"),
    ]
    notes = ("chunks are fetched once (by the chain head, or as disjoint shards spread over "
             "the nodes) and relayed from host memory as they arrive; a tree cuts the hops to "
             "log2 L but makes each sender feed 2 children at NIC / 2, slower once C >> L",)
    return Section("Pipelined broadcast (chain)", tuple(lines), notes), total


def _startup(args: argparse.Namespace, naive: float, piped: float) -> tuple[Section, float]:
    lines: list[Line] = []
    over = after = 0.0
    names_over: list[str] = []
    names_after: list[str] = []
    for flag, _, overlaps, what_ in STARTUP:
        v = non_negative(f"--{flag}", getattr(args, flag.replace("-", "_")))
        (names_over if overlaps else names_after).append(f"{v:g}")
        if overlaps:
            over += v
        else:
            after += v
        lines.append(Line(f"{flag.removesuffix('-s').replace('-', ' ')} "
                          f"({'overlaps' if overlaps else 'after'})", f"--{flag}", v, f"{v:g} s",
                          f"assumed: {what_}"))
    ready = {}
    for label, t in (("naive", naive), ("pipelined", piped)):
        ready[label] = max(t, over) + after
        lines.append(Line(f"serving after, {label}", "max(T_load, overlapped) + after",
                          ready[label], fmt_duration(ready[label]),
                          f"max({t:.4g}, {' + '.join(names_over)}) + "
                          f"{' + '.join(names_after)} = {ready[label]:.4g} s"))
    notes = ("process start and CUDA context run while the bytes arrive (host memory or disk "
             "first); the KV reservation's profiling pass and graph capture run the model, so "
             "they wait for the last byte",)
    return Section("Start-up work around the bytes", tuple(lines), notes), ready["pipelined"]


def build(args: argparse.Namespace) -> Sheet:
    model_bytes, how = _payload(args)
    r = count("--replicas", args.replicas)
    ly = layout(model_bytes, r, count("--gpus-per-replica", args.gpus_per_replica),
                count("--gpus-per-node", args.gpus_per_node))
    ln = Links(positive("--storage-gbps", args.storage_gbps) * GBIT_S,
               positive("--nic-gbps", args.nic_gbps) * GBIT_S,
               None if args.direct else positive("--disk-gbyte-s", args.disk_gbyte_s) * GBYTE_S,
               positive("--pcie-gbyte-s", args.pcie_gbyte_s) * GBYTE_S)
    chunk = parse_bytes(args.chunk)
    if chunk <= 0:
        raise PlanError(f"--chunk must be > 0 bytes, got {args.chunk!r}")
    warnings: list[str] = []
    if args.gpu is not None:
        hw = get_hardware(args.gpu)
        usable = hw.memory_bytes * ENGINE_DEFAULTS.cache.gpu_memory_utilization
        if ly.shard_bytes > usable:
            warnings.append(f"a {fmt_bytes(ly.shard_bytes)} shard does not fit {hw.name} "
                            f"({fmt_bytes(usable)} usable at memory utilization "
                            f"{ENGINE_DEFAULTS.cache.gpu_memory_utilization}): raise "
                            f"--gpus-per-replica")
    naive_sec, naive = _naive(ly, ln)
    pipe_sec, piped = _pipelined(ly, ln, chunk, naive)
    start_sec, ready = _startup(args, naive, piped)
    ok, verdict = True, f"pipelined: serving after {fmt_duration(ready)} (naive load {fmt_duration(naive)})"
    if args.deadline_s is not None:
        deadline = positive("--deadline-s", args.deadline_s)
        ok = ready <= deadline
        verdict = (f"{'meets' if ok else 'MISSES'} the {fmt_duration(deadline)} deadline: "
                   f"{verdict}")
    title = (f"fitserve plan fleet: {fmt_bytes(model_bytes)} onto {r:,} replicas x "
             f"{ly.gpus_per_replica} GPUs ({ly.nodes:,} nodes of {ly.gpus_per_node})")
    data: dict[str, object] = {"naive_s": naive, "pipelined_s": piped, "ready_s": ready,
                               "nodes": ly.nodes, "unique_node_bytes": ly.unique_node_bytes}
    return Sheet(title, (_bytes_section(ly, how), naive_sec, pipe_sec, start_sec),
                 tuple(warnings), verdict, ok, data)
