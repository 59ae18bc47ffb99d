"""Requests that omit sampling fields get the model's defaults, else the server's; the model
card and the startup log say which are in force; explicit request values always win."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading.generation_defaults import NEUTRAL, SERVER_DEFAULTS
from fitserve.loading.pull import pull
from fitserve.sampling import SamplingParams
from fitserve.server.app import create_app
from fitserve.server.engine_loop import EngineLoop
from fitserve.server.metrics import Metrics
from fitserve.server.settings import ServerSettings
from tests.e2e.conftest import API_KEY, MODEL, Server, start_server, stop_server
from tests.gguf_meta import copy_gguf_with_sampling
from tests.unit.loading.test_loading_gguf import write_gguf

GGUF_SOURCE = "model GGUF general.sampling.*"
PROMPT = "The three primary colours are"


def card(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    r.raise_for_status()
    data: dict[str, Any] = r.json()["data"][0]
    return data


def test_default_model_has_none_so_the_server_defaults_apply(server: Server) -> None:
    c = card(server)
    assert c["id"] == MODEL
    assert c["sampling_defaults"] == SERVER_DEFAULTS
    assert set(c["sampling_defaults_source"].values()) == {"server default"}


@pytest.fixture(scope="module")
def greedy_model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """SmolLM2 re-written with general.sampling.temp = 0, served with --default-top-k 7."""
    tmp = tmp_path_factory.mktemp("greedy-model")
    path = copy_gguf_with_sampling(pull(MODEL, progress=False), tmp / "smollm2-temp0.gguf", temp=0.0)
    srv = start_server(tmp, "--model", str(path), "--served-model-name", MODEL, "--api-key", API_KEY,
                       "--default-top-k", "7", "--log-level", "info")
    yield srv
    assert stop_server(srv) == 0, srv.log.read_text()[-4000:]


@pytest.mark.slow
def test_card_and_log_name_the_model_defaults(greedy_model_server: Server) -> None:
    c = card(greedy_model_server)
    assert c["sampling_defaults"] == {**NEUTRAL, "temperature": 0.0, "top_k": 7}
    src = c["sampling_defaults_source"]
    assert src["temperature"] == GGUF_SOURCE and src["top_k"] == "--default-top-k"
    assert src["top_p"].startswith("neutral")
    log = greedy_model_server.log.read_text()
    assert f"sampling defaults for requests that omit them: temperature=0.0 ({GGUF_SOURCE})" in log
    assert "top_k=7 (--default-top-k)" in log


@pytest.mark.slow
def test_omitted_temperature_takes_the_model_default(greedy_model_server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{greedy_model_server.url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=120)
    # no temperature: the model's 0 makes it greedy, so different seeds give the same text
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=1).choices[0].text
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=2).choices[0].text
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                       temperature=0).choices[0].text
    assert a == b == greedy and a
    msg = [{"role": "user", "content": "Name a fruit."}]
    chats = [client.chat.completions.create(model=MODEL, messages=msg, max_tokens=6, seed=s)
             .choices[0].message.content for s in (3, 4)]
    assert chats[0] == chats[1]
    # an explicit temperature overrides the model's default: four children now differ
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=4,
                                  seed=5)
    assert len({ch.text for ch in r.choices}) > 1


class RecordingEngine(Engine):
    """An Engine that keeps the SamplingParams each request reaches it with."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.seen: list[SamplingParams] = []

    def add_requests(self, prompt: Any, params: Any, request_ids: Any = None, **scheduling: Any) -> list[str]:
        self.seen.extend(params)  # every request comes through here (add_request too)
        return super().add_requests(prompt, params, request_ids, **scheduling)


def test_in_process_auto_and_vllm_modes(tmp_path: Path) -> None:
    """A tiny GGUF with sampling keys: what the card says is what requests get, field by field."""
    write_gguf(tmp_path / "tiny.gguf")
    path = copy_gguf_with_sampling(tmp_path / "tiny.gguf", tmp_path / "keys.gguf", temp=0.25, top_p=0.5)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    bodies = [{"prompt": "the", "max_tokens": 2},
              {"prompt": "the", "max_tokens": 2, "temperature": 0.7, "top_k": 0}]

    async def scenario(settings: ServerSettings) -> tuple[dict[str, Any], list[SamplingParams]]:
        loop = EngineLoop(config, Metrics(), engine_factory=RecordingEngine)
        app = create_app(loop, settings)
        loop.start()
        try:
            assert await asyncio.to_thread(loop.wait_ready, 60)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                model_card: dict[str, Any] = (await c.get("/v1/models")).json()["data"][0]
                for body in bodies:
                    assert (await c.post("/v1/completions", json=body)).status_code == 200
                chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
            assert isinstance(loop.engine, RecordingEngine)
            return model_card, loop.engine.seen
        finally:
            loop.stop()

    def fields(p: SamplingParams) -> dict[str, Any]:
        return {name: getattr(p, name) for name in NEUTRAL}

    auto_card, seen = asyncio.run(scenario(ServerSettings()))
    auto = {**NEUTRAL, "temperature": 0.25, "top_p": 0.5}
    assert auto_card["sampling_defaults"] == auto
    assert fields(seen[0]) == auto == fields(seen[2])  # omitted: the model's (completion, chat)
    assert fields(seen[1]) == {**auto, "temperature": 0.7, "top_k": 0}  # given: as sent
    vllm_card, seen = asyncio.run(scenario(ServerSettings(generation_config="vllm",
                                                          default_sampling={"min_p": 0.2})))
    server = {**SERVER_DEFAULTS, "min_p": 0.2}
    assert vllm_card["sampling_defaults"] == server and fields(seen[0]) == server
    assert vllm_card["sampling_defaults_source"]["min_p"] == "--default-min-p"
    assert fields(seen[1]) == {**server, "temperature": 0.7, "top_k": 0}


def test_bad_default_flag_exits_2_before_loading() -> None:
    proc = subprocess.run([sys.executable, "-m", "fitserve.cli", "serve", "--model", "/nonexistent",
                           "--default-top-p", "1.5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--default-top-p: invalid value 1.5" in proc.stdout + proc.stderr
