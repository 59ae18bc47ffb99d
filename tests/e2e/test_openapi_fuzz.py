"""Schemathesis against a real `fitserve serve`, with the server's own /openapi.json as the contract.

Every operation of the document, positive and negative generation (schemathesis' examples,
coverage and fuzzing phases), a bounded number of examples: CI-sized, ``benchmarks/fuzz_api.py``
is the longer run. Checked on every response: never a 5xx; every error in the OpenAI shape; the
status code, content type, headers and body (JSON, or each server-sent event of a stream) as
documented; schema-invalid requests rejected; the API key enforced; no request longer than
REQUEST_TIMEOUT_S. Afterwards the server is healthy, every KV block is free, and it exits 0 on
SIGTERM.

The server has its own small limits (a 64-token context, 64 KV blocks), and a positive case's
generation is capped (``bound_the_work``: n <= 2, 2 prompts, 4 new tokens), so that the cases
that reach the engine stay fast on two CPU cores. FITSERVE_FUZZ_VERBOSE=1 (with -s) prints each
case.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from fitserve.server.protocol.chat import ChatCompletionRequest  # noqa: E402
from fitserve.server.protocol.common import MAX_STOP_TOKEN_IDS  # noqa: E402
from fitserve.server.protocol.completions import CompletionRequest  # noqa: E402
from tests.e2e.conftest import API_KEY, Server, start_server, stop_server  # noqa: E402
from tests.e2e.openapi_fuzzing import CHECKS, bound_the_work, load_schema  # noqa: E402

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 6  # per operation, positive and negative drawn together, in the fuzzing phase
REQUEST_TIMEOUT_S = 60
SERVER_FLAGS = ("--api-key", API_KEY, "--max-model-len", "64", "--num-kv-blocks", "64")
VERBOSE = bool(os.environ.get("FITSERVE_FUZZ_VERBOSE"))
SENT: list[tuple[str, str, int, float]] = []  # (operation, mode, status, seconds) of every case


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # NOTE: one OpenMP thread: the fuzzing client needs the other core, and two spinning OpenMP
    # threads sharing one busy core make each decode step ~30x slower (1.2 s instead of 0.04 s).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        srv = start_server(tmp_path_factory.mktemp("openapi-fuzz"), *SERVER_FLAGS)
    yield srv
    code = stop_server(srv)
    assert code == 0, srv.log.read_text()[-4000:]


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Server) -> Any:
    # deterministic: the same cases every CI run (the benchmark script explores)
    return load_schema(fuzz_server.url, API_KEY, max_examples=MAX_EXAMPLES,
                       request_timeout=REQUEST_TIMEOUT_S, deterministic=True)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(autouse=True)
def _schemathesis_nodeid(request: pytest.FixtureRequest) -> None:
    # NOTE: schemathesis 4.32's from_fixture() reads and rewrites `node._nodeid` (to name each
    # operation's subtest); pytest 9 keeps the id in `_id` and has no `_nodeid`, so give it one.
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


@schema.parametrize()
def test_openapi_contract(case: Any) -> None:
    bound_the_work(case)
    mode = case.meta.generation.mode.value if case.meta is not None else "explicit"
    t0 = time.monotonic()
    response = case.call_and_validate(
        additional_checks=list(CHECKS),
        # NOTE: positive_data_acceptance cannot hold by design: a schema-valid request can still be
        # refused with a 400 for what JSON Schema cannot say, e.g. a prompt plus max_tokens over
        # the context length, token ids over the vocabulary, top_logprobs without logprobs,
        # stream_options without stream, priority without the priority policy, best_of != n.
        excluded_checks=[positive_data_acceptance],
    )
    SENT.append((case.operation.label, mode, response.status_code, time.monotonic() - t0))
    if VERBOSE:
        print(case.operation.label, mode, response.status_code, f"{SENT[-1][3]:.2f}s", flush=True)


def test_after_fuzz_healthy_and_no_leaks(fuzz_server: Server) -> None:
    statuses = Counter(status for _, _, status, _ in SENT)
    print(f"\n{len(SENT)} cases, statuses {dict(sorted(statuses.items()))}, "
          f"{sum(s for *_, s in SENT):.1f}s in requests")
    fuzz_server.wait_idle()  # every KV block free, nothing running or waiting
    assert httpx.get(f"{fuzz_server.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{fuzz_server.url}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_openapi_document_needs_the_key_and_names_the_real_fields(fuzz_server: Server) -> None:
    url = f"{fuzz_server.url}/openapi.json"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    r = httpx.get(url, headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest):
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields), model.__name__
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["required"] and body["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert doc["security"] == [{"bearerAuth": []}]


def test_documented_limits_are_the_servers() -> None:
    from fitserve.server import serving

    assert serving.MAX_STOP_TOKEN_IDS == MAX_STOP_TOKEN_IDS
