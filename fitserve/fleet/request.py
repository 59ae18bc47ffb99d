"""What the ingress hands a replica (:class:`FleetRequest`) and the head of its answer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class FleetRequest:
    """One HTTP request, forwarded as is, with the text the router matches prefixes on.

    NOTE: ``prompt`` is also the attribute Ray Serve LLM's PrefixCacheAffinityRouter reads, so that
    router can be configured on the replicas instead of fitserve's.
    """

    method: str
    path: str
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    prompt: str = ""
    routing: str | None = None  # a per-request routing mode (X-Fitserve-Routing), else the fleet's
    exclude: tuple[str, ...] = ()  # replicas that already refused it (429/503) or died on it
    pin: str | None = None  # send to this replica only (the ingress's per-replica /metrics)


@dataclass(slots=True)
class ResponseHead:
    """The first item a replica yields: status, headers and who answered."""

    status: int
    headers: list[tuple[str, str]]
    replica: str
    pid: int


def routing_text(body: bytes) -> str:
    """The prompt a request body carries, as text to match prefixes on ("" when there is none).

    Chat messages are joined role by role so two conversations share a prefix exactly while their
    messages do; a completions prompt is taken as given (token-id prompts as their numbers).
    """
    try:
        data: Any = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    messages = data.get("messages")
    if isinstance(messages, list):
        return "".join(f"<{m.get('role', '')}>{_content_text(m.get('content'))}\n" for m in messages
                       if isinstance(m, dict))
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return " ".join(str(t) for t in prompt if isinstance(t, int))
        if isinstance(first, list):
            return " ".join(str(t) for t in first if isinstance(t, int))
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""
