"""Speculative decoding vs plain decoding, side by side, by batch size, with the ledger's crossover.

    .venv/bin/python benchmarks/bench_spec_decode.py [--batches 1,4,16,32] [--new 128] [--runs 3]

The default model (Q4_1 as stored), greedy, EOS ignored. Two workloads: "repetitive" (a code
edit: a snippet to rewrite with one change, so the answer repeats it and n-gram lookup hits)
and "free text" (open questions). Each
configuration runs in its own process: plain decoding, n-gram (prompt lookup, k = --k), the
target as its own draft model (an upper bound on acceptance at a draft that costs a full target
step), and the EAGLE-like head (fitserve.model.eagle_head) trained here first on SmolLM2's own
greedy outputs for other prompts of both kinds (cached in $FITSERVE_HOME/bench). Printed per workload and batch: output tok/s (median of --runs after a warm-up), the
speedup over plain, the acceptance rate and tokens per verification. Then the ledger's
prediction (``fitserve plan smollm2-135m --gpu cpu --speculative k,alpha,draft_cost`` at the
workload's context, alpha measured here) next to the measured crossover batch.
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

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
'''
# a code edit: the answer repeats the snippet with one change, where prompt lookup hits
REPETITIVE = [f"# snippet {i}\n```python\n{CODE}```\n\nThe same code with the function renamed to `merge`:"
              f"\n\n```python\n" for i in range(32)]
FREE = [f"Question {i}: what would you tell a friend who is starting to learn to cook? Answer:" for i in range(32)]


# The EAGLE-like head is trained here, on SmolLM2's own greedy outputs for prompts of the same
# two kinds but not the benchmark's (other snippets, other questions), then cached.
TRAIN_PROMPTS = (
    [f"```python\n{body}```\n\nThe same code with the function renamed to `{name}`:\n\n```python\n"
     for body, name in (
         ("def area(w, h):\n    return w * h\n", "surface"),
         ("def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n"
          "    return x\n", "bound"),
         ("def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
          "average"),
         ("def is_even(n):\n    return n % 2 == 0\n", "even"),
         ("def flatten(rows):\n    out = []\n    for row in rows:\n        out.extend(row)\n    return out\n",
          "concat"),
         ("def count_words(text):\n    counts = {}\n    for w in text.split():\n        counts[w] = "
          "counts.get(w, 0) + 1\n    return counts\n", "histogram"))]
    + [f"Question: {q} Answer:" for q in (
        "how do plants make food?", "why do we need sleep?", "what is a good way to save money?",
        "how does a bicycle stay upright?", "what should I pack for a hike?", "why is the sea salty?")]
)


def train_eagle_head(path: Path, threads: int) -> None:
    """Train fitserve's EAGLE-like head for SmolLM2 (~2 min on 2 cores) and save it to ``path``."""
    import torch
    import transformers

    from fitserve.loading.pull import pull
    from fitserve.model.eagle_head import EagleHead

    torch.set_num_threads(threads)
    gguf = pull("smollm2-135m", progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           dtype=torch.float32).eval()
    xs, hs, ys = [], [], []
    with torch.no_grad():
        for text in TRAIN_PROMPTS:
            ids = torch.tensor([tok.encode(text)])
            seq = hf.generate(ids, max_new_tokens=160, do_sample=False, pad_token_id=0, eos_token_id=None)[0]
            h = hf(seq[None], output_hidden_states=True).hidden_states[-1][0]
            start = ids.shape[1] - 1
            xs.append(seq[start + 1:-1])
            hs.append(h[start:-2])
            ys.append(h[start + 1:-1])
    x, hid, nxt = torch.cat(xs), torch.cat(hs), torch.cat(ys)
    emb, lm = hf.get_input_embeddings().weight.detach(), hf.lm_head.weight.detach()
    target = torch.cat([(nxt[i:i + 256] @ lm.T).argmax(-1) for i in range(0, len(nxt), 256)])
    torch.manual_seed(0)
    head = EagleHead(hf.config.hidden_size)
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)
    for _ in range(400):
        idx = torch.randint(0, len(x), (256,))
        pred = head(emb[x[idx]], hid[idx])
        loss = torch.nn.functional.cross_entropy(pred @ lm.T, target[idx]) + ((pred - nxt[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    head.save(path)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.loading.pull import pull
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    sc = None
    if spec["method"] == "ngram":
        sc = {"method": "ngram", "num_speculative_tokens": spec["k"]}
    elif spec["method"] == "draft_model":
        sc = {"method": "draft_model", "model": str(pull("smollm2-135m", progress=False)),
              "num_speculative_tokens": spec["k"]}
    elif spec["method"] == "eagle":
        sc = {"method": "eagle", "model": spec["head"], "num_speculative_tokens": spec["k"]}
    engine = Engine(EngineConfig(device="cpu", max_model_len=1024, max_num_seqs=64, speculative_config=sc))
    params = SamplingParams(temperature=0.0, max_tokens=spec["new"], ignore_eos=True)
    out: dict[str, Any] = {}
    for name, prompts in (("repetitive", REPETITIVE), ("free text", FREE)):
        for batch in spec["batches"]:
            runs = []
            for r in range(spec["runs"] + 1):  # the first is a warm-up
                engine.reset_prefix_cache()
                before = engine.stats().spec_decode
                for p in prompts[:batch]:
                    engine.add_request(p, params)
                tokens, t0 = 0, time.perf_counter()
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        tokens += len(o.delta_token_ids)
                wall = time.perf_counter() - t0
                after = engine.stats().spec_decode
                acc = tl = 0.0
                if before is not None and after is not None:
                    drafts = after.num_drafts - before.num_drafts
                    dt = after.num_draft_tokens - before.num_draft_tokens
                    at = after.num_accepted_tokens - before.num_accepted_tokens
                    acc, tl = (at / dt if dt else 0.0), (1 + at / drafts if drafts else 1.0)
                if r:
                    runs.append({"tok_s": tokens / wall, "acceptance": acc, "tokens_per_verify": tl})
            out[f"{name}|{batch}"] = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    prompt_len = len(engine.tokenizer.encode(REPETITIVE[0])), len(engine.tokenizer.encode(FREE[0]))
    out["prompt_len"] = prompt_len
    return out


def planned(k: int, alpha: float, draft_cost: float, context: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "fitserve.cli", "plan", "smollm2-135m", "--gpu", "cpu", "--context",
           str(context), "--speculative", f"{k},{alpha:.3f},{draft_cost}", "--json"]
    plan = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    section = next(s for s in plan["sections"] if s["title"].startswith("Speculative decoding"))
    return {line["name"]: line["value"] for line in section["lines"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="plain,ngram,draft_model,eagle")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fitserve.envs import fitserve_home
    from fitserve.kernels.cpu.isa import cpu_model_name

    batches = [int(b) for b in args.batches.split(",")]
    methods = args.methods.split(",")
    head = fitserve_home() / "bench" / "eagle-head-smollm2.safetensors"
    if "eagle" in methods and not head.exists():
        print(f"training the EAGLE-like head for SmolLM2 into {head} ...", file=sys.stderr)
        train_eagle_head(head, args.threads)
    results: dict[str, dict[str, Any]] = {}
    for method in methods:
        spec = {"method": method, "k": args.k, "new": args.new, "runs": args.runs, "threads": args.threads,
                "batches": batches, "head": str(head)}
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{method} failed:\n{proc.stderr[-3000:]}")
        results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"CPU: {cpu_model_name()}, {args.threads} threads; SmolLM2-135M Q4_1 as stored; greedy, "
          f"{args.new} new tokens per request, k = {args.k}; medians of {args.runs}\n")
    plain = results["plain"]
    for w, workload in enumerate(("repetitive", "free text")):
        print(f"## {workload} (prompt {plain['prompt_len'][w]} tokens)\n")
        print("| batch | plain tok/s | method | tok/s | speedup | acceptance | tokens / verification |")
        print("|---|---|---|---|---|---|---|")
        for b in batches:
            base = plain[f"{workload}|{b}"]["tok_s"]
            for method, res in results.items():
                r = res.get(f"{workload}|{b}")
                if method == "plain" or r is None:
                    continue
                print(f"| {b} | {base:.1f} | {method} | {r['tok_s']:.1f} | x{r['tok_s'] / base:.2f} | "
                      f"{r['acceptance']:.2f} | {r['tokens_per_verify']:.2f} |")
        if "ngram" in results:
            ng = results["ngram"]
            alpha = statistics.median(ng[f"{workload}|{b}"]["acceptance"] for b in batches)
            context = plain["prompt_len"][w] + args.new
            pred = planned(args.k, min(alpha, 0.999), 0.0, context)
            losing = [b for b in batches if ng[f"{workload}|{b}"]["tok_s"] < plain[f"{workload}|{b}"]["tok_s"]]
            speedups = ", ".join(f"batch {b} x{pred[f'speedup, batch {b}']:.2f}" for b in batches
                                 if f"speedup, batch {b}" in pred)
            print(f"\nledger (n-gram, alpha {alpha:.2f} measured, draft cost 0, context {context}): {speedups}; "
                  f"stops paying from batch {pred['stops paying from batch']}; measured: "
                  f"{'from batch ' + str(losing[0]) if losing else 'pays at every batch measured'}\n")


if __name__ == "__main__":
    main()
