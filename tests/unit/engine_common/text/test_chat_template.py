"""Chat templates render exactly as transformers' apply_chat_template: the text and the ids, for
SmolLM2's template and Llama-3- and Qwen3-style templates on tokenizers built here; the sandbox
holds; a model without a template is told so."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoTokenizer

from engine_common.text.chat_template import (ChatMessage, ChatTemplate, ChatTemplateError,
                                         encode_chat, load_chat_template)
from engine_common.model_files.model_dir import ModelDirError
from engine_common.request.params import ParamError
from engine_common.text.tiny_tokenizer import make_tiny_tokenizer_dir
from engine_common.text.tokenizer import Tokenizer

# SmolLM2-135M-Instruct's template (from its GGUF metadata): a default system prompt when the
# first message is not a system message.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

# Llama-3 style: BOS, header tokens, a trimmed system message, a date from strftime_now, roles
# checked with raise_exception.
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%Y") %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Year: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in loop_messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles may follow the system message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen3 style: a namespace updated from a reversed loop (the last real user query), string
# methods (startswith, split, strip), think blocks kept only after the last query, tool results
# grouped into one user turn, an optional enable_thinking switch.
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- set is_tool_result = message.content.startswith('<tool_response>') %}
    {%- if ns.multi_step_tool and message.role == "user" and not is_tool_result %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

EXTRA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<think>", "</think>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "  Be brief.  "},
     {"role": "user", "content": "Hi 🙂"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "héllo wörld, 你好"}],
    [{"role": "user", "content": "Add 2 and 3."},
     {"role": "assistant", "content": "<think>\nsimple\n</think>\n\nIt is 5."},
     {"role": "user", "content": "Times 4?"},
     {"role": "assistant", "content": "<think>\n5 * 4\n</think>\n\n20", "name": None}],
]


def _model_dir(tmp_path: Path, template: str, bos: str, eos: str) -> Path:
    make_tiny_tokenizer_dir(tmp_path)
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in EXTRA_SPECIALS])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(bos_token=bos, eos_token=eos, chat_template=template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


TEMPLATES = {"smollm2": (SMOLLM2, "<|im_start|>", "<|im_end|>"),
             "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
             "qwen3": (QWEN3, "<|endoftext|>", "<|im_end|>")}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_text_and_ids_equal_apply_chat_template(tmp_path, name, add_generation_prompt):
    model = _model_dir(tmp_path, *TEMPLATES[name])
    ref = AutoTokenizer.from_pretrained(model)
    template = load_chat_template(model)
    tokenizer = Tokenizer.from_dir(model)
    for conv in CONVERSATIONS[:2] if name == "llama3" else CONVERSATIONS:
        want_text = ref.apply_chat_template(conv, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)
        assert template.render(conv, add_generation_prompt) == want_text
        want_ids = ref.apply_chat_template(conv, tokenize=True, return_dict=False,
                                           add_generation_prompt=add_generation_prompt)
        assert encode_chat(tokenizer, template, conv,
                           add_generation_prompt=add_generation_prompt) == list(want_ids)


def test_chat_messages_and_dicts_render_alike():
    template = ChatTemplate(SMOLLM2)
    as_dicts = template.render([{"role": "user", "content": "Hi"}])
    assert template.render([ChatMessage("user", "Hi")]) == as_dicts
    assert as_dicts.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_special_tokens_reach_the_template():
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ unk_token is defined }}",
                            {"bos_token": "<s>", "eos_token": "</s>"})
    assert template.render([ChatMessage("user", "x")]) == "<s>|</s>|False"


def test_raise_exception_becomes_a_chat_template_error():
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles"):
        ChatTemplate(LLAMA3).render([ChatMessage("system", "a"), ChatMessage("tool", "b")])


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",          # reach Python internals
    "{% set _ = messages.append(1) %}",                         # mutate the caller's list
    "{% set ns = namespace(_hidden=1) %}",                      # underscore namespace attribute
    "{{ messages[0].update({'role': 'x'}) }}",                   # mutate a message
])
def test_the_sandbox_refuses_unsafe_templates(source):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_tojson_does_not_escape_html():
    out = ChatTemplate("{{ messages[0] | tojson }}").render([ChatMessage("user", "<b>&é")])
    assert out == '{"role": "user", "content": "<b>&é"}'


def test_invalid_jinja_is_refused_when_the_model_loads():
    with pytest.raises(ModelDirError, match="not valid Jinja"):
        ChatTemplate("{% for x in %}")


def test_where_a_directory_keeps_its_template(tmp_path):
    cfg = tmp_path / "tokenizer_config.json"
    assert load_chat_template(tmp_path) is None
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"},
                                                 {"name": "default", "template": "D"}]}))
    assert load_chat_template(tmp_path).source == "D"
    cfg.write_text(json.dumps({"chat_template": "C", "bos_token": {"content": "<s>"}}))
    assert load_chat_template(tmp_path).source == "C"
    assert load_chat_template(tmp_path).special_tokens == {"bos_token": "<s>"}
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path).source == "J"


def test_a_model_without_a_template_refuses_messages(tmp_path):
    make_tiny_tokenizer_dir(tmp_path)
    tokenizer = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ParamError) as err:
        encode_chat(tokenizer, None, [ChatMessage("user", "hi")], "'tiny'")
    assert err.value.field == "messages"
    assert "'tiny' has none (no chat_template.jinja, no chat_template in " \
           "tokenizer_config.json" in str(err.value)
    with pytest.raises(ParamError, match="at least one message"):
        encode_chat(tokenizer, ChatTemplate(SMOLLM2), [])


def test_a_chat_template_file_replaces_the_models(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "model's", "eos_token": "</s>"}))
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ eos_token }}")
    assert load_chat_template(model).render([{"role": "user", "content": "x"}]) == "model's"
    mine = load_chat_template(model, str(override))
    assert mine.render([{"role": "user", "content": "x"}]) == "[x]</s>"
