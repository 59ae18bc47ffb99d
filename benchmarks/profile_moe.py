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

``--paths``: one batch-1 decode step's forward (same inputs, same caches) through the module path
(``CausalLM.forward``), the flat Python loop and the native ``decode_layers`` (runner/
decode_loop.py), alternated step by step, medians of wall time and of this thread's CPU time
(``time.thread_time``: with ``--threads 1`` the whole step's work, the other processes of a
loaded host left out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_engine import GREEDY, op_table, step_ms  # noqa: E402

from fitserve.config import EngineConfig  # noqa: E402
from fitserve.engine.core import Engine  # noqa: E402
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
    fn()
    times = []
    for _ in range(rounds):
        c = time.thread_time()
        fn()
        times.append((time.thread_time() - c) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def cpu_split(engine: Engine) -> str:
    """A W1 step's thread CPU ms by part (run it with --threads 1): the whole engine step, the
    forward alone (the decode loop as the engine runs it), and the MoE parts and the lm_head
    called on their own over every layer with one token (router linear, routing: softmax /
    top-k / renormalise, the grouped expert op), the rest of the forward by difference."""
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
    engine.add_request(prompt, GREEDY)
    parts = {
        "engine step (W1)": lambda: engine.step(),
        "forward": forward,
        "  router linears": lambda: [b.gate(x) for b in blocks],
        "  routing (softmax/topk)": lambda: [route(lg, b.top_k, b.renormalize)
                                             for b, lg in zip(blocks, logits, strict=True)],
        "  expert op": lambda: [b.combine(x, w, i) for b, (w, i) in zip(blocks, routes,
                                                                        strict=True)],
    }
    ms = {k: cpu_ms(fn) for k, fn in parts.items()}
    ms["  rest (attention, norms, ...)"] = ms["forward"] - sum(
        v for k, v in ms.items() if k.startswith("  "))
    # NOTE: the decode loop returns hidden states: the lm_head runs after the forward
    ms["after the forward"] = ms["engine step (W1)"] - ms["forward"]
    ms["  of which the lm_head"] = cpu_ms(lambda: model.lm_head(x).float())
    lines = [f"    {'part':<30}{'cpu ms':>8}{'share':>8}"]
    for k, v in ms.items():
        lines.append(f"    {k:<30}{v:8.2f}{v / ms['engine step (W1)']:8.0%}")
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
    ap.add_argument("--paths", action="store_true",
                    help="only the A/B of the module path, Python loop and decode_layers")
    args = ap.parse_args()
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
