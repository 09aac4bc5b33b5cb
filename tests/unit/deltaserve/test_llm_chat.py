"""LLM.chat's options without a model: continue_final_message cuts the rendered text where the
final message's content ends (trailing space kept where the template keeps it, dropped where the
template trims it, as transformers does), chat_template_kwargs reach the template, and a chat
template given for the call gets the model's special tokens from tokenizer_config.json even
when the model has no template of its own."""
from __future__ import annotations

import json

import pytest

from deltaserve.llm_chat import ChatOptions, call_template, chat_prompt_ids
from engine_common.request.params import ParamError
from engine_common.text.chat_template import ChatMessage, ChatTemplate

KEEPS = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
TRIMS = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
CONTINUE = ChatOptions(add_generation_prompt=False, continue_final_message=True)


class TextTokenizer:
    """encode() returns the text itself, one character a token."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[str]:
        assert not add_special_tokens
        return list(text)


def _text(template: str, messages, options: ChatOptions) -> str:
    return "".join(chat_prompt_ids(TextTokenizer(), ChatTemplate(template), messages, options,
                                   "m"))


@pytest.mark.parametrize("template, expected", [(KEEPS, "<user>Hi</user><assistant>Sure, "),
                                                (TRIMS, "<user>Hi</user><assistant>Sure,")])
def test_continue_final_message_ends_the_prompt_inside_it(template, expected):
    messages = [{"role": "user", "content": "Hi"}, ChatMessage("assistant", "Sure, ")]
    assert _text(template, messages, CONTINUE) == expected


def test_chat_template_kwargs_reach_the_template():
    template = "{{ messages[0].content }}{% if loud %}!{% endif %}"
    options = ChatOptions(template_kwargs={"loud": True})
    assert _text(template, [{"role": "user", "content": "Hi"}], options) == "Hi!"


def test_a_template_for_the_call_gets_the_models_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}}))
    template = call_template(None, "{{ bos_token }}{{ messages[0].content }}", str(tmp_path))
    assert template.render([{"role": "user", "content": "Hi"}]) == "<s>Hi"
    own = ChatTemplate("x")
    assert call_template(own, None, str(tmp_path)) is own


def test_continuing_a_message_the_template_drops_is_refused():
    with pytest.raises(ParamError, match="continue_final_message=True is invalid"):
        _text("{{ messages | length }}", [{"role": "user", "content": "Hi"}], CONTINUE)
