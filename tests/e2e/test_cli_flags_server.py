"""`fitserve serve MODEL -t 1 -c 512 --alias foo --max-logprobs 2 --dtype half`: the flags people type, on a
real server (the model given positionally, as `vllm serve MODEL`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server


def test_positional_model_threads_ctx_size_alias_and_max_logprobs(
        smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    srv = start_server(tmp_path_factory.mktemp("flags"), str(smollm2_path), "-t", "1", "-c", "512",
                       "--alias", "foo", "--max-logprobs", "2", "--dtype", "half", "--log-level", "info")
    try:
        [card] = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]
        assert card["id"] == "foo" and card["max_model_len"] == 512
        body = {"model": "foo", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        ok = httpx.post(f"{srv.url}/v1/completions", json={**body, "logprobs": 2}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
        over = httpx.post(f"{srv.url}/v1/completions", json={**body, "logprobs": 3}, timeout=60)
        assert over.status_code == 400 and over.json()["error"]["param"] == "logprobs"
        assert "--max-logprobs" in over.json()["error"]["message"]
        long = httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": 600}, timeout=60)
        assert long.status_code == 400  # -c 512 is the context length
        assert "torch CPU threads of the engine: 1" in srv.log.read_text()
    finally:
        assert stop_server(srv) == 0
