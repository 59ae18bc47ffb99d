"""A quantized KV cache end to end: ``fitserve serve --kv-cache-dtype int8`` answers the official
openai client (plain and streamed) with the text the offline engine gives on the same cache, and
a bad value is refused at start-up with a message naming the flag."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fitserve.engine.llm import LLM
from fitserve.sampling import SamplingParams
from tests.e2e.conftest import MODEL, Server, start_server, stop_server

openai = pytest.importorskip("openai")

PROMPT = "The three primary colours are"
MAX_TOKENS = 24
KV = ["--kv-cache-dtype", "int8", "--kv-cache-scales", "channel-key"]
# the server's engine settings (tests/e2e/conftest.py start_server)
ENGINE = {"dtype": "float32", "max_model_len": 1024, "num_kv_blocks": 256,
          "kv_cache_dtype": "int8", "kv_cache_scales": "channel-key"}
GREEDY = {"temperature": 0.0, "top_p": 1.0,
          "extra_body": {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}}


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("kv-int8-server"), *KV)
    yield srv
    code = stop_server(srv)
    assert code == 0, srv.log.read_text()[-4000:]


def test_int8_cache_server_matches_offline_engine(kv_server: Server) -> None:
    llm = LLM(MODEL, **ENGINE)  # type: ignore[arg-type]
    assert llm.engine.runner.kv_format == "int8-kc"
    want = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    client = openai.OpenAI(base_url=f"{kv_server.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, **GREEDY)
    assert r.choices[0].text == want.outputs[0].text
    parts = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in parts if c.choices) == want.outputs[0].text


def test_a_bad_kv_cache_dtype_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fitserve.cli", "serve", "--kv-cache-dtype",
                           "int4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--kv-cache-dtype" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "fitserve.cli", "generate", "--kv-cache-scales",
                           "token", "--max-tokens", "2", "hi"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "--kv-cache-scales" in proc.stderr, proc.stderr[-2000:]
