"""--chat-template and the chat-template request fields against a real `fitserve serve`.

The prompt the model sees is read back through /tokenize + /detokenize (and equals the
usage.prompt_tokens of the chat completion); transformers' apply_chat_template on the same
template is the reference text.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.chat_template_reference import hf_render
from tests.e2e.conftest import Server, start_server, stop_server
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

FILE_TEMPLATE = ("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}<</{{ m.role }}>>\n{% endfor %}"
                 "{% if add_generation_prompt %}<<assistant>>"
                 "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}{% endif %}")
STRING_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}bot:{% endif %}"
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def tpl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tpl")
    (tmp / "t.jinja").write_text(FILE_TEMPLATE, encoding="utf-8")
    srv = start_server(tmp, "--chat-template", str(tmp / "t.jinja"), "--trust-request-chat-template")
    yield srv
    assert stop_server(srv) == 0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF file without tokenizer.chat_template."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", TinyGGUF(context=1024))


def seen(url: str, **body: Any) -> str:
    """The prompt text /tokenize renders for ``body`` (what a chat completion of it generates after)."""
    r = httpx.post(f"{url}/tokenize", json={"messages": CHAT, **body}, timeout=60)
    assert r.status_code == 200, r.text
    d = httpx.post(f"{url}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60)
    return str(d.json()["prompt"])


def chat(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120,
                      json={"messages": CHAT, "max_tokens": 2, "temperature": 0, **body})


def test_file_template_is_the_prompt(tpl_server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{tpl_server.url}/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=2, temperature=0)
    text = seen(tpl_server.url)
    assert text == hf_render(FILE_TEMPLATE, CHAT, add_generation_prompt=True)
    r = httpx.post(f"{tpl_server.url}/tokenize", json={"messages": CHAT}, timeout=60).json()
    assert out.usage is not None and out.usage.prompt_tokens == r["count"]


def test_request_fields(tpl_server: Server) -> None:
    url = tpl_server.url
    assert seen(url, chat_template_kwargs={"enable_thinking": False}) == hf_render(
        FILE_TEMPLATE, CHAT, add_generation_prompt=True, enable_thinking=False)
    assert "<no-think>" in seen(url, chat_template_kwargs={"enable_thinking": False})
    assert seen(url, add_generation_prompt=False) == hf_render(FILE_TEMPLATE, CHAT, add_generation_prompt=False)
    partial = [*CHAT, {"role": "assistant", "content": "Hi the"}]
    assert seen(url, messages=partial, continue_final_message=True) == hf_render(
        FILE_TEMPLATE, partial, add_generation_prompt=False, continue_final_message=True)
    assert seen(url, chat_template=STRING_TEMPLATE) == hf_render(STRING_TEMPLATE, CHAT, add_generation_prompt=True)
    base = chat(url).json()["usage"]["prompt_tokens"]
    assert chat(url, chat_template_kwargs={"enable_thinking": False}).json()["usage"]["prompt_tokens"] > base
    for body, param in (({"chat_template_kwargs": {"nope": 1}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
                        ({"chat_template": "{% for %}"}, "chat_template")):
        r = chat(url, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_model_without_template(tiny_model: Path, tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--model", str(tiny_model))
    try:
        r = chat(srv.url)
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"], r.text
        r = chat(srv.url, chat_template=STRING_TEMPLATE)
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
    finally:
        assert stop_server(srv) == 0
    srv = start_server(tmp_path, "--model", str(tiny_model), "--chat-template", STRING_TEMPLATE)
    try:
        assert chat(srv.url).status_code == 200
        assert seen(srv.url) == hf_render(STRING_TEMPLATE, CHAT, add_generation_prompt=True)
    finally:
        assert stop_server(srv) == 0


@pytest.mark.parametrize(("value", "why"), [("{% for %}", "does not parse"),
                                            ("no/such/template.jinja", "looks like a file path")])
def test_bad_template_fails_start_up(tiny_model: Path, value: str, why: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "fitserve.cli", "serve", "--model", str(tiny_model),
                           "--chat-template", value], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--chat-template" in proc.stderr and why in proc.stderr, proc.stderr
