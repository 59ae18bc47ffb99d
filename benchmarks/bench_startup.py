"""Start-up of ``fitserve serve`` on the default model: seconds to /health ok from a cold
FITSERVE_HOME (no kernel builds: everything compiles) and a warm one (the cache holds them), and
the first vs later request latency after each start.

    python benchmarks/bench_startup.py [--cold] [--warm-runs 3] [--repo DIR ...] [-- extra serve flags]

The model file is linked from the current FITSERVE_HOME (no download is timed). Prints one row
per start: to-ready seconds (wall, and the server's own CPU seconds: less sensitive to a loaded
machine), the extensions compiled, and three identical requests' latencies (16 tokens, greedy).
``--repo DIR`` (repeatable) serves other fitserve checkouts too (e.g. an older commit exported
with ``git archive``), their starts interleaved round by round with this one's, and prints
each one's median warm start: before/after in one session on a shared host.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fitserve.envs import fitserve_home  # noqa: E402
from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa  # noqa: E402
from fitserve.loading.pull import pull  # noqa: E402

REQUEST = {"model": "smollm2-135m", "prompt": "The three laws of thermodynamics are", "max_tokens": 16,
           "temperature": 0, "ignore_eos": True}


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (clock ticks -> s), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_once(home: Path, port: int, extra: list[str], repo: Path = ROOT) -> dict[str, object]:
    """Start the server of ``repo`` on ``home``, time it to /health ok, send three requests,
    stop it."""
    log = home / f"serve-{port}.log"
    env = {**os.environ, "FITSERVE_HOME": str(home), "PYTHONPATH": str(repo)}
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "fitserve.cli", "serve", "--port", str(port),
                                 "--log-level", "info", *extra], stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(log.read_text()[-3000:])
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready_s, ready_cpu = time.perf_counter() - t0, _cpu_seconds(proc.pid)
        latencies = []
        for _ in range(3):
            t = time.perf_counter()
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=REQUEST, timeout=300)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t)
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    summary = re.search(r"ready in .*", text)
    return {"ready_s": ready_s, "ready_cpu_s": ready_cpu, "requests_s": latencies,
            "built": re.findall(r"building C\+\+ kernels (\w+)", text),
            "summary": summary.group(0) if summary else "(no summary line)"}


def _label(repo: Path) -> str:
    """The checkout's short commit (its directory name where it is no git work tree)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                         text=True)
    return out.stdout.strip() if out.returncode == 0 else repo.name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cold", action="store_true", help="first start from an empty kernel cache")
    p.add_argument("--warm-runs", type=int, default=3)
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--repo", type=Path, action="append", default=[],
                   help="another fitserve checkout to start too, interleaved with this one")
    p.add_argument("extra", nargs="*", help="flags passed to fitserve serve (after --)")
    args = p.parse_args()
    model_dir = pull("smollm2-135m", progress=False).parent.parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit}; CPU: {cpu_model_name()}; {os.cpu_count()} CPUs; ISA: {detect_isa().describe()}; "
          f"load average at start: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="fitserve-startup-") as tmp:
        home = Path(tmp)
        (home / "models").symlink_to(model_dir, target_is_directory=True)
        if not args.cold:  # warm: seed the cache from this FITSERVE_HOME's builds
            subprocess.run(["cp", "-r", str(fitserve_home() / "extensions"), str(home / "extensions")], check=True)
        runs = [("cold" if args.cold else "warm", 0)] + [("warm", i + 1) for i in range(args.warm_runs)]
        repos = [ROOT, *args.repo]
        print("| checkout | start | to ready (s) | server CPU to ready (s) | compiled | request 1 / 2 / 3 (s) |")
        print("|---|---|---|---|---|---|")
        ready: dict[Path, list[float]] = {r: [] for r in repos}
        for kind, i in runs:
            for repo in repos:
                r = start_once(home, args.port, args.extra, repo)
                reqs = " / ".join(f"{s:.2f}" for s in r["requests_s"])  # type: ignore[attr-defined]
                print(f"| {_label(repo)} | {kind} {i} | {r['ready_s']:.2f} | {r['ready_cpu_s']:.2f} | "
                      f"{', '.join(r['built']) or '-'} | {reqs} |", flush=True)  # type: ignore[arg-type]
                if kind == "warm":
                    ready[repo].append(float(r["ready_s"]))  # type: ignore[arg-type]
        for repo, times in ready.items():
            if times:
                print(f"{_label(repo)}: median warm start {statistics.median(times):.2f} s to ready "
                      f"over {len(times)} starts")
        print(f"summary line: {r['summary']}; load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
