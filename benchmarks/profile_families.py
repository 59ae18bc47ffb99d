"""Where Gemma 3's 256k vocabulary costs: the tied lm_head's GEMV and the load's peak RSS
(bench_families.py's files, as stored).

    .venv/bin/python benchmarks/profile_families.py ~/.cache/fitserve/bench/families-gemma3-q8_0.gguf

1. Load phases: resident memory (anon / file-backed) before and after, and the peak of each,
   for opening the file, building the tokenizer, reading the weights and building the model
   (the peak is reset per phase through /proc/self/clear_refs).
2. What the tied output is held as (its module, format, bytes, whether it shares the
   embedding's buffers).
3. CPU milliseconds per batch-1 call of that lm_head beside int8 GEMVs of the same bytes with
   other row lengths (K) and a plain float32 read of the same bytes, on ``--threads`` threads
   (process CPU time, so a loaded host's waiting is not counted; GB/s per CPU-second).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from timing import median_seconds  # the sibling module: scripts run from benchmarks/


def memory() -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) // 1024
    return out


def phased(module: Any, name: str) -> None:
    """Wrap ``module.name`` to print the memory before / after it and its own peak."""
    real = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = memory()
        result = real(*args, **kwargs)
        after = memory()
        print(f"  {name:<26} RSS {before['VmRSS']:5d} -> {after['VmRSS']:5d} MiB (anon "
              f"{before['RssAnon']} -> {after['RssAnon']}, file {before['RssFile']} -> "
              f"{after['RssFile']}), peak {after['VmHWM']} MiB")
        return result

    setattr(module, name, wrapper)


def cpu_ms(fn: Callable[[], Any], repeat: int = 9) -> float:
    return median_seconds(fn, repeat, time.process_time) * 1e3


def gemv_rates(head: torch.nn.Module) -> None:
    from fitserve.model.linear import PackedLinear
    from fitserve.quant.packed import pack

    def line(label: str, ms: float, nbytes: int) -> None:
        print(f"  {label:<34} {ms:7.2f} ms CPU  {nbytes / ms / 1e6:6.1f} GB/s per CPU-s")

    def held(lin: Any) -> int:
        return sum(t.numel() * t.element_size() for t in lin.buffers())

    with torch.inference_mode():
        x = torch.randn(1, head.in_features, dtype=torch.bfloat16)
        line(f"tied lm_head {head.out_features} x {head.in_features}", cpu_ms(lambda: head(x)),
             held(head))
        total = head.out_features * head.in_features
        if isinstance(head, PackedLinear):  # int8 GEMVs of the same bytes, other K
            for k in (512, 1024, 2048):
                n = total // k
                q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
                lin = PackedLinear(pack("int8", q, torch.rand(n, k // 32) * 0.01, None, 32, k))
                lin.act_quant = head.act_quant
                xk = torch.randn(1, k, dtype=torch.bfloat16)
                line(f"int8 GEMV {n} x {k}", cpu_ms(lambda lin=lin, xk=xk: lin(xk)), held(lin))
                del lin, q
        plain = torch.ones(held(head) // 4)
        line("float32 sum of the same bytes", cpu_ms(lambda: plain.sum()), plain.numel() * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import fitserve.engine.builder as builder
    import fitserve.loading.gguf as gguf_loading
    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine

    for name in ("open_gguf", "tokenizer_from_gguf", "read_gguf_weights"):
        phased(gguf_loading, name)
    phased(builder, "build_model")
    print(f"load phases ({args.gguf.name}; start {memory()['VmRSS']} MiB):")
    engine = Engine(EngineConfig(model=str(args.gguf), dtype="bfloat16", weights="as-stored",
                                 device="cpu", max_model_len=1024, enforce_eager=True))
    print(f"  engine ready: {memory()}")
    model = engine.runner.model
    head, emb = model.lm_head, model.embed_tokens
    shared = {b.data_ptr() for b in head.buffers()} <= {b.data_ptr() for b in emb.buffers()}
    print(f"tied output: {head} over the embedding's buffers: {shared}; "
          f"{sum(b.numel() * b.element_size() for b in head.buffers()) / 2**20:.0f} MiB")
    print(f"batch-1 GEMV, {args.threads} thread(s):")
    gemv_rates(head)


if __name__ == "__main__":
    main()
