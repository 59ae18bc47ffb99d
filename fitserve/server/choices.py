"""Each choice's output on its way to the client: logprobs as OpenAI writes them, the echoed
prompt in front of a completion, and a chat choice's reasoning and tool calls parsed out of its text.

:class:`ChoiceText` does the last two for one choice, streamed (``stream`` per delta) or whole
(``whole``); both go through the same incremental parsers (``fitserve.server.reasoning``, then
``fitserve.server.tool_call_formats`` on the content), so a streamed choice adds up to the same
reasoning, content and calls as the same choice returned at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fitserve.loading.tokenizer import Tokenizer
from fitserve.server.reasoning import ReasoningSplitter
from fitserve.server.serving import Prepared
from fitserve.server.tool_call_formats import ToolParser, make_tool_parser
from fitserve.types import RequestOutput, TokenLogprobs


@dataclass(slots=True)
class ChoicePiece:
    """What one delta of a choice adds: reasoning text, content text and completed tool calls."""

    reasoning: str
    content: str
    calls: list[dict[str, Any]]

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChoiceText:
    """One choice's text: ``prep.echo``'s prompt first (completions), reasoning split off
    (``--reasoning-parser``), tool calls parsed out of the rest (chat with tools, the
    ``--tool-call-parser`` format); otherwise the text as generated."""

    def __init__(self, prep: Prepared, index: int) -> None:
        self._prefix = prep.echo[index // prep.n] if prep.echo else ""
        self._echo_only = prep.echo_only  # max_tokens 0: the generated text is not the choice's
        plan = prep.tools
        self.parser: ToolParser | None = (make_tool_parser(plan.parser, plan.names or (), plan.max_calls)
                                          if plan is not None else None)
        self.splitter = (ReasoningSplitter(prep.reasoning_parser, prep.reasoning_opened)
                         if prep.reasoning_parser is not None else None)
        self._sent_calls = 0

    def stream(self, delta: str, finished: bool) -> ChoicePiece:
        """The reasoning and content to send for this delta and the tool-call deltas it completed."""
        text, self._prefix = self._prefix + ("" if self._echo_only else delta), ""
        reasoning = ""
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text)
            if finished:
                more_r, more_c = self.splitter.finish()
                reasoning, text = reasoning + more_r, text + more_c
        if self.parser is None:
            return ChoicePiece(reasoning, text, [])
        content, calls = self.parser.feed(text)
        if finished:
            more, rest = self.parser.finish()
            content, calls = content + more, calls + rest
        deltas = [c.delta_dict(self._sent_calls + i) for i, c in enumerate(calls)]
        self._sent_calls += len(calls)
        return ChoicePiece(reasoning, content, deltas)

    def whole(self, text: str) -> dict[str, Any]:
        """The finished choice's message fields: ``content`` (None when it is only tool calls,
        or only reasoning), ``tool_calls`` and, with a reasoning parser, ``reasoning_content``
        (also as ``reasoning``, current vLLM's name; None when the output had no think block)."""
        piece = self.stream(text, finished=True)
        calls = [{k: v for k, v in c.items() if k != "index"} for c in piece.calls]
        empty = not piece.content and (calls or (self.splitter is not None and piece.reasoning))
        message: dict[str, Any] = {"content": None if empty else piece.content}
        if self.splitter is not None:
            reasoning = piece.reasoning if self.splitter.saw_reasoning else None
            message["reasoning_content"] = message["reasoning"] = reasoning
        message["tool_calls"] = calls
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for a choice that stopped (EOS, grammar end) after making calls."""
        if reason == "stop" and self.parser is not None and self.parser.calls:
            return "tool_calls"
        return reason


def token_text_fn(tok: Tokenizer) -> Callable[[int], str]:
    @lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return tok.decode([token_id], skip_special_tokens=False)

    return text


def chat_logprobs(lps: list[TokenLogprobs], text: Callable[[int], str]) -> list[dict[str, Any]]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
            for t in lps]


def completion_logprobs(lps: list[TokenLogprobs], text: Callable[[int], str], offset: int,
                        head: int | None = None) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` of ``lps``; ``head``: a token before them that has no
    logprob (an echoed prompt's first token: null logprob and top_logprobs)."""
    ids = ([] if head is None else [head]) + [t.token_id for t in lps]
    tokens = [text(t) for t in ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    none: list[Any] = [] if head is None else [None]
    return {
        "tokens": tokens,
        "token_logprobs": none + [t.logprob for t in lps],
        "top_logprobs": none + [{text(i): lp for i, lp in t.top} for t in lps],
        "text_offset": offsets,
    }


def echoed_prompt_logprobs(prompt_lps: list[TokenLogprobs | None], num: int) -> list[TokenLogprobs]:
    """An echoed prompt's entries after its first token, with ``num`` alternatives each (the
    engine may have kept more: the prompt_logprobs field's)."""
    return [TokenLogprobs(e.token_id, e.logprob, e.rank, e.top[:num]) for e in prompt_lps[1:]
            if e is not None]


def completion_choice_logprobs(prep: Prepared, out: RequestOutput, text: Callable[[int], str]
                               ) -> dict[str, Any] | None:
    """A finished completion choice's ``logprobs``: with echo, the prompt's tokens first."""
    num = prep.params.logprobs
    if num is None:
        return None
    generated = [] if prep.echo_only else (out.logprobs or [])
    if prep.echo is None or out.prompt_logprobs is None:
        return completion_logprobs(generated, text, 0)
    return completion_logprobs(echoed_prompt_logprobs(out.prompt_logprobs, num) + generated, text, 0,
                               head=out.prompt_token_ids[0])


def vllm_prompt_logprobs(prompt_lps: list[TokenLogprobs | None] | None, num: int | None,
                         text: Callable[[int], str]) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (None first), token id -> {logprob, rank,
    decoded_token} for the prompt's own token and the top ``num``."""
    if prompt_lps is None or num is None:
        return None
    out: list[dict[str, Any] | None] = []
    for e in prompt_lps:
        if e is None:
            out.append(None)
            continue
        entry = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": text(e.token_id)}}
        for r, (tid, lp) in enumerate(e.top[:num], start=1):
            entry.setdefault(str(tid), {"logprob": lp, "rank": r, "decoded_token": text(tid)})
        out.append(entry)
    return out
