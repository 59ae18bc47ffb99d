"""Where one batch-1 decode step of an MoE GGUF goes (bench_moe.py's files, as stored).

    .venv/bin/python benchmarks/profile_moe.py ~/.cache/fitserve/bench/moe-small-q4_k_m.gguf
    .venv/bin/python benchmarks/profile_moe.py FILE --per-expert   # the per-expert loop instead

Prints the median W1 decode step, torch.profiler's top ATen ops by self CPU time over 5 steps
(profile_engine.op_table), and the step split by module: every SparseMoeBlock (router, grouping,
experts, combine), the experts' own linears within them, attention and the lm_head, timed with
forward hooks over 10 more steps (the hooks' own cost is in the totals).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_engine import GREEDY, op_table, step_ms  # noqa: E402

from fitserve.config import EngineConfig  # noqa: E402
from fitserve.engine.core import Engine  # noqa: E402
from fitserve.model.moe import SparseMoeBlock  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-expert", action="store_true",
                    help="the per-expert loop instead of the grouped C++ call (the old path)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.gguf, dtype="bfloat16", weights="as-stored",
                                 device="cpu", max_model_len=1024))
    if args.per_expert:
        for mod in engine.runner.model.modules():
            if isinstance(mod, SparseMoeBlock):
                mod.allow_grouped = False
    engine.add_request(list(range(100, 132)), GREEDY)
    step_ms(engine, 5)
    print(f"W1 decode step ({args.threads} threads): {step_ms(engine):.2f} ms median")
    print(op_table(engine, top=12))
    print(module_split(engine))


if __name__ == "__main__":
    main()
