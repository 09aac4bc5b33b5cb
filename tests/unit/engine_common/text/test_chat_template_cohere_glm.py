"""Command-R's and GLM-4's chat templates render and encode exactly as transformers'
apply_chat_template. Command-R's tokenizer_config.json holds named templates ("default",
"tool_use", "rag": the last two stand-ins here): a chat without tools takes "default", one with
tools "tool_use" (before: "default" always, the tools dropped without a word); "default"'s
`{{ bos_token }}` is tokenized to the one BOS id, its turns are special tokens, its content
`.strip()`ped, its roles checked with raise_exception. GLM-4-0414's starts with the
`[gMASK]<sop>` special tokens as text, gathers the system messages first, reads
`message.get("metadata", "")` and filters its loop with `if`. The templates are reconstructions of
the released ones (CohereForAI/c4ai-command-r-v01, THUDM/GLM-4-9B-0414), not downloads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoTokenizer

from engine_common.request.params import ParamError
from engine_common.text.chat_template import encode_chat, load_chat_template
from engine_common.text.tiny_tokenizer import make_tiny_tokenizer_dir
from engine_common.text.tokenizer import Tokenizer
from tests.unit.engine_common.text.test_chat_template import CONVERSATIONS

_TURN = "<|START_OF_TURN_TOKEN|>"
COMMAND_R = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% elif false == true %}"
    "{% set loop_messages = messages %}{% set system_message = 'You are Command-R.' %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% if system_message != false %}{{ '" + _TURN + "<|SYSTEM_TOKEN|>' + system_message + "
    "'<|END_OF_TURN_TOKEN|>' }}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation"
    " roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set content = message['content'] %}{% if message['role'] == 'user' %}"
    "{{ '" + _TURN + "<|USER_TOKEN|>' + content.strip() + '<|END_OF_TURN_TOKEN|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + _TURN + "<|CHATBOT_TOKEN|>'  + "
    "content.strip() + '<|END_OF_TURN_TOKEN|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + _TURN + "<|CHATBOT_TOKEN|>' }}{% endif %}")
COMMAND_R_NAMED = [{"name": "default", "template": COMMAND_R},
                   {"name": "tool_use", "template": (
                       "{{ bos_token }}TOOLS {{ tools | tojson }}{% for m in messages %}"
                       "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")},
                   {"name": "rag", "template": "RAG {{ documents }}"}]
GLM4 = (
    "[gMASK]<sop>{%- if tools -%}<|system|>\n# tools\n{% for tool in tools %}"
    "{{ tool | tojson(ensure_ascii=False) }}{%- endfor %}{%- endif -%}"
    "{%- for msg in messages %}{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages if message.role != 'system' %}"
    "{%- set role = message['role'] %}{%- set content = message['content'] %}"
    "{%- set meta = message.get(\"metadata\", \"\") %}"
    "{%- if role == 'user' %}<|user|>\n{{ content }}"
    "{%- elif role == 'assistant' and not meta %}<|assistant|>\n{{ content }}"
    "{%- elif role == 'assistant' and meta %}<|assistant|>{{ meta }} \n{{ content }}"
    "{%- elif role == 'observation' %}<|observation|>\n{{ content }}{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MODELS = {
    "command-r": (COMMAND_R_NAMED, "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>",
                  ["<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", _TURN, "<|SYSTEM_TOKEN|>",
                   "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>"]),
    "glm4": (GLM4, None, "<|endoftext|>",
             ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
              "<|endoftext|>"]),
}


def _model_dir(tmp_path: Path, name: str) -> Path:
    template, bos, eos, specials = MODELS[name]
    make_tiny_tokenizer_dir(tmp_path)
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(bos_token=bos, eos_token=eos, chat_template=template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
def test_text_and_ids_equal_apply_chat_template(tmp_path, name, add_generation_prompt):
    model_dir = _model_dir(tmp_path, name)
    ref = AutoTokenizer.from_pretrained(model_dir)
    template, tokenizer = load_chat_template(model_dir), Tokenizer.from_dir(model_dir)
    for conv in CONVERSATIONS:
        want = ref.apply_chat_template(conv, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
        assert template.render(conv, add_generation_prompt) == want
        assert want.startswith("<BOS_TOKEN>" if name == "command-r" else "[gMASK]<sop>")
        want_ids = ref.apply_chat_template(conv, tokenize=True, return_dict=False,
                                           add_generation_prompt=add_generation_prompt)
        assert encode_chat(tokenizer, template, conv,
                           add_generation_prompt=add_generation_prompt) == list(want_ids)


def test_command_r_takes_its_default_template_and_checks_roles(tmp_path):
    model_dir = _model_dir(tmp_path, "command-r")
    text = load_chat_template(model_dir).render(CONVERSATIONS[1], True)
    assert text.startswith(f"<BOS_TOKEN>{_TURN}<|SYSTEM_TOKEN|>  Be brief.  <|END_OF_TURN_TOKEN|>"
                           f"{_TURN}<|USER_TOKEN|>Hi 🙂<|END_OF_TURN_TOKEN|>")
    assert text.endswith(f"{_TURN}<|CHATBOT_TOKEN|>")
    conv = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ParamError, match="Conversation roles must alternate"):
        encode_chat(Tokenizer.from_dir(model_dir), load_chat_template(model_dir), conv)


def test_glm4_gathers_system_messages_first(tmp_path):
    text = load_chat_template(_model_dir(tmp_path, "glm4")).render(CONVERSATIONS[1], True)
    assert text.startswith("[gMASK]<sop><|system|>\n  Be brief.  <|user|>\nHi 🙂<|assistant|>\n")
    assert text.endswith("<|user|>\nhéllo wörld, 你好<|assistant|>")


def test_command_r_with_tools_takes_its_tool_use_template(tmp_path):
    model_dir = _model_dir(tmp_path, "command-r")
    ref = AutoTokenizer.from_pretrained(model_dir)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    template = load_chat_template(model_dir)
    for conv in CONVERSATIONS:
        want = ref.apply_chat_template(conv, tools=tools, tokenize=False,
                                       add_generation_prompt=True)
        assert template.render(conv, True, tools=tools) == want
        assert want.startswith('<BOS_TOKEN>TOOLS [{"type": "function"')
    assert template.render(CONVERSATIONS[0], True, tools=None).startswith(f"<BOS_TOKEN>{_TURN}")
