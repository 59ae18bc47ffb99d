"""Tensor parallelism on this machine: TP=1 vs TP=2 on the default model, with the share of
time spent in collectives, next to the ledger's predicted scaling for a 70B model on 8 GPUs.

    .venv/bin/python benchmarks/bench_tp.py [--runs 3] [--tokens 64] [--dtype float32]

On a 2-core machine TP=2 runs 2 processes on the 2 cores that TP=1 already uses, so expect no
speedup: what it shows is what the all-reduces cost (gloo over loopback). SmolLM2's 9 query
heads do not split over 2 ranks, so the default model runs TP=1 vs TP=3; TP=2 runs on a
random-weight Llama of the same class (12 heads, 4 KV heads, 12 layers, hidden 768; built with
transformers, a test dependency) next to it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.speed import decode_step
from fitserve.ledger.weights import model_weight_bytes
from fitserve.sampling import SamplingParams
from fitserve.tools.planner.model_source import catalog_entry

PROMPT = "Write a short story about a robot who learns to paint. " * 3


def random_llama(folder: Path) -> Path:
    """A random-weight Llama whose heads split over 2 ranks, with SmolLM2's tokenizer."""
    import torch
    import transformers as tf

    from fitserve.loading.pull import pull

    gguf = pull("smollm2-135m", progress=False)
    tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    config = tf.LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                            num_attention_heads=12, num_key_value_heads=4, vocab_size=49152,
                            max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def measure(model: str, tp: int, dtype: str, tokens: int, batch: int
            ) -> tuple[float, float, float]:
    """(output tok/s, TTFT s, share of rank 0's wall time inside collectives) of one run."""
    engine = Engine(EngineConfig(model=model, dtype=dtype, tensor_parallel_size=tp,
                                 num_kv_blocks=256, max_model_len=1024))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        engine.add_request(PROMPT, SamplingParams(max_tokens=2))  # warm-up
        while engine.has_unfinished_requests():
            engine.step()
        comm0 = engine.tp_group.comm.seconds if engine.tp_group else 0.0
        t0 = time.perf_counter()
        for _ in range(batch):
            engine.add_request(PROMPT, params)
        ttft = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if ttft is None and outs:
                ttft = time.perf_counter() - t0
        wall = time.perf_counter() - t0
        comm = (engine.tp_group.comm.seconds - comm0) if engine.tp_group else 0.0
        return batch * tokens / wall, ttft or 0.0, comm / wall
    finally:
        engine.shutdown()


def ledger_70b(gpu: str = "h100") -> list[str]:
    spec = catalog_entry("Llama-3.3-70B").spec
    hw = get_hardware(gpu)
    rows = [f"ledger: Llama-3.3-70B bf16 decode on {gpu}, batch 32 at 4096 tokens"]
    base = None
    for tp in (1, 2, 4, 8):
        wb = model_weight_bytes(spec, "bf16", tp=tp)
        st = decode_step(spec, hw, wb, batch=32, context=4096, kv_dtype="bf16",
                         weights_fmt="bf16")
        base = base or st.seconds
        rows.append(f"  TP{tp}: step {st.seconds * 1e3:7.2f} ms, all-reduce "
                    f"{st.t_comm * 1e3:5.2f} ms ({st.t_comm / st.seconds:5.1%}), speed-up "
                    f"x{base / st.seconds:4.2f} (ideal x{tp}), weights/GPU "
                    f"{wb.total / 1e9:6.1f} GB" + ("  (does not fit one GPU)" if wb.total > hw.memory_bytes else ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    print(f"CPU: {cpu_model_name()} ({detect_isa().describe()}), {time.strftime('%Y-%m-%d')}, "
          f"{args.dtype}, {args.tokens} new tokens per request")
    with tempfile.TemporaryDirectory() as tmp:
        models = [("smollm2-135m", "SmolLM2-135M Q4_1 as stored", (1, 3)),
                  (str(random_llama(Path(tmp))), "random Llama 12 heads/4 KV", (1, 2))]
        for model, label, tps_ in models:
            for batch in (1, 8):
                base = None
                for tp in tps_:
                    runs = [measure(model, tp, args.dtype, args.tokens, batch)
                            for _ in range(args.runs)]
                    rate = statistics.median(r[0] for r in runs)
                    ttft = statistics.median(r[1] for r in runs)
                    share = statistics.median(r[2] for r in runs)
                    base = base or rate
                    print(f"{label}, batch {batch}, TP{tp}: {rate:7.1f} tok/s (x{rate / base:4.2f}"
                          f" of TP1), TTFT {ttft * 1e3:6.1f} ms, time in collectives "
                          f"{share:5.1%}  [median of {args.runs}]", flush=True)
    print("\n".join(ledger_70b()))


if __name__ == "__main__":
    main()
