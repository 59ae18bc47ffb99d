"""llama.cpp (llama-cpp-python) side of bench_engine.py, run in the peer's own venv.

    ~/peers/llamacpp/bin/python benchmarks/peers/llamacpp_worker.py SPEC.json

SPEC holds the GGUF path, the prompts as token ids (the same ids fitserve runs), new tokens,
threads and runs. Prints one JSON object: per workload the runs' TTFT / tok/s and peak RSS.
Greedy (argmax of the logits), EOS ignored, every sequence with its own KV (kv_unified=False).
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time

import llama_cpp as L
import numpy as np


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Ctx:
    def __init__(self, model: object, n_seq: int, n_ctx: int, threads: int) -> None:
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, 4096, 512
        p.n_seq_max, p.kv_unified = n_seq, False
        p.n_threads = p.n_threads_batch = threads
        p.no_perf = True
        self.ctx = L.llama_init_from_model(model, p)
        assert self.ctx, "llama_init_from_model failed"
        self.vocab = L.llama_n_vocab(L.llama_model_get_vocab(model))
        self.batch = L.llama_batch_init(4096, 0, n_seq)

    def clear(self) -> None:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, pos, seq, want_logits) -> argmax token for each wanted row."""
        b = self.batch
        b.n_tokens = len(items)
        rows = []
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
            if want:
                rows.append(i)
        assert L.llama_decode(self.ctx, b) == 0, "llama_decode failed"
        out = []
        for i in rows:
            ptr = L.llama_get_logits_ith(self.ctx, i)
            logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                           shape=(self.vocab,))
            out.append(int(logits.argmax()))
        return out


def run_w1(ctx: Ctx, prompt: list[int], new: int) -> tuple[float, float]:
    ctx.clear()
    t0 = time.perf_counter()
    # prompt in one batch (n_batch 4096), logits of the last token only
    tok = ctx.decode([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])[0]
    t1 = time.perf_counter()
    pos = len(prompt)
    for _ in range(new - 1):
        tok = ctx.decode([(tok, pos, 0, True)])[0]
        pos += 1
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (new - 1) / (t2 - t1)


def run_w2(ctx: Ctx, batch: list[list[int]], new: int) -> float:
    ctx.clear()
    t0 = time.perf_counter()
    items = [(t, i, s, i == len(p) - 1) for s, p in enumerate(batch) for i, t in enumerate(p)]
    toks: list[int] = []
    for start in range(0, len(items), 4096):
        toks += ctx.decode(items[start : start + 4096])
    pos = [len(p) for p in batch]
    for _ in range(new - 1):
        toks = ctx.decode([(toks[s], pos[s], s, True) for s in range(len(batch))])
        pos = [x + 1 for x in pos]
    return len(batch) * new / (time.perf_counter() - t0)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(spec["gguf"].encode(), mp)
    assert model, "cannot load the GGUF"
    threads, runs, new = spec["threads"], spec["runs"], spec["new_tokens"]
    out: dict[str, object] = {"engine": "llama.cpp", "version": L.__version__}
    if "w1_prompt" in spec:
        ctx = Ctx(model, 1, 1024, threads)
        run_w1(ctx, spec["w1_prompt"], new)  # warm-up
        res = [run_w1(ctx, spec["w1_prompt"], new) for _ in range(runs)]
        out["W1"] = {"ttft_ms": statistics.median(r[0] for r in res),
                     "tok_s": statistics.median(r[1] for r in res), "runs": [r[1] for r in res]}
        L.llama_free(ctx.ctx)
    if "w2_batch" in spec:
        n = len(spec["w2_batch"])
        ctx = Ctx(model, n, n * (len(spec["w2_batch"][0]) + new + 16), threads)
        run_w2(ctx, spec["w2_batch"], new)
        res2 = [run_w2(ctx, spec["w2_batch"], new) for _ in range(runs)]
        out["W2"] = {"tok_s": statistics.median(res2), "runs": res2}
    out["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
