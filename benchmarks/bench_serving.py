"""W3-style serving benchmark: `fitserve bench` against `fitserve serve` (and `transformers serve`).

Starts each server on 127.0.0.1, runs the same closed-loop workload at concurrency 1, 8 and 32
(fixed prompt and output lengths, greedy, a warm-up first), and prints TTFT / TPOT percentiles
and throughput side by side. `transformers serve` is skipped when it cannot start here.

    .venv/bin/python benchmarks/bench_serving.py [--concurrency 1 8 32] [--output-len 32]

NOTE: `transformers serve` rejects `ignore_eos`, so both servers run without it and output
lengths follow the (same) model's EOS; throughput is counted in tokens actually produced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from fitserve.tools.bench.cli import BenchConfig, run_bench


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _server(cmd: list[str], health_url: str, log: Path, timeout: float = 600) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not become healthy; see {log}")
            time.sleep(0.5)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _hf_folder(home: Path) -> Path:
    """SmolLM2 as a plain Hugging Face folder (transformers serve cannot load the GGUF's config)."""
    import torch
    import transformers as tf
    from safetensors.torch import save_file

    from fitserve.loading.pull import pull

    out = home / "hf" / "smollm2-135m"
    if (out / "model.safetensors").exists():
        return out
    gguf = pull("smollm2-135m", progress=False)
    model = tf.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights are dequantized now
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.save_pretrained(out)
    return out


def _sweep(name: str, base_url: str, model: str, args: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for c in args.concurrency:
        cfg = BenchConfig(
            base_url=base_url, model=model, num_requests=max(args.min_requests, args.rounds * c),
            warmup=min(c, 4), concurrency=c, prompt_len=f"fixed:{args.prompt_len}",
            output_len=f"fixed:{args.output_len}", ignore_eos=False,
            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
            output_json=out_dir / f"{name}-c{c}.json", output_png=out_dir / f"{name}-c{c}.png",
            label=f"{name} c={c}",
        )
        summary = run_bench(cfg)
        rows.append({"server": name, "concurrency": c, **summary})
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'server':<14}{'conc':>5}{'reqs':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'TPOT p99':>10}{'req/s':>8}{'out tok/s':>11}{'goodput':>9}")
    lines = [head, "-" * len(head)]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    for r in rows:
        lines.append(
            f"{r['server']:<14}{r['concurrency']:>5}{r['completed']:>6}{ms(r['ttft_ms']['p50']):>10}"
            f"{ms(r['ttft_ms']['p99']):>10}{ms(r['tpot_ms']['p50']):>10}{ms(r['tpot_ms']['p99']):>10}"
            f"{r['request_throughput']:>8.2f}{r['output_token_throughput']:>11.1f}{r['goodput']:>9.2f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=2, help="requests per client at each concurrency")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=2000)
    p.add_argument("--slo-tpot-ms", type=float, default=200)
    p.add_argument("--out-dir", type=Path, default=Path("bench-serving-results"))
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []

    port = _free_port()
    cmd = [sys.executable, "-m", "fitserve.cli", "serve", "--port", str(port), "--max-model-len", "2048",
           "--log-level", "warning"]
    with _server(cmd, f"http://127.0.0.1:{port}/health", args.out_dir / "fitserve.log"):
        rows += _sweep("fitserve", f"http://127.0.0.1:{port}/v1", "smollm2-135m", args, args.out_dir)

    tf_cli = Path(sys.executable).with_name("transformers")
    if not args.skip_transformers and (tf_cli.exists() or shutil.which("transformers")):
        try:
            from fitserve.envs import fitserve_home

            folder = _hf_folder(fitserve_home())
            port = _free_port()
            cmd = [str(tf_cli if tf_cli.exists() else "transformers"), "serve", str(folder), "--port", str(port),
                   "--continuous-batching", "--device", "cpu", "--dtype", "float32"]
            with _server(cmd, f"http://127.0.0.1:{port}/health", args.out_dir / "transformers.log"):
                rows += _sweep("transformers", f"http://127.0.0.1:{port}/v1", str(folder), args, args.out_dir)
        except Exception as exc:  # noqa: BLE001 - the peer is optional
            print(f"transformers serve skipped: {exc}", file=sys.stderr)

    (args.out_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    print(f"\nprompt {args.prompt_len} tokens, up to {args.output_len} new tokens, greedy; latencies in ms")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
