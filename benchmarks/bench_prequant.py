"""Pre-quantized HF checkpoints held as stored: W1 decode of each format against the same model
with fitserve's own RTN int4 (``--weights int4``) and dense bf16.

    .venv/bin/python benchmarks/bench_prequant.py                 # hidden 1536, 8 layers
    .venv/bin/python benchmarks/bench_prequant.py --layers 16 --runs 5

One random Llama (bf16 weights, SmolLM2's tokenizer) is written as a plain folder and as
compressed-tensors W4A16 g128 / W8A16 per channel (by compressed-tensors), GPTQ int4 g128 (plain
and act-order) and AWQ g128 (from the spec: tests/prequant_writers.py), under FITSERVE_HOME/bench
(never committed). Each config runs in this process one after the other (same prompt, greedy,
EOS ignored, one warm-up, median of --runs); the table prints held weight bytes, the kernel the
table chose for the decode GEMV (the fast path taken) and W1 decode tok/s, with the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def build(root: Path, tok: Path, layers: int) -> dict[str, tuple[Path, str]]:
    """Every checkpoint (cached), name -> (folder, --weights)."""
    import shutil

    import torch
    import transformers as tf

    from tests import prequant_writers as pw

    # NOTE: a small vocabulary: the tied embedding stays bf16 in every checkpoint, the
    # projections are what the formats differ in
    cfg = tf.LlamaConfig(hidden_size=1536, intermediate_size=4096, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=4, vocab_size=8192,
                         max_position_embeddings=2048, tie_word_embeddings=True)

    def model(dtype: torch.dtype) -> Any:
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()

    def dense(f: Path) -> None:
        model(torch.bfloat16).save_pretrained(f)
        for x in tok.iterdir():
            shutil.copy(x, f / x.name)

    makers = {
        "dense": dense,
        "ct-w4a16-g128-asym": lambda f: pw.write_compressed_tensors(
            f, tok, bits=4, strategy="group", group=128, symmetric=False,
            model=model(torch.bfloat16)),
        "ct-w8a16-channel": lambda f: pw.write_compressed_tensors(
            f, tok, bits=8, strategy="channel", group=None, symmetric=True,
            model=model(torch.bfloat16)),
        "gptq-4bit-g128": lambda f: pw.write_gptq(f, tok, bits=4, group=128, sym=True,
                                                  act_order=False, model=model(torch.float32)),
        "gptq-4bit-g128-actorder": lambda f: pw.write_gptq(
            f, tok, bits=4, group=128, sym=True, act_order=True, model=model(torch.float32)),
        "awq-g128": lambda f: pw.write_awq(f, tok, group=128, coarse=False,
                                           model=model(torch.float32)),
    }
    out = {}
    for name, make in makers.items():
        folder = root / f"{name}-L{layers}"
        if not (folder / "tokenizer.json").is_file():  # written last
            shutil.rmtree(folder, ignore_errors=True)
            make(folder)
        out[name] = (folder, "as-stored")
    out["fitserve-rtn-int4"] = (out["dense"][0], "int4")
    out["dense"] = (out["dense"][0], "bf16")
    return out


def run(folder: Path, weights: str, runs: int, new: int) -> dict[str, Any]:
    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.model.linear import PackedLinear
    from fitserve.model.loader import held_weight_bytes
    from fitserve.sampling import SamplingParams

    engine = Engine(EngineConfig(model=str(folder), dtype="bfloat16", weights=weights,
                                 device="cpu", max_model_len=1024))
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    prompt = list(range(100, 132))

    def w1() -> float:
        engine.reset_prefix_cache()
        times = []
        for out in engine.stream(prompt, params):
            times += [time.perf_counter()] * len(out.delta_token_ids)
        return (new - 1) / (times[-1] - times[0])

    w1()
    rates = [w1() for _ in range(runs)]
    model = engine.runner.model
    kernels = {m.kernel(1, torch.bfloat16).name for m in model.modules()
               if isinstance(m, PackedLinear)}
    return {"tok_s": statistics.median(rates), "bytes": held_weight_bytes(model),
            "kernels": ",".join(sorted(kernels)) or "dense"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    import torch

    sys.path.insert(0, str(HERE))
    import bench_engine as be

    from fitserve.envs import fitserve_home
    from fitserve.loading.pull import pull

    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = pull("smollm2-135m", progress=False)
    tok = fitserve_home() / "bench" / "smollm2-tokenizer"
    if not (tok / "tokenizer.json").is_file():
        import transformers as tf

        tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tok)
    configs = build(fitserve_home() / "bench" / "prequant", tok, args.layers)
    print(f"CPU: {be.cpu_description()}; torch threads {torch.get_num_threads()}; hidden 1536, "
          f"{args.layers} layers, bf16 activations, W1 = 32-token prompt + {args.new_tokens}")
    print(f"{'config':26} {'weights MiB':>11} {'decode kernel':>14} {'W1 tok/s':>9}")
    for name, (folder, weights) in configs.items():
        r = run(folder, weights, args.runs, args.new_tokens)
        print(f"{name:26} {r['bytes'] / 2**20:11.1f} {r['kernels']:>14} {r['tok_s']:9.1f}")


if __name__ == "__main__":
    main()
