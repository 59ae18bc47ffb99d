"""Two replicas on Ray Serve (``fitserve serve --replicas 2``): prefix affinity vs round robin on
a workload of 4 shared system prompts.

    .venv/bin/python benchmarks/bench_replicas.py                      # 2 x 1-CPU replicas, 3 rounds
    .venv/bin/python benchmarks/bench_replicas.py --requests 64 --concurrency 4 --rounds 3

One fleet serves every run; each run picks its routing per request (header X-Fitserve-Routing)
and gets 4 system prompts of its own (nothing cached from an earlier run helps it). The runs
alternate round robin / affinity, round after round, so a busy period of the shared host falls
on both. Each request: system prompt (~--system-tokens) + a short question, streamed, --new-tokens
out. Printed per routing: requests/s, output tok/s, TTFT p50/p99 (first streamed token), and the
fleet prefix-cache hit rate in tokens from the replicas' own /metrics (sum over replicas of
fitserve_prefix_cache_hits / _queries); medians over rounds and the affinity / round-robin ratio.
The peer here is Serve-style round robin on the same fleet (no other engine runs replicas).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

MODEL = "smollm2-135m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_fleet(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "fitserve.cli", "serve", MODEL, "--replicas", str(args.replicas),
           "--replica-cpus", str(args.replica_cpus), "--port", str(port), "--log-level", "warning",
           "--max-model-len", "2048", "--routing-balance", str(args.routing_balance)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while "ready at" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the fleet did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    q, h = (sum(float(v) for v in re.findall(rf'^fitserve_prefix_cache_{k}_total{{replica="[^"]+"}} (\S+)$',
                                             text, re.M)) for k in ("queries", "hits"))
    return q, h


def system_prompt(tag: str, tokens: int) -> str:
    """A system prompt of about ``tokens`` SmolLM2 tokens (~4 characters each), unique to ``tag``."""
    text = f"[{tag}] You are a careful assistant."
    j = 0
    while len(text) < 4 * tokens:
        text += f" Rule {j}: answer questions about topic {j} exactly and briefly."
        j += 1
    return text


def one_run(url: str, routing: str, tag: str, args: argparse.Namespace) -> dict[str, float]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600,
                           default_headers={"X-Fitserve-Routing": routing})
    systems = [system_prompt(f"{tag}-{i}", args.system_tokens) for i in range(4)]
    jobs = [(systems[k % 4], f"Question {k}: what is {k} plus {k + 1}?") for k in range(args.requests)]
    random.Random(tag).shuffle(jobs)
    q0, h0 = prefix_counters(url)

    def request(job: tuple[str, str]) -> tuple[float, int]:
        t0 = time.perf_counter()
        ttft, n = float("nan"), 0
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": job[0]}, {"role": "user", "content": job[1]}],
            max_tokens=args.new_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if n == 0:
                    ttft = time.perf_counter() - t0
                n += 1
        return ttft, n

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(request, jobs))
    wall = time.perf_counter() - t0
    time.sleep(0.6)  # the engines publish counters at most every 0.25 s
    q1, h1 = prefix_counters(url)
    ttfts = sorted(r[0] for r in results)
    # NOTE: ignore_eos: every request makes exactly --new-tokens tokens (streamed chunks may
    # carry several, or none for a partial UTF-8 character)
    return {"rps": len(jobs) / wall, "tok_s": len(jobs) * args.new_tokens / wall,
            "ttft_p50": statistics.median(ttfts), "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--routing-balance", type=float, default=4.0,
                   help="affinity's load bound (fitserve serve --routing-balance)")
    args = p.parse_args()
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    log = Path(tempfile.mkdtemp(prefix="bench-replicas-")) / "fleet.log"
    proc, url = start_fleet(args, log)
    rows: dict[str, list[dict[str, float]]] = {"round-robin": [], "affinity": []}
    try:
        for r in range(args.rounds):
            for routing in ("round-robin", "affinity"):
                res = one_run(url, routing, f"{routing}{r}", args)
                rows[routing].append(res)
                print(f"round {r} {routing:12s} " + "  ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    med: dict[str, dict[str, Any]] = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in rows.items()}
    print(f"\n{args.replicas} replicas x {args.replica_cpus:g} CPU, {args.requests} requests x 4 shared system prompts "
          f"(~{args.system_tokens} tokens), {args.new_tokens} new tokens, concurrency {args.concurrency}, "
          f"--routing-balance {args.routing_balance:g}; "
          f"medians of {args.rounds} rounds; load average after {os.getloadavg()}")
    print(f"{'routing':12s} {'req/s':>8s} {'tok/s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'hit rate':>9s}")
    for k, m in med.items():
        print(f"{k:12s} {m['rps']:8.3f} {m['tok_s']:8.2f} {m['ttft_p50']:9.3f} {m['ttft_p99']:9.3f} {m['hit_rate']:9.3f}")
    a, b = med["affinity"], med["round-robin"]
    print(f"affinity / round robin: throughput x{a['rps'] / b['rps']:.2f}, TTFT p50 x{a['ttft_p50'] / b['ttft_p50']:.2f}, "
          f"p99 x{a['ttft_p99'] / b['ttft_p99']:.2f}, hit rate {a['hit_rate']:.3f} vs {b['hit_rate']:.3f}")


if __name__ == "__main__":
    main()
