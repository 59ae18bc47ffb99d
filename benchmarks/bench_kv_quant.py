"""W1 decode speed with a quantized KV cache against bf16 KV, by context length (default model).

    .venv/bin/python benchmarks/bench_kv_quant.py
    .venv/bin/python benchmarks/bench_kv_quant.py --contexts 128,1024,4096,8192 --rounds 3

One request of a ``ctx``-token prompt (random token ids, fixed seed) then ``--new`` greedy
tokens, EOS ignored, on the default model's GGUF as stored (Q4_1) with bf16 activations. The
KV configs: bf16 (dense), int8 (its auto scales: per-channel keys), int8-token, fp8_e4m3 and
fp8_e5m2 (per token), and int8-dequant: int8 through the old path (each layer dequantizes the
blocks it reads into a compact bf16 cache before the dense kernel), for reference. Each config
runs in its own process; --rounds repeats the whole set round-robin so the shared host's slow
periods fall on all alike. Per context: one warm-up request (it also fills the prefix cache, so
the timed runs re-prefill only the prompt's last partial block), then --runs timed requests;
decode tok/s = (new - 1) / (last token time - first token time). Prints medians over all
rounds and each config's ratio to bf16 at each context.

--kernel times the attention op alone instead (no model, no cache write): one layer's decode
attention of the default model's shape (3 KV heads x 3 query heads each x 64 dims, 16-token
blocks in shuffled order) at each context, the dense bf16 kernel against the quantized one per
codec and scale layout, median of --runs x 200 calls; ratios to bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# name -> (--kv-cache-dtype, --kv-cache-scales, read the codes in place)
CONFIGS: dict[str, tuple[str, str, bool]] = {
    "bf16": ("auto", "auto", True),
    "int8": ("int8", "auto", True),
    "int8-token": ("int8", "token", True),
    "fp8_e4m3": ("fp8_e4m3", "auto", True),
    "fp8_e5m2": ("fp8_e5m2", "auto", True),
    "int8-dequant": ("int8", "auto", False),
}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    kv_dtype, scales, in_place = CONFIGS[spec["config"]]
    contexts: list[int] = spec["contexts"]
    new = spec["new"]
    engine = Engine(EngineConfig(model=spec["gguf"], dtype="bfloat16", weights="as-stored",
                                 device="cpu", max_model_len=max(contexts) + new + 16,
                                 enforce_eager=True, kv_cache_dtype=kv_dtype,  # type: ignore[arg-type]
                                 kv_cache_scales=scales))  # type: ignore[arg-type]
    runner = engine.runner
    if not in_place:
        runner.use_kvq = False  # the old path: dequantize the step's blocks, then the dense kernel
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, list[float]] = {}
    for ctx in contexts:
        prompt = torch.randint(100, 40000, (ctx,), generator=gen).tolist()

        def run(prompt: list[int] = prompt) -> float:
            times = []
            for o in engine.stream(prompt, params):
                times += [time.perf_counter()] * len(o.delta_token_ids)
            return (new - 1) / (times[-1] - times[0])

        run()
        out[str(ctx)] = [run() for _ in range(spec["runs"])]
    backend = runner._decode_batch([[0]], [1], runner.use_kvq).backend.name
    return {"config": spec["config"], "tok_s": out, "decode_backend": backend,
            "kv_format": runner.kv_format}


def kernel_bench(contexts: list[int], runs: int, threads: int, batch: int) -> None:
    import torch

    from fitserve.kernels.cpu.paged_attention import paged_decode_attention
    from fitserve.kernels.cpu.paged_attention_kvq import paged_decode_attention_kvq
    from fitserve.quant.kv_cache import QuantizedKVCache

    torch.set_num_threads(threads)
    hkv, g, d, bs = 3, 3, 64, 16
    print(f"{'context':>8} {'layout':>12} " + " ".join(f"{c:>14s}" for c in
                                                       ("bf16 us", "int8", "fp8_e4m3", "fp8_e5m2")))
    for ctx in contexts:
        nb = batch * -(-ctx // bs)
        tables = torch.randperm(nb, dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        q = torch.randn(batch, hkv * g, d).bfloat16()
        kd, vd = torch.randn(hkv, nb, bs, d).bfloat16(), torch.randn(hkv, nb, bs, d).bfloat16()

        def median_us(fn: Any) -> float:
            fn()
            ts = []
            for _ in range(runs):
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                ts.append((time.perf_counter() - t0) / 200 * 1e6)
            return statistics.median(ts)

        dense = median_us(lambda: paged_decode_attention(q, kd, vd, tables, lens, 0.125))
        for layout in ("token", "channel-key"):
            row = []
            for codec in ("int8", "fp8_e4m3", "fp8_e5m2"):
                kv = QuantizedKVCache(codec, layout, num_kv_heads=hkv, num_blocks=nb,
                                      block_size=bs, head_dim=d)
                kv.write(kd.float().transpose(0, 1).reshape(nb * bs, hkv, d)[:, :, :],
                         vd.float().transpose(0, 1).reshape(nb * bs, hkv, d),
                         torch.arange(nb * bs))
                us = median_us(lambda kv=kv: paged_decode_attention_kvq(
                    q, kv.k_codes, kv.v_codes, kv.k_scales, kv.v_scales, tables, lens, 0.125,
                    codec=kv.codec.name, channel_keys=layout == "channel-key"))
                row.append(dense / us)
            print(f"{ctx:>8} {layout:>12} {dense:14.1f} " + " ".join(f"{r:13.2f}x" for r in row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--contexts", default="128,1024,2048,4096,8192")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel", action="store_true", help="time the attention op alone")
    ap.add_argument("--batch", type=int, default=1, help="sequences per call (--kernel)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.spec))))
        return
    sys.path.insert(0, str(HERE.parent))
    from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
    from fitserve.loading.pull import pull

    contexts = [int(c) for c in args.contexts.split(",")]
    if args.kernel:
        print(f"CPU: {cpu_model_name()}; {os.cpu_count()} CPUs; ISA: {detect_isa().describe()}; "
              f"threads {args.threads}; batch {args.batch}; kernel time ratio bf16 / quantized")
        kernel_bench(contexts, args.runs, args.threads, args.batch)
        return
    configs = args.configs.split(",")
    base = {"gguf": str(pull("smollm2-135m", progress=False)), "contexts": contexts,
            "new": args.new, "runs": args.runs, "threads": args.threads}
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    runs: dict[str, dict[str, list[float]]] = {c: {str(x): [] for x in contexts} for c in configs}
    info: dict[str, str] = {}
    for _ in range(args.rounds):
        for cfg in configs:
            proc = subprocess.run([sys.executable, __file__, "--worker",
                                   json.dumps({**base, "config": cfg})],
                                  capture_output=True, text=True, env=env, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            info[cfg] = f"{r['kv_format']} via {r['decode_backend']}"
            for ctx, vals in r["tok_s"].items():
                runs[cfg][ctx] += vals
    print(f"CPU: {cpu_model_name()}; {os.cpu_count()} CPUs; ISA: {detect_isa().describe()}; "
          f"threads {args.threads}")
    print(f"W1 decode tok/s, medians of {args.rounds} x {args.runs} runs, {args.new} new tokens")
    for cfg in configs:
        print(f"  {cfg:13s} {info[cfg]}")
    print(f"{'context':>8} " + " ".join(f"{c:>13s}" for c in configs))
    for ctx in map(str, contexts):
        med = {c: statistics.median(runs[c][ctx]) for c in configs}
        print(f"{ctx:>8} " + " ".join(f"{med[c]:13.1f}" for c in configs))
        if "bf16" in med:
            print(f"{'x bf16':>8} " + " ".join(f"{med[c] / med['bf16']:13.2f}" for c in configs))


if __name__ == "__main__":
    main()
