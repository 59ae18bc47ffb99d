"""llama.cpp (llama-cpp-python) side of bench_prefill.py and bench_long_context.py, run in the
peer's own venv.

    ~/peers/llamacpp/bin/python benchmarks/peers/llamacpp_context.py SPEC.json

SPEC: the GGUF path, threads, runs, and either ``ttft_prompt`` (token ids: the time from the
prompt to its first greedy token, the prompt in one llama_decode call) or ``contexts`` with
``context_ids`` and ``new_tokens`` (for each context N, ascending: extend the cached prompt to
N - new_tokens ids untimed, then time new_tokens single-token decode steps, each step's
seconds reported). Prints one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import llama_cpp as L
from llamacpp_worker import Ctx  # the same folder: sys.path[0] is this script's


def make_ctx(model: object, n_ctx: int, threads: int) -> Ctx:
    """A single-sequence context of n_ctx positions whose batch holds a whole prompt."""
    ctx = Ctx.__new__(Ctx)  # Ctx's own constructor fixes n_batch at 4096
    p = L.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, n_ctx, 512
    p.n_seq_max, p.kv_unified = 1, False
    p.n_threads = p.n_threads_batch = threads
    p.no_perf = True
    ctx.ctx = L.llama_init_from_model(model, p)
    assert ctx.ctx, "llama_init_from_model failed"
    ctx.vocab = L.llama_n_vocab(L.llama_model_get_vocab(model))
    ctx.batch = L.llama_batch_init(n_ctx, 0, 1)
    return ctx


def ttft_ms(ctx: Ctx, prompt: list[int]) -> float:
    ctx.clear()
    t0 = time.perf_counter()
    ctx.decode([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    return (time.perf_counter() - t0) * 1e3


def decode_steps(ctx: Ctx, ids: list[int], done: int, n: int, new: int) -> list[float]:
    """Extend the cached prompt ids[:done] to ids[:n - new] (untimed), then time ``new``
    single-token decode steps and drop them from the KV again; seconds per step."""
    mem = L.llama_get_memory(ctx.ctx)
    prompt = ids[: n - new]
    tok = ctx.decode([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)
                      if i >= done])[0]
    pos, steps = len(prompt), []
    for _ in range(new):
        t0 = time.perf_counter()
        tok = ctx.decode([(tok, pos, 0, True)])[0]
        steps.append(time.perf_counter() - t0)
        pos += 1
    L.llama_memory_seq_rm(mem, 0, len(prompt), -1)
    return steps


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(spec["gguf"].encode(), L.llama_model_default_params())
    assert model, "cannot load the GGUF"
    threads, runs = spec["threads"], spec["runs"]
    out: dict[str, object] = {"engine": "llama.cpp", "version": L.__version__}
    if "ttft_prompt" in spec:
        prompt = spec["ttft_prompt"]
        ctx = make_ctx(model, len(prompt) + 16, threads)
        ttft_ms(ctx, prompt)  # warm-up
        res = [ttft_ms(ctx, prompt) for _ in range(runs)]
        out["ttft_ms"] = statistics.median(res)
        out["ttft_runs"] = res
        L.llama_free(ctx.ctx)
    if "contexts" in spec:
        new, ids = spec["new_tokens"], spec["context_ids"]
        contexts = sorted(spec["contexts"])
        ctx = make_ctx(model, contexts[-1] + 16, threads)
        decode_steps(ctx, ids, 0, 64 + new, 8)  # warm-up
        ctx.clear()
        done, steps = 0, {}
        for n in contexts:  # each context extends the last one's prompt (no second prefill)
            steps[str(n)] = decode_steps(ctx, ids, done, n, new)
            done = n - new
        L.llama_free(ctx.ctx)
        out["decode_step_s"] = steps
    print(json.dumps(out))


if __name__ == "__main__":
    main()
