"""Where one batch-1 decode step of an MoE GGUF goes (bench_moe.py's files, as stored).

    .venv/bin/python benchmarks/profile_moe.py ~/.cache/fitserve/bench/moe-small-q4_k_m.gguf
    .venv/bin/python benchmarks/profile_moe.py FILE --per-expert   # the per-expert loop instead
    .venv/bin/python benchmarks/profile_moe.py FILE --threads 1 --paths   # decode paths A/B

Prints the median W1 decode step, torch.profiler's top ATen ops by self CPU time over 5 steps
(profile_engine.op_table), and the step split by module: every SparseMoeBlock (router, grouping,
experts, combine), the experts' own linears within them, attention and the lm_head, timed with
forward hooks over 10 more steps (the hooks' own cost is in the totals).

``--cpu-split``: a W1 step's thread CPU time by part (engine step, forward, router, routing,
expert op, lm_head, the rest by difference; with ``--threads 1`` robust on a loaded host).

``--threads-ab``: the W1 engine step at one thread (thread CPU time and wall) and at two threads
(wall), alternated in one process (--rounds rounds of 25 steps each), medians; the two-thread
efficiency is the one-thread CPU step over twice the two-thread wall step (1.0: the step splits
evenly; what is missing is work on the calling thread only, fork/join waits and the two cores
sharing the memory bandwidth). A loaded host makes the two-thread wall meaningless (a thread
waits for its descheduled partner at every parallel region): read it on a quiet host.

``--regions``: the W1 engine step's OpenMP parallel regions (fork/joins) and the calling thread's
CPU time outside them at two threads (the serial part: norms, routing, glue, Python), beside the
one-thread CPU step, alternated in one process; then regions per step by calling library. It
builds benchmarks/gomp_regions.c (cc) into FITSERVE_HOME and reruns itself with it preloaded.
CPU time of the calling thread stays meaningful on a loaded host; the wall column does not.

``--paths``: one batch-1 decode step's forward (same inputs, same caches) through the module path
(``CausalLM.forward``), the flat Python loop and the native ``decode_layers`` (runner/
decode_loop.py), alternated step by step, medians of wall time and of this thread's CPU time
(``time.thread_time``: with ``--threads 1`` the whole step's work, the other processes of a
loaded host left out).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_engine import GREEDY, op_table, step_ms  # noqa: E402
from timing import median_seconds  # noqa: E402

from fitserve.config import EngineConfig  # noqa: E402
from fitserve.engine.core import Engine  # noqa: E402
from fitserve.kernels.cpu.fused import argmax  # noqa: E402
from fitserve.model.moe import SparseMoeBlock, route  # noqa: E402
from fitserve.runner.model_runner import decode_rows_first  # noqa: E402
from fitserve.types import ScheduledChunk  # noqa: E402


def module_split(engine: Engine, steps: int = 10) -> str:
    """ms per step spent in each kind of module (nested kinds overlap: experts within MoE)."""
    model = engine.runner.model
    spent: dict[str, float] = defaultdict(float)
    started: dict[int, float] = {}

    def kind(name: str, mod: nn.Module) -> str | None:
        if isinstance(mod, SparseMoeBlock):
            return "MoE blocks (all)"
        if ".experts." in name and name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj"):
            return "  expert linears"  # the per-expert loop only (the grouped call is one op)
        if name.endswith("mlp.gate"):
            return "  router linear"
        if name.endswith("self_attn"):
            return "attention (all)"
        if name.endswith("lm_head"):
            return "lm_head"
        return None

    hooks = []
    for name, mod in model.named_modules():
        k = kind(name, mod)
        if k is None:
            continue

        def pre(m: nn.Module, _a: object) -> None:
            started[id(m)] = time.perf_counter()

        def post(m: nn.Module, _a: object, _o: object, k: str = k) -> None:
            spent[k] += time.perf_counter() - started.pop(id(m))

        hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = (time.perf_counter() - t) / steps
    for h in hooks:
        h.remove()
    lines = [f"    {'module':<22}{'ms/step':>9}{'share':>8}"]
    for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {k:<22}{v / steps * 1e3:9.2f}{v / steps / total:8.0%}")
    lines.append(f"    {'(whole step)':<22}{total * 1e3:9.2f}")
    return "\n".join(lines)


@torch.inference_mode()
def path_ab(engine: Engine, rounds: int = 40) -> str:
    """Median ms (wall, thread CPU) of one batch-1 decode forward per path, paths alternated."""
    runner, loop = engine.runner, engine.runner.decode_loop
    if loop is None:
        return "    the decode loop does not apply to this model (DecodeLoop.supports)"
    prompt, table = list(range(100, 132)), list(range(1, 5))
    runner.forward_chunks([ScheduledChunk("ab", prompt, 0, table, sample=False)])
    ids, pos, batch = runner._prepare(decode_rows_first(
        [ScheduledChunk("ab", [7], len(prompt), table, sample=False)]))
    assert loop.applies(batch, runner.kv_caches, len(ids))

    def via_loop(native: bool) -> Callable[[], object]:
        def run() -> object:
            loop.native = native
            return loop(ids, pos, batch, runner.kv_caches)
        return run

    paths = {"module path": lambda: runner.model(ids, pos, batch, runner.kv_caches),
             "Python loop": via_loop(False), "decode_layers": via_loop(True)}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in paths}
    for r in range(rounds + 3):
        for name, fn in paths.items():
            t, c = time.perf_counter(), time.thread_time()
            fn()
            if r >= 3:  # warm-up rounds (plans, bound kernels)
                times[name].append((time.perf_counter() - t, time.thread_time() - c))
    native = loop.native_calls > 0
    lines = [f"    {'path':<16}{'wall ms':>9}{'cpu ms':>9}"]
    for name, ts in times.items():
        wall, cpu = (statistics.median(x[i] for x in ts) * 1e3 for i in (0, 1))
        lines.append(f"    {name:<16}{wall:9.2f}{cpu:9.2f}"
                     + ("" if native or name != "decode_layers" else "  (plan not made: Python)"))
    return "\n".join(lines)


def cpu_ms(fn: Callable[[], object], rounds: int = 15) -> float:
    """Median thread CPU ms of fn() over rounds (after one warm-up)."""
    return median_seconds(fn, rounds, time.thread_time) * 1e3


def attention_parts(runner: Any, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The attention side of every layer at batch 1, each op kind over all layers on its own
    (the ops decode_layers calls, on this step's positions, slots and caches)."""
    from fitserve.runner.decode_loop import DEFAULT_PARTITION  # noqa: PLC0415

    model, kv = runner.model, runner.kv_caches
    layers = list(model.layers)
    att = [layer.self_attn for layer in layers]
    a0 = att[0]
    hq, hkv, hd = a0.num_heads, a0.num_kv, a0.head_dim
    qkv = [a.qkv_proj(x) for a in att]
    qk = [t[:, : (hq + hkv) * hd].view(1, hq + hkv, hd) for t in qkv]
    v = [t[:, (hq + hkv) * hd :].view(1, hkv, hd) for t in qkv]
    pos, slots = torch.tensor([32]), torch.tensor([32])
    tables, lens = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32), torch.tensor([33],
                                                                                 dtype=torch.int32)
    rot, fused = model.rotary, torch.ops.fitserve_fused
    o_in = torch.randn(1, hq * hd, dtype=x.dtype)
    parts: dict[str, Callable[[], object]] = {
        "  q/k/v projections": lambda: [a.qkv_proj(x) for a in att],
        "  o projections": lambda: [a.o_proj(o_in) for a in att],
        "  RoPE + KV write": lambda: [fused.rope_write_kv_(q, w, pos, rot.cos, rot.sin, c[0],
                                                           c[1], slots, hq, rot.interleaved)
                                      for q, w, c in zip(qk, v, kv, strict=True)],
        "  attention": lambda: [torch.ops.fitserve.paged_decode_attention(
            q[:, :hq], c[0], c[1], tables, lens, a0.scale, 0, DEFAULT_PARTITION, True)
            for q, c in zip(qk, kv, strict=True)],
        "  residual adds + norms": lambda: [fused.add_rms_norm_(x.clone(), x, n.weight, n.eps)
                                            for layer in layers for n in (
                                                layer.input_layernorm,
                                                layer.post_attention_layernorm)],
    }
    if a0.q_norm is not None and not a0.norm_whole:
        # NOTE: as decode_layers runs them (decode_moe.h norm_qk): one rms_norm over all heads
        w = [torch.cat((a.q_norm.weight.expand(hq, hd), a.k_norm.weight.expand(hkv, hd)))
             for a in att]
        parts["  q/k norms"] = lambda: [
            wi * torch.rms_norm(q.float(), (hd,), eps=a.q_norm.eps).to(q.dtype)
            for wi, q, a in zip(w, qk, att, strict=True)]
    elif a0.q_norm is not None:
        parts["  q/k norms"] = lambda: [a.norm_qk(t, q) for a, t, q in zip(att, qkv, qk,
                                                                            strict=True)]
    return parts


@torch.inference_mode()
def cpu_split(engine: Engine) -> str:
    """A W1 step's thread CPU ms by part (run it with --threads 1): the whole engine step, the
    forward alone (the decode loop as the engine runs it), and each op kind called on its own
    over every layer with one token: the MoE parts (router linear, routing, the grouped expert
    op), the attention side (attention_parts), the lm_head and the greedy pick; the rest of the
    forward (decode_layers' glue: views, casts, concatenations, the embedding) and of the step
    (scheduler, input tensors, outputs: Python) by difference."""
    runner, model = engine.runner, engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    x = torch.randn(1, runner.spec.hidden_size).bfloat16()
    gen = torch.Generator().manual_seed(0)
    for b in blocks:
        b.combine(x, *moe_route(b, x))  # builds the grouped experts
    routes = [moe_route(b, torch.randn(1, x.shape[1], generator=gen).bfloat16()) for b in blocks]
    logits = [b.gate(x) for b in blocks]
    loop, prompt, table = runner.decode_loop, list(range(100, 132)), list(range(1, 5))
    runner.forward_chunks([ScheduledChunk("split", prompt, 0, table, sample=False)])
    ids, pos, batch = runner._prepare(decode_rows_first(
        [ScheduledChunk("split", [7], len(prompt), table, sample=False)]))
    forward = (lambda: loop(ids, pos, batch, runner.kv_caches)) if loop is not None and \
        loop.applies(batch, runner.kv_caches, len(ids)) else \
        (lambda: model(ids, pos, batch, runner.kv_caches))
    parts = {
        "forward": forward,
        "  router linears": lambda: [b.gate(x) for b in blocks],
        "  routing (softmax/topk)": lambda: [route(lg, b.top_k, b.renormalize)
                                             for b, lg in zip(blocks, logits, strict=True)],
        "  expert op": lambda: [b.combine(x, w, i) for b, (w, i) in zip(blocks, routes,
                                                                        strict=True)],
        **attention_parts(runner, x),
    }
    ms = {k: cpu_ms(fn) for k, fn in parts.items()}
    ms["  rest of the forward (glue)"] = ms["forward"] - sum(
        v for k, v in ms.items() if k.startswith("  "))
    engine.add_request(prompt, GREEDY)
    step = cpu_ms(lambda: engine.step())
    # NOTE: the decode loop returns hidden states: the lm_head runs after the forward
    head_out = model.compute_logits(x)
    after = {"after the forward": step - ms["forward"],
             "  lm_head (+ .float())": cpu_ms(lambda: model.compute_logits(x)),
             "  greedy pick (argmax)": cpu_ms(lambda: argmax(head_out))}
    after["  rest: scheduler, inputs, outputs"] = (after["after the forward"]
                                                   - after["  lm_head (+ .float())"]
                                                   - after["  greedy pick (argmax)"])
    ms = {"engine step (W1)": step, **ms, **after}
    lines = [f"    {'part':<34}{'cpu ms':>8}{'share':>8}"]
    for k, v in ms.items():
        lines.append(f"    {k:<34}{v:8.2f}{v / step:8.0%}")
    return "\n".join(lines)


@torch.inference_mode()
def threads_ab(engine: Engine, rounds: int, steps: int = 25) -> str:
    """W1 step medians at 1 thread (CPU, wall) and 2 threads (wall), alternated (see --threads-ab)."""
    engine.add_request(list(range(100, 132)), GREEDY)
    step_ms(engine, 5)
    one_cpu: list[float] = []
    one_wall: list[float] = []
    two_wall: list[float] = []
    lines = [f"    {'round':<7}{'load':>6}{'1t cpu ms':>11}{'1t wall ms':>12}{'2t wall ms':>12}"
             f"{'2t efficiency':>15}"]
    for r in range(rounds):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            engine.step()
            for _ in range(steps):
                if not engine.has_unfinished_requests():
                    engine.add_request(list(range(100, 132)), GREEDY)
                    engine.step()  # its prefill
                w, c = time.perf_counter(), time.thread_time()
                engine.step()
                w, c = (time.perf_counter() - w) * 1e3, (time.thread_time() - c) * 1e3
                if threads == 1:
                    one_cpu.append(c)
                    one_wall.append(w)
                else:
                    two_wall.append(w)
        cpu, wall1, wall2 = (statistics.median(v) for v in (one_cpu, one_wall, two_wall))
        lines.append(f"    {r:<7}{os.getloadavg()[0]:6.1f}{cpu:11.2f}{wall1:12.2f}{wall2:12.2f}"
                     f"{cpu / (2 * wall2):15.2f}")
    return "\n".join(lines)


SHIM_ENV = "FITSERVE_GOMP_REGIONS"


def preload_regions_shim() -> None:
    """Build gomp_regions.c and re-exec this process with it in LD_PRELOAD (once)."""
    if os.environ.get(SHIM_ENV):
        return
    from fitserve.envs import fitserve_home

    src = Path(__file__).resolve().parent / "gomp_regions.c"
    so = fitserve_home() / "gomp_regions.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(so), str(src), "-ldl"], check=True)
    env = {**os.environ, SHIM_ENV: "1",
           "LD_PRELOAD": ":".join(filter(None, [str(so), os.environ.get("LD_PRELOAD")]))}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


@torch.inference_mode()
def regions(engine: Engine, rounds: int, steps: int = 20) -> str:
    """W1 step at 1 thread (CPU) and 2 threads (regions, calling-thread CPU out/in them, wall)."""
    shim = ctypes.CDLL(None)
    shim.regions_cpu_s.restype = shim.regions_wall_s.restype = ctypes.c_double
    shim.regions_count.restype = ctypes.c_long
    shim.regions_table.argtypes = [ctypes.c_char_p, ctypes.c_double]
    engine.add_request(list(range(100, 132)), GREEDY)
    step_ms(engine, 5)
    got: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            engine.step()
            for _ in range(steps):
                if not engine.has_unfinished_requests():
                    engine.add_request(list(range(100, 132)), GREEDY)
                    engine.step()  # its prefill
                shim.regions_reset()
                w, c = time.perf_counter(), time.thread_time()
                engine.step()
                w, c = (time.perf_counter() - w) * 1e3, (time.thread_time() - c) * 1e3
                if threads == 1:
                    got["1t cpu ms"].append(c)
                    continue
                inside = shim.regions_cpu_s() * 1e3
                got["2t regions"].append(shim.regions_count())
                got["2t cpu out ms"].append(c - inside)
                got["2t cpu in ms"].append(inside)
                got["2t wall ms"].append(w)
    table = Path(f"/tmp/gomp_regions_{os.getpid()}.tsv")  # regions by library, over `steps`
    shim.regions_reset()
    for _ in range(steps):
        engine.step()
    shim.regions_table(str(table).encode(), float(steps))
    per_lib: dict[str, float] = defaultdict(float)
    for line in table.read_text().splitlines():
        lib, n, _cpu = line.split("\t")
        per_lib[re.sub(r"_[0-9a-f]{16}\.so$", "", lib)] += float(n)  # an extension's hash
    table.unlink()
    lines = [f"    load {os.getloadavg()[0]:.1f}; medians over {rounds} x {steps} steps each:"]
    lines += [f"    {k:<16}{statistics.median(v):9.2f}" for k, v in got.items()]
    lines.append("    regions per step by library: " + ", ".join(
        f"{lib} {n:.0f}" for lib, n in sorted(per_lib.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def moe_route(block: SparseMoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return route(block.gate(x), block.top_k, block.renormalize)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-expert", action="store_true",
                    help="the per-expert loop instead of the grouped C++ call (the old path)")
    ap.add_argument("--cpu-split", action="store_true",
                    help="only a W1 step's thread CPU time by part (use --threads 1)")
    ap.add_argument("--threads-ab", action="store_true",
                    help="only the W1 step at 1 and 2 threads, alternated in this process")
    ap.add_argument("--regions", action="store_true",
                    help="only the W1 step's parallel regions and serial CPU (see the doc)")
    ap.add_argument("--rounds", type=int, default=4, help="--threads-ab's / --regions' rounds")
    ap.add_argument("--paths", action="store_true",
                    help="only the A/B of the module path, Python loop and decode_layers")
    args = ap.parse_args()
    if args.regions:
        preload_regions_shim()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.gguf, dtype="bfloat16", weights="as-stored",
                                 device="cpu", max_model_len=1024))
    if args.per_expert:
        for mod in engine.runner.model.modules():
            if isinstance(mod, SparseMoeBlock):
                mod.allow_grouped = False
    if args.cpu_split:
        print(f"W1 step by part, {args.threads} thread(s), load "
              f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}:")
        print(cpu_split(engine))
        return
    if args.threads_ab:
        print("W1 engine step, 1 thread (thread CPU, wall) vs 2 threads (wall), alternated; "
              "medians so far after each round:")
        print(threads_ab(engine, args.rounds))
        return
    if args.regions:
        print("W1 engine step: 1 thread (thread CPU) vs 2 threads (OpenMP regions per step, the "
              "calling thread's CPU outside / inside them, wall), alternated:")
        print(regions(engine, args.rounds))
        return
    if args.paths:
        print(f"one batch-1 decode forward, {args.threads} thread(s), load "
              f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}:")
        print(path_ab(engine))
        return
    engine.add_request(list(range(100, 132)), GREEDY)
    step_ms(engine, 5)
    print(f"W1 decode step ({args.threads} threads): {step_ms(engine):.2f} ms median")
    print(op_table(engine, top=12))
    print(module_split(engine))


if __name__ == "__main__":
    main()
