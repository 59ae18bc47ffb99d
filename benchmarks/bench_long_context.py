"""Single-stream decode at long contexts (512, 2k, 4k, 8k tokens) on the default model:
fitserve beside llama.cpp on the same GGUF, each as tok/s and as a fraction of its bandwidth
limit, (weights + KV bytes read per token) / the copy bandwidth measured in the same run, and
for fitserve also over a plain read's bandwidth ("of read": issue 43.3's "measured read
bandwidth"; cpu_measure.measure_read_bandwidth, measured beside the copy).

    .venv/bin/python benchmarks/bench_long_context.py
    .venv/bin/python benchmarks/bench_long_context.py --contexts 512,4096 --new 64 --rounds 2

Context N: a prompt of N - new tokens, then ``new`` greedy tokens (EOS ignored), so the KV
grows from N - new to N during the timed steps. Each engine extends one prompt from context to
context (fitserve through its prefix cache, llama.cpp keeping its KV), so nothing is prefilled
twice; tok/s is 1 / the median step time (robust to a loaded host's stalls). fitserve's worker
also times the paged decode attention kernel alone at each context on the model's heads and
cache dtype (one step: every layer, each over its own cache): its KV bytes / time, and its
share of the step. The bandwidth (numpy copy, 2 threads, read + write counted, as
bench_engine.py's W1 limit) is measured before each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_engine import TEXT, run_worker  # noqa: E402
from bench_prefill import header, median_time  # noqa: E402


def kv_bytes_per_key(spec: Any, elem: int) -> int:
    """K and V bytes of one position over every layer."""
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * elem


def attention_seconds(spec: Any, dtype: Any, context: int, runs: int) -> float:
    """Seconds of one decode step's attention (batch 1, every layer) over ``context`` keys.

    NOTE: one cache per layer, as in a step: a single layer's KV (3 MB at 4k here) would stay
    in the last-level cache from run to run and time the cache, not the memory."""
    import torch

    from fitserve.kernels.cpu.paged_attention import paged_decode_attention

    bs = 16
    nb = -(-context // bs)
    table = torch.randperm(nb).to(torch.int32).unsqueeze(0)
    shape = (spec.num_kv_heads, nb, bs, spec.head_dim)
    kv = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
          for _ in range(spec.num_layers)]
    q = torch.randn(1, spec.num_heads, spec.head_dim).to(dtype)
    lens = torch.tensor([context], dtype=torch.int32)
    scale = spec.head_dim ** -0.5

    def step() -> None:
        for k, v in kv:
            paged_decode_attention(q, k, v, table, lens, scale)

    return median_time(step, runs)


def fitserve_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    contexts, new, ids = sorted(spec["contexts"]), spec["new_tokens"], spec["context_ids"]
    engine = Engine(EngineConfig(model=spec["gguf"], dtype="bfloat16", weights="as-stored",
                                 device="cpu", max_model_len=contexts[-1], enforce_eager=True))
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    steps: dict[str, list[float]] = {}
    for n in [contexts[0], *contexts]:  # the first one twice: a warm-up
        times: list[float] = []
        for out in engine.stream(ids[: n - new], params):
            times += [time.perf_counter()] * len(out.delta_token_ids)
        steps[str(n)] = [b - a for a, b in zip(times, times[1:], strict=False)]
    model = engine.runner.model
    cache = engine.runner.kv_caches[0][0]
    weight_bytes = sum(t.numel() * t.element_size() for t in
                       {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
                       if t.dim() >= 1 and t.numel() > 0)
    rope = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" in n)
    s = model.spec
    with torch.inference_mode():
        attn = {str(n): attention_seconds(s, cache.dtype, n, 5) for n in contexts}
    return {"engine": "fitserve", "decode_step_s": steps, "attention_s": attn,
            "weight_bytes": weight_bytes - rope,
            "kv_bytes_per_key": kv_bytes_per_key(s, cache.element_size())}


WORKERS = {"fitserve": fitserve_worker}


def tok_s(step_s: list[float]) -> float:
    return 1.0 / statistics.median(step_s)


def report(results: dict[str, list[dict[str, Any]]], bws: list[float], contexts: list[int],
           new: int, gguf_bytes: int, rbws: list[float]) -> None:
    bw, rbw = statistics.median(bws), statistics.median(rbws)
    fs, lc = results.get("fitserve") or [], results.get("llama.cpp") or []
    print(f"\ncopy bandwidth {bw / 1e9:.1f} GB/s, read {rbw / 1e9:.1f} GB/s (medians of "
          f"{len(bws)} measured before each round); limit = bandwidth / (weights + KV bytes at "
          f"the step's mean context)")
    if fs:
        print(f"fitserve reads {fs[0]['weight_bytes'] / 1e6:.1f} MB of weights + "
              f"{fs[0]['kv_bytes_per_key'] / 1e3:.1f} KB of KV per context token; llama.cpp "
              f"{gguf_bytes / 1e6:.1f} MB (the GGUF) + the same KV (f16)")
    print(f"{'context':>8}{'fitserve tok/s':>16}{'of limit':>9}{'of read':>8}{'llama.cpp tok/s':>17}"
          f"{'of limit':>9}{'ratio':>7}{'attn ms':>9}{'attn GB/s':>10}{'of step':>8}")
    for n in contexts:
        mean_ctx = n - new / 2
        row = f"{n:>8}"
        f_t = statistics.median(tok_s(r["decode_step_s"][str(n)]) for r in fs) if fs else None
        l_t = statistics.median(tok_s(r["decode_step_s"][str(n)]) for r in lc) if lc else None
        if fs and f_t:
            per_tok = fs[0]["weight_bytes"] + fs[0]["kv_bytes_per_key"] * mean_ctx
            row += f"{f_t:16.1f}{f_t * per_tok / bw:9.0%}{f_t * per_tok / rbw:8.0%}"
        else:
            row += f"{'-':>16}{'-':>9}{'-':>8}"
        if lc and l_t and fs:
            per_tok = gguf_bytes + fs[0]["kv_bytes_per_key"] * mean_ctx
            row += f"{l_t:17.1f}{l_t * per_tok / bw:9.0%}"
            row += f"{f_t / l_t:7.2f}" if f_t else f"{'-':>7}"
        else:
            row += f"{'-':>17}{'-':>9}{'-':>7}"
        if fs and f_t:
            a = statistics.median(r["attention_s"][str(n)] for r in fs)
            kv = fs[0]["kv_bytes_per_key"] * n
            row += f"{a * 1e3:9.2f}{kv / a / 1e9:10.1f}{a * f_t:8.0%}"
        print(row)


def main() -> None:
    from fitserve.ledger.cpu_measure import measure_copy_bandwidth, measure_read_bandwidth

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("--contexts", default="512,2048,4096,8192")
    ap.add_argument("--new", type=int, default=64, help="tokens decoded (timed) per context")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--peers", default="llamacpp")
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    ap.add_argument("--json", help="write every round's results here")
    args = ap.parse_args()
    if args.worker:
        with open(args.spec) as f:
            print(json.dumps(WORKERS[args.worker](json.load(f))))
        return
    from fitserve.loading import load_tokenizer
    from fitserve.loading.pull import pull

    gguf = str(pull("smollm2-135m", progress=False))
    contexts = sorted(int(c) for c in args.contexts.split(","))
    tok = load_tokenizer(gguf)
    ids: list[int] = []
    while len(ids) < contexts[-1]:
        ids += tok.encode(TEXT, add_special_tokens=False)
    spec = {"gguf": gguf, "context_ids": ids[: contexts[-1]], "contexts": contexts,
            "new_tokens": args.new, "threads": args.threads, "runs": 1}
    print(header())
    me = [sys.executable, str(Path(__file__).resolve())]
    jobs: dict[str, Any] = {"fitserve": lambda: run_worker([*me, "--worker", "fitserve"], spec)}
    if "llamacpp" in args.peers.split(","):
        if Path(args.llamacpp_python).exists():
            worker = str(HERE / "peers" / "llamacpp_context.py")
            jobs["llama.cpp"] = lambda: run_worker([args.llamacpp_python, worker], spec)
        else:
            print(f"llama.cpp: no venv at {args.llamacpp_python} (skipped)")
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in jobs}
    bws: list[float] = []
    rbws: list[float] = []
    for rnd in range(args.rounds):
        bws.append(measure_copy_bandwidth())
        rbws.append(measure_read_bandwidth())
        for name, job in jobs.items():
            r = job()
            if r is not None:
                results[name].append(r)
                rates = ", ".join(f"{n}: {tok_s(r['decode_step_s'][str(n)]):.1f}"
                                  for n in contexts)
                print(f"  round {rnd + 1}: {name} tok/s {rates} (load {os.getloadavg()[0]:.1f})",
                      flush=True)
    report(results, bws, contexts, args.new, Path(gguf).stat().st_size, rbws)
    print(f"load average at the end {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
