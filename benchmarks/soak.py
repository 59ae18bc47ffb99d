"""Soak a real `fitserve serve` on loopback: rounds of the same mixed load, then the accounting.

    .venv/bin/python benchmarks/soak.py --requests 1000 --rounds 3

Starts its own server on the default model (or uses --url), runs a warm-up round, then
``--rounds`` rounds of the same ``--requests`` mixed requests (see fitserve.tools.bench.soak), and
prints per round: requests sent, statuses, clients that left early, engine requests queued and
finished by reason, answered-twice / lost counts, KV blocks in use at rest, requests left in the
table and the server's RSS. Exit 1 on any 5xx, lost or duplicated answer, leaked block, or an RSS
growth from the first measured round to the last above ``--rss-bound-mib``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
from fitserve.tools.bench.soak import SoakConfig, SoakReport, run_round

API_KEY = "soak-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(extra: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "fitserve.cli", "serve", "--port", str(port), "--api-key", API_KEY,
           "--log-level", "warning", *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="soak this server instead of starting one (RSS then unknown)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=400, help="requests per round")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds (after one warm-up round)")
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(8, 48))
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 3, 4], help="the n values requests draw from")
    ap.add_argument("--p-leave", type=float, default=0.15, help="fraction of clients that disconnect early")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-bound-mib", type=float, default=32.0)
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("serve_args", nargs="*", help="extra `fitserve serve` flags (after --)")
    args = ap.parse_args()

    cfg = SoakConfig(requests=args.requests, concurrency=args.concurrency, max_tokens=tuple(args.max_tokens),
                     n_values=tuple(args.n), p_leave=args.p_leave, seed=args.seed)
    proc = None
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"fitserve-soak-{os.getpid()}.log"
    if args.url:
        url, key, pid = args.url.rstrip("/"), args.api_key, None
    else:
        proc, url = start(args.serve_args, log)
        key, pid = API_KEY, proc.pid
    import asyncio

    print(f"soak: {cfg.requests} requests/round x {args.rounds} rounds (+1 warm-up), concurrency "
          f"{cfg.concurrency}, max_tokens {cfg.max_tokens[0]}-{cfg.max_tokens[1]}, n in {cfg.n_values}, "
          f"{cfg.p_leave:.0%} leave early; CPU {cpu_model_name()}, ISA {detect_isa().describe()}")
    report = SoakReport()
    try:
        for i in range(args.rounds + 1):
            r = asyncio.run(run_round(url, key, args.model, cfg, i, pid))
            tag = "warm-up" if i == 0 else f"round {i}"
            print(f"{tag}: {json.dumps(r.to_dict())}", flush=True)
            for p in r.problems():
                print(f"  PROBLEM: {p}")
            if i:
                report.rounds.append(r)
            elif r.problems():
                report.rounds.append(r)  # a broken warm-up fails the soak too
    finally:
        code = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(120)
            print(f"server exit status after SIGTERM: {code}")
    growth = report.rss_growth_mib
    if growth is not None:
        print(f"RSS after round 1: {report.rounds[0].rest.rss_mib:.1f} MiB, after round {len(report.rounds)}: "
              f"{report.rounds[-1].rest.rss_mib:.1f} MiB (KV pool resident {report.rounds[0].rest.kv_resident_mib:.1f} -> "
              f"{report.rounds[-1].rest.kv_resident_mib:.1f} MiB), growth beyond the KV pool {growth:+.1f} MiB "
              f"(bound {args.rss_bound_mib} MiB)")
    if args.json:
        args.json.write_text(json.dumps({"rounds": [r.to_dict() for r in report.rounds],
                                         "rss_growth_mib": growth}, indent=2))
    ok = report.ok(args.rss_bound_mib) and code in (None, 0)
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
