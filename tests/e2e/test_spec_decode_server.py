"""Speculative decoding end to end: ``fitserve serve --speculative-config`` (vLLM's JSON flag)
answers a greedy completion with the very text plain decoding gives, and /metrics shows the
drafts it verified (vLLM's ``spec_decode`` names, ``fitserve_`` prefix); offline, ``LLM`` reports
the same counters and each Completion its own; ``fitserve generate`` takes the flag too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fitserve.engine.llm import LLM
from fitserve.sampling import SamplingParams
from tests.e2e.conftest import MODEL, Server, start_server, stop_server

openai = pytest.importorskip("openai")

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
# a prompt that repeats itself verbatim: the n-gram proposer's drafts keep being right
PROMPT = "the cat sat on the mat. " * 12
MAX_TOKENS = 32
# the server's engine settings (tests/e2e/conftest.py start_server)
ENGINE = {"dtype": "float32", "max_model_len": 1024, "num_kv_blocks": 256}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("spec-server"), "--speculative-config", json.dumps(SPEC))
    yield srv
    code = stop_server(srv)
    assert code == 0, srv.log.read_text()[-4000:]


@pytest.fixture(scope="module")
def plain_text() -> str:
    """Greedy text without speculation, offline on the server's engine settings."""
    llm = LLM(MODEL, **ENGINE)  # type: ignore[arg-type]
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0]
    assert llm.spec_decode_stats() is None
    assert (out.num_draft_tokens, out.num_accepted_tokens) == (0, 0)
    return out.text


def wait_metric(server: Server, name: str, timeout: float = 10.0) -> float:
    """The engine publishes its totals when it goes idle, just after the last reply: poll."""
    deadline = time.monotonic() + timeout
    while (value := server.metric(name)) <= 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_greedy_completion_is_unchanged_and_metrics_count_the_drafts(spec_server: Server, plain_text: str) -> None:
    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    # sampling fields given explicitly: the model's defaults (e.g. a repetition penalty, which
    # turns speculation off for the request) must not apply
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                  top_p=1.0, extra_body={"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0})
    assert r.choices[0].text == plain_text
    assert r.usage.completion_tokens == MAX_TOKENS or r.choices[0].finish_reason == "stop"

    assert wait_metric(spec_server, "fitserve_spec_decode_num_accepted_tokens_total") > 0
    drafts = spec_server.metric("fitserve_spec_decode_num_drafts_total")
    draft_tokens = spec_server.metric("fitserve_spec_decode_num_draft_tokens_total")
    accepted = spec_server.metric("fitserve_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and draft_tokens >= accepted > 0
    rate = spec_server.metric("fitserve_spec_decode_acceptance_rate")
    assert 0.0 <= rate <= 1.0 and rate == pytest.approx(accepted / draft_tokens)
    mean_len = spec_server.metric("fitserve_spec_decode_mean_accepted_length")
    assert 1.0 <= mean_len <= 1 + SPEC["num_speculative_tokens"]
    per_pos = [spec_server.metric("fitserve_spec_decode_num_accepted_tokens_per_pos_total", f'{{position="{i}"}}')
               for i in range(SPEC["num_speculative_tokens"])]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_offline_llm_reports_spec_decode_stats_and_per_request_counts(plain_text: str) -> None:
    llm = LLM(MODEL, speculative_config=SPEC, **ENGINE)  # type: ignore[arg-type]
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0]
    assert out.text == plain_text
    st = llm.spec_decode_stats()
    assert st is not None and st.num_accepted_tokens > 0
    # one request: its own counts are the engine's
    assert (out.num_draft_tokens, out.num_accepted_tokens) == (st.num_draft_tokens, st.num_accepted_tokens)
    assert 0.0 < st.acceptance_rate <= 1.0


def test_generate_command_takes_the_flag(tmp_path: Path, plain_text: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    cmd = [sys.executable, "-m", "fitserve.cli", "generate", PROMPT, "--max-tokens", str(MAX_TOKENS),
           "--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256",
           "--speculative-config", json.dumps(SPEC)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout == plain_text + "\n"
    bad = subprocess.run([*cmd[:4], "--speculative-config", '{"method": "ngram"}'],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "--speculative-config" in bad.stderr, bad.stderr
