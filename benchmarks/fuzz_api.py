"""The long schemathesis run against a real `fitserve serve`: its own /openapi.json is the contract.

    .venv/bin/python benchmarks/fuzz_api.py [--examples 200] [--max-model-len 64] [--num-kv-blocks 64]
        [--port PORT --api-key KEY] [--seed S] [--max-tokens 8] [--max-n 2] [--max-prompts 2]
        [--timeout 60] [--phases examples,coverage,fuzzing]

What it does: starts `fitserve serve` on 127.0.0.1 (the default model, float32, one OpenMP
thread, the given context and KV pool, an API key), or fuzzes the server already on --port with
--api-key; loads the server's /openapi.json with the key and runs schemathesis' engine over every
operation (the same setup as tests/e2e/test_openapi_fuzz.py: positive and negative generation,
--examples per operation in the fuzzing phase, random unless --seed). Every response is
checked: no 5xx, errors in the OpenAI shape, status code / content type / headers / body (each
server-sent event of a stream too) as documented, schema-invalid requests rejected, the API key
enforced, no request longer than --timeout. Positive cases are capped (--max-n, --max-prompts,
--max-tokens; see ``bound_the_work``) so that a run stays minutes, not hours, on a CPU.

What it prints: requests sent (cases; schemathesis' own auth probes come on top), the status
histogram, the 5xx count (must be 0), every failed check with its reproduction, and the KV blocks
still in use once the server is idle (fitserve_kv_blocks_used, must be 0). Exit status 1 on any
of those, 0 otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.e2e: the server fixture and the shared schemathesis setup

import httpx  # noqa: E402
import schemathesis  # noqa: E402
from schemathesis.engine import Status, events, from_schema  # noqa: E402

from tests.e2e.conftest import Server, start_server, stop_server  # noqa: E402
from tests.e2e.openapi_fuzzing import CHECKS, bound_the_work, load_schema  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=200,
                   help="per operation (positive and negative drawn together), in the fuzzing phase")
    p.add_argument("--max-model-len", type=int, default=64, help="of the server this script starts")
    p.add_argument("--num-kv-blocks", type=int, default=64, help="of the server this script starts")
    p.add_argument("--port", type=int, default=None, help="fuzz the server already on 127.0.0.1:PORT")
    p.add_argument("--api-key", default="fuzz-key", help="the key of that server (or of the one started)")
    p.add_argument("--seed", type=int, default=None, help="repeat a run (default: random)")
    p.add_argument("--max-tokens", type=int, default=8, help="cap on new tokens of a positive case")
    p.add_argument("--max-n", type=int, default=2, help="cap on n of a positive case")
    p.add_argument("--max-prompts", type=int, default=2, help="cap on the prompt batch of a positive case")
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--phases", default="examples,coverage,fuzzing", help="schemathesis phases to run")
    return p.parse_args(argv)


def metric(url: str, key: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def kv_blocks_after_idle(url: str, key: str, timeout: float = 60.0) -> float:
    """fitserve_kv_blocks_used once nothing runs or waits (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = metric(url, key, "fitserve_num_requests_running") + metric(url, key, "fitserve_num_requests_waiting")
        used = metric(url, key, "fitserve_kv_blocks_used")
        if (busy == 0 and used == 0) or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def fuzz(url: str, args: argparse.Namespace) -> int:
    schema = load_schema(url, args.api_key, max_examples=args.examples, request_timeout=args.timeout,
                         deterministic=False, seed=args.seed)
    schema.config.phases.update(phases=args.phases.split(","))
    # NOTE: positive_data_acceptance cannot hold by design (a schema-valid request can still be a
    # 400: a prompt plus max_tokens over the context, token ids over the vocabulary, ...)
    schema.config.checks.update(excluded_check_names=["positive_data_acceptance"])
    for check in CHECKS:  # the engine runs the registered checks
        schemathesis.check(check)

    statuses: Counter[int] = Counter()
    slowest: list[tuple[float, str, int]] = []

    @schemathesis.hook
    def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
        bound_the_work(case, max_n=args.max_n, max_prompts=args.max_prompts, max_tokens=args.max_tokens)
        kwargs.setdefault("timeout", args.timeout)

    @schemathesis.hook
    def after_call(context: Any, case: Any, response: Any) -> None:
        statuses[response.status_code] += 1
        took = float(response.elapsed)
        slowest.append((took, case.operation.label, response.status_code))
        slowest.sort(reverse=True)
        del slowest[5:]

    failures: list[str] = []
    print(f"schemathesis {schemathesis.__version__}, seed {schema.config.seed}, --examples {args.examples}, "
          f"phases {args.phases}", flush=True)
    t0 = time.monotonic()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
            for case_id, checks in event.recorder.checks.items():
                for node in checks:
                    if node.status == Status.FAILURE:
                        info = node.failure_info
                        case = event.recorder.cases.get(case_id)
                        label = case.value.operation.label if case is not None else event.recorder.label
                        detail = f"{info.failure.title}: {info.failure.message}" if info is not None else ""
                        curl = f"\n    {info.code_sample}" if info is not None and info.code_sample else ""
                        failures.append(f"{label} [{node.name}] {detail}{curl}")
        elif isinstance(event, events.NonFatalError):
            failures.append(f"{event.label}: error {event.info.title}: {event.info.message}")
        elif isinstance(event, events.FatalError):
            failures.append(f"fatal: {event.exception!r}")
    elapsed = time.monotonic() - t0

    leaked = kv_blocks_after_idle(url, args.api_key)
    server_errors = sum(n for s, n in statuses.items() if s >= 500)
    healthy = httpx.get(f"{url}/health", timeout=10).status_code == 200
    print(f"requests sent: {sum(statuses.values())} in {elapsed:.0f}s (plus schemathesis' auth probes)")
    print(f"status histogram: {dict(sorted(statuses.items()))}")
    print(f"5xx responses: {server_errors}")
    print("slowest: " + ", ".join(f"{label} {status} {took:.1f}s" for took, label, status in slowest))
    unique = list(dict.fromkeys(failures))
    print(f"failed checks: {len(unique)}")
    for line in unique:
        print(f"  - {line}")
    print(f"KV blocks used after idle: {leaked:g}")
    print(f"/health after the run: {'200' if healthy else 'not 200'}")
    ok = not unique and server_errors == 0 and leaked == 0 and healthy
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.port is not None:
        return fuzz(f"http://127.0.0.1:{args.port}", args)
    import os

    os.environ["OMP_NUM_THREADS"] = "1"  # the client needs the other core (see test_openapi_fuzz.py)
    tmp = Path(tempfile.mkdtemp(prefix="fitserve-fuzz-"))
    server: Server = start_server(tmp, "--api-key", args.api_key, "--max-model-len", str(args.max_model_len),
                                  "--num-kv-blocks", str(args.num_kv_blocks))
    print(f"server {server.url} (log {server.log}), --max-model-len {args.max_model_len} "
          f"--num-kv-blocks {args.num_kv_blocks}")
    try:
        code = fuzz(server.url, args)
    finally:
        exit_code = stop_server(server)
    print(f"server exit status after SIGTERM: {exit_code}")
    if code or exit_code != 0:
        print(server.log.read_text()[-4000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
