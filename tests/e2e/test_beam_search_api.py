"""Beam search through the server (vLLM's ``use_beam_search`` extension): the official openai
client gets n beams as n choices, best first, the same beams ``LLM.beam_search`` finds offline
on the same model and settings; misuse is a 400 that names the field."""

from __future__ import annotations

import openai
import pytest

from fitserve.engine.llm import LLM
from fitserve.sampling.beam_search import BeamSearchParams
from tests.e2e.conftest import MODEL


@pytest.fixture(scope="module")
def offline() -> LLM:
    # the server's engine settings (tests/e2e/conftest.py start_server)
    return LLM("smollm2-135m", dtype="float32", max_model_len=1024, num_kv_blocks=256)


def test_completion_beams_equal_offline_beam_search(client, offline: LLM) -> None:  # type: ignore[no-untyped-def]
    prompts = ["The capital of France is", "def fibonacci(n):"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, n=3,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.8})
    assert [c.index for c in r.choices] == list(range(6))
    want = offline.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.8))
    for i, res in enumerate(want):
        got = r.choices[3 * i: 3 * i + 3]
        assert [c.text for c in got] == [b.text for b in res.sequences]
        assert [c.finish_reason for c in got] == [b.finish_reason.value for b in res.sequences]
    assert r.usage.completion_tokens == sum(len(b.token_ids) for res in want for b in res.sequences)


def test_chat_beams(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                       max_tokens=12, n=2, extra_body={"use_beam_search": True})
    assert len(r.choices) == 2 and all(c.message.content for c in r.choices)
    assert r.choices[0].message.content != r.choices[1].message.content


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": True}, "stream"),
    ({"logprobs": 2}, "logprobs"),
    ({"stop": ["\n"]}, "stop"),
    ({"length_penalty": "long"}, "length_penalty"),
])
def test_beam_search_misuse_is_a_400(client, extra: dict[str, object], param: str) -> None:  # type: ignore[no-untyped-def]
    kw = {k: v for k, v in extra.items() if k in ("stream", "logprobs", "stop")}
    body = {"use_beam_search": True, **{k: v for k, v in extra.items() if k not in kw}}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2, extra_body=body, **kw)
    assert err.value.body["param"] == param, err.value.body
