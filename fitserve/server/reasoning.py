"""Reasoning out of generated text: ``<think>...</think>`` becomes the message's
``reasoning_content`` (``--reasoning-parser``, vLLM's names), whole or as it streams.

The parsers (vLLM's ``deepseek_r1`` and ``qwen3``)::

    deepseek_r1  the output starts inside the think block (DeepSeek-R1's template opens
                 ``<think>``; a ``<think>`` the model writes itself at the start is dropped):
                 "why</think>answer"          -> reasoning "why",  content "answer"
                 "<think>why</think>answer"   -> reasoning "why",  content "answer"
                 "why... (never closed)"      -> reasoning all,    content none
    qwen3        a think block only where the output opens one (Qwen3 thinking), or where the
                 prompt already did (its text ends with ``<think>``: Qwen3-Thinking-2507):
                 "<think>\\nwhy\\n</think>\\n\\nanswer" -> reasoning "\\nwhy\\n", content "\\n\\nanswer"
                 "answer"  (enable_thinking=False)   -> content "answer", no reasoning

Everything after the first ``</think>`` is content (tool calls are parsed from it). As in vLLM,
the text on either side of the tags is kept as generated (no whitespace trimmed).

NOTE: an unclosed block is reasoning with both parsers (vLLM's qwen3 calls it content when
returned whole, reasoning when streamed); one rule for both ways keeps a streamed choice equal
to the same choice returned whole.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def prompt_opens_think(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a think block its template opened."""
    return prompt.rstrip().endswith(THINK_OPEN)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Incremental splitter: ``feed(delta)`` and, at the end, ``finish()`` each return
    ``(reasoning, content)``: the text of each part now safe to send."""

    def __init__(self, parser: str, prompt_opened: bool = False) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}")
        self.parser = parser
        # start: a leading <think> may still come | reasoning | content
        self._mode = "reasoning" if prompt_opened else "start"
        self._buf = ""
        self._finished = False
        self.saw_reasoning = parser == "deepseek_r1" or prompt_opened  # a think block was open at all

    def feed(self, delta: str) -> tuple[str, str]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        if self._finished:
            return "", ""
        out = self._run(final=True)
        self._finished = True
        return out

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf = head[len(THINK_OPEN):]
                self._mode = "reasoning"
                self.saw_reasoning = True
            elif not final and THINK_OPEN.startswith(head):
                return "", ""  # could still become <think> (or only whitespace so far)
            else:
                self._mode = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self._mode == "reasoning":
            i = self._buf.find(THINK_CLOSE)
            if i < 0:
                keep = 0 if final else _partial_suffix(self._buf, THINK_CLOSE)
                reasoning.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
            else:
                reasoning.append(self._buf[:i])
                self._buf = self._buf[i + len(THINK_CLOSE):]
                self._mode = "content"
        if self._mode == "content":
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)


def split_reasoning(text: str, parser: str, prompt_opened: bool = False) -> tuple[str | None, str]:
    """The whole output -> ``(reasoning or None when no think block was open, content)``."""
    splitter = ReasoningSplitter(parser, prompt_opened)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2 if splitter.saw_reasoning else None), c1 + c2
