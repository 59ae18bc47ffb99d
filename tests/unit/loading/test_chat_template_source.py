"""--chat-template's value (a file or the text itself) and continue_final_message, vs transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitserve.loading.chat_template import (
    ChatTemplateError,
    load_chat_template,
    render_chat_template,
)
from tests.chat_template_reference import hf_render

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TRIMMING = "{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}[end]{% endfor %}"


def test_a_path_is_read_and_text_is_the_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    # a shell's one line: "\n" escapes are decoded (vLLM's rule), other text stays as typed
    assert load_chat_template(r"{{ 'é' }}\n{{ messages[0].content }}") == "{{ 'é' }}\n{{ messages[0].content }}"


def test_a_missing_path_and_a_bad_template_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not parse"):
        load_chat_template("{% for %}")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if x %}no end", encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        load_chat_template(str(bad))


@pytest.mark.parametrize("template", [TEMPLATE, TRIMMING])
@pytest.mark.parametrize("final", ["The answer is", "The answer is  ", "  spaced out "])
def test_continue_final_message_matches_transformers(template: str, final: str) -> None:
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": final}]
    ours = render_chat_template(template, messages, add_generation_prompt=False, continue_final_message=True)
    theirs = hf_render(template, messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == theirs
    assert not ours.endswith("[end]") and not ours.endswith("</assistant>\n")


def test_continue_final_message_refusals() -> None:
    messages = [{"role": "user", "content": "Q?"}]
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        render_chat_template(TEMPLATE, messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not show"):
        render_chat_template("{{ 'nothing' }}", messages, add_generation_prompt=False, continue_final_message=True)
