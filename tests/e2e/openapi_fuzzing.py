"""What tests/e2e/test_openapi_fuzz.py and benchmarks/fuzz_api.py share: the schemathesis setup for
fuzzing a real `fitserve serve` against its own /openapi.json, and the checks fitserve adds.

A check is ``check(ctx, response, case)``: it raises AssertionError on a failure and returns True
when it checked something, None when it does not apply.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from schemathesis import GenerationMode

ERROR_KEYS = {"message", "type", "param", "code"}


def openai_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx/5xx is ``{"error": {"message", "type", "param", "code"}}`` with a message."""
    if response.status_code < 400:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} body is not JSON: {response.content[:200]!r}") from None
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(body, dict) and set(body) == {"error"} and isinstance(err, dict), body
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    return True


def completions_are_whole(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 200 from a generation route: a stream ends with ``[DONE]`` (or an error event) within
    the request timeout; a body's choices are indexed 0..k-1, each once."""
    if response.status_code != 200 or not case.operation.path.endswith("completions"):
        return None
    ctype = response.headers.get("content-type", [""])[0]
    if ctype.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.content.decode().split("\n") if line.startswith("data: ")]
        assert events, response.content[:200]
        assert events[-1] == "[DONE]" or '"error"' in events[-1], events[-3:]
        return True
    choices = json.loads(response.content)["choices"]
    assert sorted(c["index"] for c in choices) == list(range(len(choices))), choices
    return True


CHECKS = (openai_error_shape, completions_are_whole)


def bound_the_work(case: Any, *, max_n: int = 2, max_prompts: int = 2, max_tokens: int = 4) -> None:
    """Make a positive case's generation small, keeping it schema-valid.

    A schema-valid request may ask for 64 prompts x n=16 = 1024 sequences, each to the end of the
    context: minutes of CPU, and over --max-waiting (256) sequences the server answers 503
    "overloaded; retry later" even with an empty queue (a server bug, see the report). So ``n``,
    the prompt batch and every token limit are capped; an omitted or null limit becomes
    ``max_tokens`` too. Negative cases are left as generated.
    """
    meta = case.meta
    body = case.body
    if meta is None or meta.generation.mode != GenerationMode.POSITIVE or not isinstance(body, dict):
        return
    if isinstance(body.get("n"), int) and body["n"] > max_n:
        body["n"] = max_n
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        body["prompt"] = prompt[:max_prompts]
    if "chat" in case.operation.path:
        limits = ("max_tokens", "max_completion_tokens")
        if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
            body["max_completion_tokens"] = max_tokens
    else:
        limits = ("max_tokens",)
        if body.get("max_tokens") is None:
            body["max_tokens"] = max_tokens
    for name in limits:
        if isinstance(body.get(name), int) and body[name] > max_tokens:
            body[name] = max_tokens


def load_schema(url: str, key: str, *, max_examples: int, request_timeout: float,
                deterministic: bool, seed: int | None = None) -> Any:
    """The server's own document (fetched with the key), set up for positive and negative
    generation, ``max_examples`` per operation (both modes drawn together) in the fuzzing phase,
    and the key on every request (schemathesis still probes each operation without it and with a
    wrong one)."""
    auth = {"Authorization": f"Bearer {key}"}
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=auth, timeout=30)
    schema.config.update(headers=auth, request_timeout=request_timeout)
    # read whole streams (the default stops after a few events): only the timeout cuts one short
    schema.config.max_stream_events = 1_000_000
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=max_examples, deterministic=deterministic,
                                    database="none")
    if seed is not None:
        schema.config.seed = seed
    # 413 is how the server rejects a body over --max-body-bytes, valid or not
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]  # a new list: the default is shared
    return schema
