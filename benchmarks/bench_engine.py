"""W1 (single stream) and W2 (offline batch) on the default model: fitserve vs transformers.

    .venv/bin/python benchmarks/bench_engine.py                 # bf16 and fp32, 3 runs each
    .venv/bin/python benchmarks/bench_engine.py --dtypes bf16 --runs 5 --json out.json

Both engines run in this process on the same weights (the SmolLM2 Q4_1 GGUF dequantized),
with the same thread count, greedy decoding and ignore-EOS, after one warm-up run each; the
tables report medians. W1: 1 request, 32-token prompt, 128 new tokens (TTFT, decode tok/s, and
decode as a fraction of the memory-bandwidth limit). W2: 32 requests x 128-token prompt x 128
new tokens (output tok/s, wall clock including prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch

from fitserve.config import EngineConfig
from fitserve.engine import Engine
from fitserve.loading import load_model
from fitserve.loading.pull import pull
from fitserve.sampling import SamplingParams

TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines "
    "were programmed by rewiring panels; later, stored programs let a single machine perform many "
    "tasks. Compilers translated human-readable code into instructions, operating systems shared "
    "hardware among programs, and networks connected machines across the world. Each layer hid "
    "the complexity below it while exposing new possibilities above. Today, large language models "
    "are served by engines that batch thousands of requests, page their attention caches like "
    "virtual memory, and schedule work token by token to keep accelerators busy. "
) * 8


@dataclass
class Row:
    engine: str
    dtype: str
    workload: str
    ttft_ms: float | None
    tok_s: float
    runs: list[float]


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return [ids[i * 7 : i * 7 + length] for i in range(n)]


def median_of(fn: Callable[[], tuple[float | None, float]], runs: int) -> tuple[float | None, float, list[float]]:
    fn()  # warm-up
    results = [fn() for _ in range(runs)]
    ttfts = [r[0] for r in results if r[0] is not None]
    rates = [r[1] for r in results]
    return (statistics.median(ttfts) if ttfts else None), statistics.median(rates), rates


# -- fitserve -----------------------------------------------------------------------------------
def fitserve_w1(engine: Engine, prompt: list[int], new: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    first = last = 0.0
    n = 0
    for out in engine.stream(prompt, params):
        now = time.perf_counter()
        n += len(out.delta_token_ids)
        if n == 1:
            first = now
        last = now
    assert n == new
    return (first - start) * 1e3, (new - 1) / (last - first)


def fitserve_w2(engine: Engine, batch: list[list[int]], new: int) -> tuple[None, float]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    for p in batch:
        engine.add_request(p, params)
    total = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            total += len(out.delta_token_ids)
    assert total == new * len(batch)
    return None, total / (time.perf_counter() - start)


# -- transformers -------------------------------------------------------------------------------
class _Clock:
    """A generate() streamer that only records when each new token arrived."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_w1(model, prompt: list[int], new: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    clock = _Clock()
    start = time.perf_counter()
    model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   streamer=clock, pad_token_id=0)
    # the first put() is the prompt itself; the next is the first new token
    first, last = clock.times[1], clock.times[-1]
    return (first - start) * 1e3, (new - 1) / (last - first)


def hf_w2(model, batch: list[list[int]], new: int) -> tuple[None, float]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out = model.generate(torch.tensor(batch), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0)
    assert out.shape[1] == len(batch[0]) + new
    return None, len(batch) * new / (time.perf_counter() - start)


def bandwidth_limit(weight_bytes: int) -> tuple[float, float]:
    """(measured copy bandwidth in B/s, the W1 tok/s limit it implies for these weights)."""
    from fitserve.plan.hardware import cpu_hardware

    hw = cpu_hardware()
    return hw.mem_bytes_per_s, hw.mem_bytes_per_s / weight_bytes


def bench_dtype(name: str, path, args: argparse.Namespace, extra: dict[str, float]) -> list[Row]:  # type: ignore[no-untyped-def]
    """W1 and W2 for one dtype: fitserve first, then transformers on the same weights."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
    loaded = load_model(path, dtype=torch.float32)
    tok = loaded.tokenizer
    w1_prompt = prompts(tok, 1, 32)[0]
    w2_batch = prompts(tok, args.w2_requests, 128)
    engine = Engine(EngineConfig(model=str(path), dtype="bfloat16" if name == "bf16" else "float32",
                                 device="cpu", max_model_len=1024), loaded=loaded)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    bw, limit = bandwidth_limit(weight_bytes)
    extra[f"{name}_weight_bytes"] = weight_bytes
    extra[f"{name}_w1_limit_tok_s"] = limit
    extra["copy_bandwidth_GBps"] = bw / 1e9
    extra[f"{name}_roofline_step_ms"] = roofline_step_ms(engine, name)
    rows = []
    ttft, rate, runs = median_of(partial(fitserve_w1, engine, w1_prompt, 128), args.runs)
    rows.append(Row("fitserve", name, "W1", ttft, rate, runs))
    _, rate, runs = median_of(partial(fitserve_w2, engine, w2_batch, 128), args.runs)
    rows.append(Row("fitserve", name, "W2", None, rate, runs))
    del engine, loaded
    if not args.skip_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).to(dtype).eval()
        with torch.inference_mode():
            ttft, rate, runs = median_of(partial(hf_w1, hf, w1_prompt, 128), args.runs)
            rows.append(Row("transformers", name, "W1", ttft, rate, runs))
            _, rate, runs = median_of(partial(hf_w2, hf, w2_batch, 128), max(1, args.runs - 1))
            rows.append(Row("transformers", name, "W2", None, rate, runs))
    return rows


def roofline_step_ms(engine: Engine, name: str) -> float:
    """The ledger's W1 decode step (batch 1, mid-generation context) on this machine, in ms."""
    from fitserve.plan.hardware import cpu_hardware
    from fitserve.plan.speed import decode_step_roofline

    step = decode_step_roofline(engine.spec, cpu_hardware(), batch=1, context=32 + 64,
                                weight_fmt=name, kv_dtype=name)
    return step.seconds * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--w2-requests", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = pull("smollm2-135m", progress=False)
    rows: list[Row] = []
    extra: dict[str, float] = {}
    for name in args.dtypes.split(","):
        rows += bench_dtype(name, path, args, extra)
    report(rows, extra, args.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "extra": extra}, f, indent=2)


def report(rows: list[Row], extra: dict[str, float], threads: int) -> None:
    print(f"\nthreads={threads}  copy bandwidth {extra['copy_bandwidth_GBps']:.1f} GB/s (numpy, measured)")
    print(f"{'engine':<13}{'dtype':<6}{'workload':<9}{'TTFT ms':>9}{'tok/s':>9}{'vs HF':>7}{'of limit':>9}  runs")
    for r in rows:
        peer = next((p for p in rows if p.engine == "transformers" and p.dtype == r.dtype
                     and p.workload == r.workload), None)
        ratio = f"{r.tok_s / peer.tok_s:6.2f}x" if peer and r.engine != "transformers" else "      -"
        limit = extra.get(f"{r.dtype}_w1_limit_tok_s")
        frac = f"{r.tok_s / limit:8.0%}" if r.workload == "W1" and limit else "        -"
        ttft = f"{r.ttft_ms:9.1f}" if r.ttft_ms is not None else "        -"
        runs = ", ".join(f"{x:.1f}" for x in r.runs)
        print(f"{r.engine:<13}{r.dtype:<6}{r.workload:<9}{ttft}{r.tok_s:9.1f}{ratio}{frac}  [{runs}]")
    for k in ("bf16", "fp32"):
        if f"{k}_w1_limit_tok_s" in extra:
            print(f"W1 bandwidth limit {k}: {extra[f'{k}_weight_bytes'] / 1e6:.0f} MB of weights per token "
                  f"-> {extra[f'{k}_w1_limit_tok_s']:.0f} tok/s; ledger roofline decode step "
                  f"{extra[f'{k}_roofline_step_ms']:.2f} ms")
            w1 = next((r for r in rows if r.engine == "fitserve" and r.dtype == k and r.workload == "W1"), None)
            if w1 is not None:
                print(f"  measured W1 decode step {1e3 / w1.tok_s:.2f} ms "
                      f"= {extra[f'{k}_roofline_step_ms'] * w1.tok_s / 1e3:.0%} of the roofline speed")


if __name__ == "__main__":
    main()
