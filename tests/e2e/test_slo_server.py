"""SLO scheduling through the real server and the official openai client: a request predicted to
miss its TTFT target is a 429 with Retry-After (streamed or not) and leaves the server serving;
bad scheduling fields are 400s; a bad --scheduling-policy setting stops the server at start-up.

The server runs a step-time model given as a file (10 ms + 1 ms per token), so the predictions
are exact: a request's own ``slo_ttft_ms`` below its predicted TTFT is always turned away.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from fitserve.ledger.step_time import StepTimeModel, save_step_model
from tests.e2e.conftest import MODEL, Server, start_server, stop_server

openai = pytest.importorskip("openai")

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def slo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("slo-server")
    save_step_model(StepTimeModel(a=0.010, b=0.001, c=0.0, d=0.0), tmp / "step-model.json")
    srv = start_server(tmp, "--scheduling-policy", "slo", "--slo-ttft-ms", "5000",
                       "--slo-tpot-ms", "500", "--step-model", str(tmp / "step-model.json"))
    yield srv
    code = stop_server(srv)
    assert code == 0, srv.log.read_text()[-4000:]


def _client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_unreachable_ttft_is_429_with_retry_after_and_the_server_keeps_serving(slo_server: Server) -> None:
    client = _client(slo_server)
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert ok.choices[0].text and ok.usage is not None and ok.usage.completion_tokens == 4
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=stream,
                                      extra_body={"slo_ttft_ms": 1})
        err = info.value
        assert err.status_code == 429 and int(err.response.headers["retry-after"]) >= 1
        assert "TTFT target of 1 ms" in err.message
    assert slo_server.metric("fitserve_requests_rejected_total", '{status="429"}') == 2
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0.0, stream=True,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"slo_ttft_ms": 60_000, "slo_tpot_ms": 1000})
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    slo_server.wait_idle()


@pytest.mark.parametrize(("extra", "needle"), [
    ({"priority": 2}, "--scheduling-policy priority"),
    ({"slo_ttft_ms": -3}, "slo_ttft_ms must be a number of milliseconds > 0"),
    ({"slo_tpot_ms": 0}, "slo_tpot_ms must be a number of milliseconds > 0"),
])
def test_bad_scheduling_fields_are_400(slo_server: Server, extra: dict[str, object], needle: str) -> None:
    r = httpx.post(f"{slo_server.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True, **extra})
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_a_bad_scheduling_setting_stops_the_server_at_start_up(capsys: pytest.CaptureFixture[str]) -> None:
    from fitserve.cli import main

    # in-process: serve checks these before it loads anything or binds a port
    for flags, needle in ((["--scheduling-policy", "slo"], "needs a target"),
                          (["--slo-ttft-ms", "100"], "apply to --scheduling-policy slo")):
        capsys.readouterr()
        assert main(["serve", "--port", "1", *flags]) == 2
        assert needle in capsys.readouterr().err
