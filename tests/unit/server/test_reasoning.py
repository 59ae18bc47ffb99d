"""--reasoning-parser (fitserve.server.reasoning): the think block split off real Qwen3 and
DeepSeek-R1 outputs, the same whole and streamed at every cut."""

from __future__ import annotations

import pytest

from fitserve.server.reasoning import ReasoningSplitter, prompt_opens_think, split_reasoning

# Qwen3 with enable_thinking (the default): the output opens and closes its own block
QWEN3_THINKING = ("<think>\nOkay, the user asks for 17 * 3. 17 * 3 = 51.\n</think>\n\n"
                  "17 multiplied by 3 is **51**.")
# Qwen3 with enable_thinking=False: the template writes an empty block into the prompt
QWEN3_NO_THINKING = "17 multiplied by 3 is **51**."
# DeepSeek-R1(-Distill): the template ends with "<｜Assistant｜><think>\n", the output starts inside
R1 = ("Okay, so I need to find 17 times 3. 10 * 3 = 30 and 7 * 3 = 21, so 51.\n</think>\n\n"
      "17 × 3 = **51**")
# DeepSeek-R1-0528 writes the opening tag itself
R1_0528 = "<think>\nFirst, 17 * 3 = 51.\n</think>\n\nThe answer is 51."

CASES = [
    ("qwen3", False, QWEN3_THINKING, "\nOkay, the user asks for 17 * 3. 17 * 3 = 51.\n",
     "\n\n17 multiplied by 3 is **51**."),
    ("qwen3", False, QWEN3_NO_THINKING, None, QWEN3_NO_THINKING),
    ("qwen3", False, "  <think>a</think>b", "a", "b"),  # whitespace before the tag goes with it
    ("qwen3", False, "I think <think> is a tag", None, "I think <think> is a tag"),  # not at the start
    ("qwen3", True, "why\n</think>\n\nok", "why\n", "\n\nok"),  # Qwen3-Thinking-2507: prompt opened it
    ("qwen3", False, "<think>never closed", "never closed", ""),
    ("deepseek_r1", False, R1, "Okay, so I need to find 17 times 3. 10 * 3 = 30 and 7 * 3 = 21, so 51.\n",
     "\n\n17 × 3 = **51**"),
    ("deepseek_r1", False, R1_0528, "\nFirst, 17 * 3 = 51.\n", "\n\nThe answer is 51."),
    ("deepseek_r1", False, "still thinking (max_tokens)", "still thinking (max_tokens)", ""),
    ("deepseek_r1", False, "a</think>b</think>c", "a", "b</think>c"),  # only the first close counts
    ("qwen3", False, "", None, ""),
]


def streamed(parser: str, opened: bool, pieces: list[str]) -> tuple[str, str]:
    s = ReasoningSplitter(parser, opened)
    outs = [s.feed(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


@pytest.mark.parametrize(("parser", "opened", "text", "reasoning", "content"), CASES)
def test_whole(parser: str, opened: bool, text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, parser, opened) == (reasoning, content)


@pytest.mark.parametrize(("parser", "opened", "text", "reasoning", "content"), CASES)
def test_every_cut_and_char_by_char_stream_the_same(parser: str, opened: bool, text: str,
                                                    reasoning: str | None, content: str) -> None:
    expect = (reasoning or "", content)
    for i in range(len(text) + 1):
        assert streamed(parser, opened, [text[:i], text[i:]]) == expect, i
    assert streamed(parser, opened, list(text)) == expect


def test_reasoning_streams_before_the_block_closes() -> None:
    s = ReasoningSplitter("qwen3")
    assert s.feed("<thi") == ("", "")  # could still be the tag
    assert s.feed("nk>Let me") == ("Let me", "")
    assert s.feed(" see</thi") == (" see", "")  # a possible close is held
    assert s.feed("nk>\n\nDone") == ("", "\n\nDone")
    assert s.finish() == ("", "")


def test_prompt_opens_think() -> None:
    assert prompt_opens_think("<｜User｜>17*3?<｜Assistant｜><think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=False
    assert not prompt_opens_think("<|im_start|>assistant\n")


def test_unknown_parser_and_feed_after_finish() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'.*deepseek_r1, qwen3"):
        ReasoningSplitter("granite")
    s = ReasoningSplitter("qwen3")
    s.finish()
    with pytest.raises(RuntimeError):
        s.feed("x")
