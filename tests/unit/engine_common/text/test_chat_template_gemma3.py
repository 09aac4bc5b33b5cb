"""Gemma 3's chat template (google/gemma-3-1b-it, tokenizer_config.json) renders and encodes
exactly as transformers' apply_chat_template: `{{ bos_token }}` written as text and tokenized
to the BOS id without adding special tokens, the system message folded into the first user
turn, `assistant` renamed `model`, content trimmed, roles checked with raise_exception. The
chat path needs nothing Gemma-specific."""
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

GEMMA3 = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n")
SPECIALS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The tiny tokenizer with Gemma's special tokens and template (bos <bos>, eos <eos>)."""
    make_tiny_tokenizer_dir(tmp_path)
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(bos_token="<bos>", eos_token="<eos>", chat_template=GEMMA3)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_text_and_ids_equal_apply_chat_template(model_dir, add_generation_prompt):
    ref = AutoTokenizer.from_pretrained(model_dir)
    template, tokenizer = load_chat_template(model_dir), Tokenizer.from_dir(model_dir)
    bos = tokenizer.bos_token_id
    for conv in CONVERSATIONS:
        want_text = ref.apply_chat_template(conv, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)
        assert template.render(conv, add_generation_prompt) == want_text
        assert want_text.startswith("<bos><start_of_turn>user\n")
        want_ids = ref.apply_chat_template(conv, tokenize=True, return_dict=False,
                                           add_generation_prompt=add_generation_prompt)
        got = encode_chat(tokenizer, template, conv,
                          add_generation_prompt=add_generation_prompt)
        assert got == list(want_ids)
        assert got[0] == bos and got.count(bos) == 1          # one BOS, from the template


def test_system_prompt_joins_the_first_user_turn(model_dir):
    text = load_chat_template(model_dir).render(CONVERSATIONS[1], True)
    assert text.startswith("<bos><start_of_turn>user\n  Be brief.  \n\nHi")
    assert "<start_of_turn>model\nHello! How can I help?<end_of_turn>\n" in text
    assert text.endswith("<start_of_turn>model\n")


def test_roles_that_do_not_alternate_are_the_requests_fault(model_dir):
    conv = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ParamError) as e:
        encode_chat(Tokenizer.from_dir(model_dir), load_chat_template(model_dir), conv)
    assert "Conversation roles must alternate" in str(e.value)
