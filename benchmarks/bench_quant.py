"""Quantization on the default model and a second (random-weight) one: what each format costs
in bytes, memory and speed, and what it breaks; and the KV formats' capacity and damage.

    .venv/bin/python benchmarks/bench_quant.py                       # every part
    .venv/bin/python benchmarks/bench_quant.py --parts kv --tokens 1024 --runs 3 --json out.json

Part "weights" (default model, SmolLM2-135M): bf16, the GGUF's Q4_1 as stored, int8 RTN
(--weights int8), int4 g128 RTN / AWQ / GPTQ (folders written by `fitserve quantize`, cached in
$FITSERVE_HOME/bench/quant), fp8 e4m3 per-channel (--weights fp8). Each runs in its own process
(peak RSS is its own): bits per weight and weight bytes from the engine's ledger (equal to
what the model holds: the engine checks it), W1 (1 request, 32-token prompt, 128 new tokens,
decode tok/s) and W2 (--w2-requests x 128-token prompt x 128 new tokens, output tok/s),
medians of --runs after a warm-up; transformers (bf16) runs the same W1/W2 beside them. Then
`fitserve eval`'s metrics against the float32 model (the GGUF dequantized: every candidate is
a re-quantization of it) on --tokens of the shipped held-out text: per-token KL, top-1 flip
rate, perplexity, each with its block-bootstrap 95% CI.
Part "random": the same quality table on a random-weight Llama (hidden 512, 8 layers, GQA) for
int8, int4 RTN/AWQ/GPTQ and fp8 against its float32 self.
Part "kv": each KV format: bytes per token, blocks in 1 GiB (the engine's pool at
--kv-cache-memory 1G, equal to the ledger's), concurrent 4k-token sequences those blocks hold,
W1 decode tok/s, and KL / flip rate / greedy agreement against the bf16 cache.
Part "extras": the FP8 attention simulation, SmoothQuant W8A8 on injected outlier channels,
the per-layer sensitivity sweep (and a mix of the worst layers against the sum of their single
damages), and the calibration-shift experiment.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_engine import (
    cpu_description,
    peak_rss_mib,
    run_worker,
    transformers_worker,
    workload_spec,
)

KV_CASES = [("auto", "auto"), ("int8", "token"), ("int8", "channel-key"), ("fp8_e4m3", "token"),
            ("fp8_e4m3", "channel-key"), ("fp8_e5m2", "token"), ("fp8_e5m2", "channel-key")]
GIB = 1 << 30


def weight_cases(folders: dict[str, str], gguf: str) -> dict[str, dict[str, Any]]:
    """name -> EngineConfig fields of each weights candidate on the default model."""
    return {
        "bf16": {"model": gguf, "weights": "bf16"},
        "Q4_1 as stored": {"model": gguf, "weights": "as-stored", "dtype": "bfloat16"},
        "int8 RTN": {"model": gguf, "weights": "int8", "dtype": "bfloat16"},
        **{f"int4 {m.upper()} g128": {"model": folders[m], "dtype": "bfloat16"} for m in folders},
        "fp8 e4m3": {"model": gguf, "weights": "fp8", "dtype": "bfloat16"},
    }


# -- the worker (one process per configuration) ------------------------------------------------
def fitserve_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.ledger.params import count_params
    from fitserve.model.loader import held_weight_bytes
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(device="cpu", max_model_len=1024, **spec["engine"]))
    startup = time.perf_counter() - t0
    new = spec["new_tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)

    def w1() -> float:
        engine.reset_prefix_cache()
        times = []
        for out in engine.stream(spec["w1_prompt"], params):
            times += [time.perf_counter()] * len(out.delta_token_ids)
        return (new - 1) / (times[-1] - times[0])

    def w2() -> float:
        engine.reset_prefix_cache()
        start = time.perf_counter()
        for p in spec["w2_batch"]:
            engine.add_request(p, params)
        total = 0
        while engine.has_unfinished_requests():
            total += sum(len(o.delta_token_ids) for o in engine.step())
        return total / (time.perf_counter() - start)

    w1()
    r1 = [w1() for _ in range(spec["runs"])]
    r2 = [w2() for _ in range(spec["w2_runs"])] if spec["w2_batch"] else []
    held = held_weight_bytes(engine.runner.model)
    rope = sum(b.numel() * b.element_size() for n, b in engine.runner.model.named_buffers()
               if "rotary" in n)
    n_params = count_params(engine.spec).total
    return {"startup_s": startup, "W1": statistics.median(r1), "W1_runs": r1,
            "W2": statistics.median(r2) if r2 else None, "W2_runs": r2,
            "weight_bytes": held - rope, "params": n_params,
            "bits_per_weight": 8 * (held - rope) / n_params, "peak_rss_mib": peak_rss_mib(),
            "kv_format": engine.runner.kv_format, "kv_blocks": engine.pool.num_blocks,
            "kv_block_bytes": engine.pool.block_bytes}


# -- preparing the quantized folders -----------------------------------------------------------
def quantized_folders(gguf: str, methods: list[str], out_root: Path, calib: Path,
                      model_tag: str = "smollm2") -> dict[str, str]:
    """``fitserve quantize`` each method at int4 g128 once (cached by folder name)."""
    folders: dict[str, str] = {}
    fitserve = str(Path(sys.executable).with_name("fitserve"))
    for m in methods:
        out = out_root / f"{model_tag}-{m}-int4-g128"
        if not (out / "config.json").is_file():
            print(f"fitserve quantize --method {m} -> {out} ...", file=sys.stderr)
            cmd = [fitserve, "quantize", gguf, "--method", m, "--bits", "4", "--group-size", "128",
                   "-o", str(out), "--force"]
            if m != "rtn":
                cmd += ["--calib", str(calib)]
            subprocess.run(cmd, check=True)
        folders[m] = str(out)
    return folders


# -- quality (fitserve eval's metrics) ---------------------------------------------------------
def quality(reference: dict[str, Any], candidates: dict[str, dict[str, Any]], tokens: int
            ) -> dict[str, dict[str, Any]]:
    """name -> `fitserve eval --json`'s candidate entry (KL, flip rate, perplexity, greedy
    agreement, each {"mean", "lo", "hi"}) on the shipped held-out text."""
    from fitserve.tools.eval.cli import build_report
    from fitserve.tools.eval.eval import DEFAULT_BOOTSTRAP, DEFAULT_HORIZON
    from fitserve.tools.eval.eval_run import ModelChoice, run_eval

    ref = ModelChoice(**reference, label="reference")
    cands = [ModelChoice(**c, label=name) for name, c in candidates.items()]
    report = build_report(run_eval(ref, cands, max_tokens=tokens), DEFAULT_BOOTSTRAP,
                          DEFAULT_HORIZON)
    return dict(zip(candidates, report["candidates"], strict=True))


def _ci(m: dict[str, Any], key: str, fmt: str = "{:.4f}") -> str:
    v = m[key]
    return f"{fmt.format(v['mean'])} [{fmt.format(v['lo'])}, {fmt.format(v['hi'])}]"


def print_quality(title: str, q: dict[str, dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'candidate':<22}{'KL nats/token [95% CI]':>32}{'top-1 flip rate':>28}"
          f"{'perplexity (ref)':>30}")
    for name, m in q.items():
        ppl = f"{_ci(m, 'ppl', '{:.2f}')} ({m['ppl_ref']['mean']:.2f})"
        print(f"{name:<22}{_ci(m, 'kl'):>32}{_ci(m, 'flip_rate'):>28}{ppl:>30}")


def sensitivity(gguf: str, args: argparse.Namespace) -> dict[str, Any]:
    """Per-layer sweep (RTN int4-g128 one layer at a time) on the default model in float32."""
    import torch

    from fitserve.tools.eval.eval_run import ModelChoice, encode_text, load_scorer, read_text
    from fitserve.tools.eval.sensitivity import format_sweep, run_sweep, sweep_dict

    sc = load_scorer(ModelChoice(model=gguf, weights="float32", dtype="float32"),
                     torch.device("cpu"), 1024)
    body, _ = read_text(None)
    tokens = encode_text(body, [sc], 256)
    res = run_sweep(sc.model, sc.spec, tokens, granularity="layer", fmt="int4-g128-asym")
    print("\nSensitivity sweep: one layer at a time in int4-g128 RTN, default model (f32), "
          "256 held-out tokens")
    print(format_sweep(res, top=8))
    return sweep_dict(res, top=8)


# -- parts ---------------------------------------------------------------------------------------
def part_weights(args: argparse.Namespace, base: dict[str, Any], gguf: str, me: list[str],
                 out: dict[str, Any]) -> None:
    from fitserve.envs import fitserve_home

    calib = calibration_file()
    folders = quantized_folders(gguf, ["rtn", "awq", "gptq"], fitserve_home() / "bench/quant", calib)
    cases = weight_cases(folders, gguf)
    speed: dict[str, Any] = {}
    for name, engine in cases.items():
        print(f"fitserve {name} ...", file=sys.stderr)
        r = run_worker([*me, "--worker", "fitserve"], {**base, "engine": engine})
        if r:
            speed[name] = r
    print("transformers ...", file=sys.stderr)
    peer = run_worker([*me, "--worker", "transformers"], base)
    out["weights_speed"], out["transformers"] = speed, peer
    ref = {"model": gguf, "weights": "float32", "dtype": "float32"}
    out["weights_quality"] = quality(ref, cases, args.tokens)
    print_weights(speed, peer, out["weights_quality"])


def print_weights(speed: dict[str, Any], peer: dict[str, Any] | None,
                  q: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'weights':<18}{'bits/w':>7}{'weight MB':>10}{'peak RSS MiB':>13}{'W1 tok/s':>10}"
          f"{'W2 tok/s':>10}{'KL':>9}{'flip':>8}{'ppl':>8}")
    for name, r in speed.items():
        m = q.get(name)
        kl = f"{m['kl']['mean']:9.4f}{m['flip_rate']['mean']:8.3f}{m['ppl']['mean']:8.2f}" \
            if m else ""
        w2 = f"{r['W2']:10.1f}" if r["W2"] else f"{'-':>10}"
        print(f"{name:<18}{r['bits_per_weight']:7.2f}{r['weight_bytes'] / 1e6:10.1f}"
              f"{r['peak_rss_mib']:13.0f}{r['W1']:10.1f}{w2}{kl}")
    if peer:
        print(f"{'transformers bf16':<18}{'':7}{'':10}{peer['peak_rss_mib']:13.0f}"
              f"{peer['W1']['tok_s']:10.1f}{peer['W2']['tok_s']:10.1f}")


def part_kv(args: argparse.Namespace, base: dict[str, Any], gguf: str, me: list[str],
            out: dict[str, Any]) -> None:
    from fitserve.ledger.formats import resolve_engine_kv_format
    from fitserve.ledger.kv import kv_block_bytes, kv_bytes_per_token
    from fitserve.loading import load_model

    spec = load_model(gguf).spec
    rows: dict[str, Any] = {}
    for kv, scales in KV_CASES:
        fmt = resolve_engine_kv_format(kv, scales, "bf16")
        print(f"fitserve kv {fmt} ...", file=sys.stderr)
        engine = {"model": gguf, "dtype": "bfloat16", "kv_cache_dtype": kv,
                  "kv_cache_scales": scales, "kv_cache_memory_bytes": GIB}
        r = run_worker([*me, "--worker", "fitserve"], {**base, "engine": engine, "w2_batch": []})
        ledger_blocks = GIB // kv_block_bytes(spec, 16, fmt)
        rows[fmt] = {"case": (kv, scales), "bytes_per_token": kv_bytes_per_token(spec, fmt),
                     "block_bytes": kv_block_bytes(spec, 16, fmt), "ledger_blocks": ledger_blocks,
                     "engine_blocks": r["kv_blocks"] if r else None,
                     "seqs_at_4k": ledger_blocks // (4096 // 16),
                     "W1": r["W1"] if r else None}
    ref = {"model": gguf, "dtype": "bfloat16"}
    cands = {fmt: {"model": gguf, "dtype": "bfloat16", "kv_cache_dtype": row["case"][0],
                   "kv_cache_scales": row["case"][1]} for fmt, row in rows.items()
             if row["case"][0] != "auto"}
    q = quality(ref, cands, args.tokens)
    out["kv"] = {"rows": rows, "quality": q}
    print("\nKV formats (default model, block 16, budget 1 GiB); quality vs the bf16 cache")
    print(f"{'format':<14}{'B/token':>9}{'blocks (ledger = engine)':>26}{'4k seqs':>9}"
          f"{'W1 tok/s':>10}{'KL [95% CI]':>30}{'flip':>8}{'agree':>8}")
    for fmt, row in rows.items():
        m = q.get(fmt)
        tail = (f"{_ci(m, 'kl'):>30}{m['flip_rate']['mean']:8.3f}"
                f"{m['agreement']['mean']:8.1f}") if m else ""
        eng = row["engine_blocks"]
        same = "=" if eng == row["ledger_blocks"] else f"!= {eng}"
        w1 = f"{row['W1']:10.1f}" if row["W1"] else f"{'-':>10}"
        blocks = f"{row['ledger_blocks']} {same}"
        print(f"{fmt:<14}{row['bytes_per_token']:9d}{blocks:>26}"
              f"{row['seqs_at_4k']:9d}{w1}{tail}")


def random_llama(root: Path) -> str:
    """A random-weight Llama (SmolLM2's tokenizer and vocabulary, hidden 512, 8 layers, GQA 8/4)
    saved once as an HF folder: the second model of the quality table."""
    out = root / "random-llama-512x8"
    if (out / "config.json").is_file():
        return str(out)
    import torch
    import transformers as tf

    from fitserve.loading.pull import pull

    gguf = pull("smollm2-135m", progress=False)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=49152,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # heavier-tailed than init's normal: a few large weights per row
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.distributions.StudentT(4.0).sample(p.shape) * 0.03)
    model.save_pretrained(out)
    tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return str(out)


def part_random(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from fitserve.envs import fitserve_home

    root = fitserve_home() / "bench/quant"
    folder = random_llama(root)
    folders = quantized_folders(folder, ["rtn", "awq", "gptq"], root, calibration_file(),
                                model_tag="random-llama")
    ref = {"model": folder, "weights": "float32", "dtype": "float32"}
    cands = {"bf16": {"model": folder, "weights": "bf16"},
             "int8 RTN": {"model": folder, "weights": "int8", "dtype": "float32"},
             **{f"int4 {m.upper()} g128": {"model": f, "dtype": "float32"}
                for m, f in folders.items()},
             "fp8 e4m3": {"model": folder, "weights": "fp8", "dtype": "float32"}}
    q = quality(ref, cands, min(args.tokens, 1024))
    out["random_quality"] = q
    print_quality("Random-weight Llama 512x8 (float32 reference)", q)


def part_extras(args: argparse.Namespace, gguf: str, out: dict[str, Any]) -> None:
    from fitserve.tools.labs.fp8_attention import format_report, report

    print("\nFP8 attention simulation (64 queries x 2048 keys, d=128, 4 outlier channels in K)")
    print(format_report(report()))
    out["smoothquant"] = smoothquant_demo(gguf)
    out["sensitivity"] = sensitivity(gguf, args)
    out["calibration_shift"] = calibration_shift(gguf)


def smoothquant_demo(gguf: str) -> dict[str, float]:
    """W8A8 (per-token int8 x per-channel int8, exact integer GEMM) relative logits error on
    SmolLM2 as it is, with outlier channels injected (x60..x100 in the first layers' input
    norms, compensated in q/k/v: the float function unchanged), and after smoothing."""
    import copy

    import torch
    import transformers as tf

    from fitserve.loading import load_tokenizer
    from fitserve.tools.quantize.smoothquant import (
        calibrate_amax,
        inject_outliers_,
        smooth_model_,
        to_w8a8_,
    )

    path = Path(gguf)
    model = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    ids = load_tokenizer(gguf).encode((DATA / "austen_persuasion.txt").read_text()[:6000])
    calib, test = torch.tensor([ids[:256]]), torch.tensor([ids[256:512]])

    def logits(m: Any) -> torch.Tensor:
        with torch.no_grad():
            return m(test).logits

    def err(m: Any) -> float:
        want = logits(m)
        sim = copy.deepcopy(m)
        to_w8a8_(sim)
        return float((logits(sim) - want).norm() / want.norm())

    res = {"as is": err(model)}
    inject_outliers_(model, [5, 17, 42], [60.0, 80.0, 100.0])
    res["outliers injected"] = err(model)
    smooth_model_(model, calibrate_amax(model, lambda: model(calib)))
    res["outliers + smoothing"] = err(model)
    print("\nSmoothQuant, W8A8 relative logits error on SmolLM2 (256 held-out tokens)")
    for k, v in res.items():
        print(f"  {k:<22}{v:.4f}")
    return res


def calibration_shift(gguf: str) -> dict[str, Any]:
    """GPTQ / AWQ calibrated on one shipped text and evaluated on both (int4 g128, 512-token
    pieces): which method is fragile when traffic stops looking like the calibration set."""
    import torch

    from fitserve.loading import load_model
    from fitserve.tools.quantize.calibration import calibration_shift as shift
    from fitserve.tools.quantize.calibration import format_shift

    loaded = load_model(gguf, torch.float32)
    texts = {"prose": (DATA / "austen_persuasion.txt").read_text(),
             "scripture": (DATA / "kjv_ecclesiastes.txt").read_text()}
    kl = shift(loaded.spec, loaded.weights, loaded.tokenizer, texts, bits=4, group_size=128,
               max_tokens=512, pieces=2)
    print("\nCalibration shift (int4 g128; KL vs float32 on held-out pieces of each text)")
    print(format_shift(kl))
    return kl


DATA = Path(__file__).resolve().parents[1] / "fitserve/tools/eval/data"


def calibration_file() -> Path:
    """Calibration text: the shipped KJV Ecclesiastes (never the evaluation text, Persuasion:
    a shift of register on purpose, the traffic a calibration set rarely matches)."""
    return DATA / "kjv_ecclesiastes.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="weights,random,kv,extras")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--w2-requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", choices=["fitserve", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        fn = fitserve_worker if args.worker == "fitserve" else transformers_worker
        print(json.dumps(fn(spec)))
        return

    base = {**workload_spec(args.threads, args.runs, args.w2_requests),
            "w2_runs": max(1, args.runs - 1)}
    gguf = base["gguf"]
    me = [sys.executable, str(Path(__file__).resolve())]
    out: dict[str, Any] = {"cpu": cpu_description(), "threads": args.threads}
    print(f"CPU: {out['cpu']}; threads={args.threads}; medians of {args.runs} runs")
    parts = args.parts.split(",")
    if "weights" in parts:
        part_weights(args, base, gguf, me, out)
    if "random" in parts:
        part_random(args, out)
    if "kv" in parts:
        part_kv(args, base, gguf, me, out)
    if "extras" in parts:
        part_extras(args, gguf, out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
