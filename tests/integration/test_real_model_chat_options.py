"""LLM.chat's vLLM options on the real default model (SmolLM2-135M-Instruct, fp32 on CPU):
add_generation_prompt, continue_final_message, a chat_template of the call, tools and
chat_template_kwargs give the prompt ids transformers' apply_chat_template gives, and the
continued answer is transformers' greedy one. Before, chat() took none of them (TypeError)."""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy
from tests.support.real_model import FRANCE, hf_chat_ids

pytestmark = pytest.mark.slow
PARTIAL = FRANCE + [{"role": "assistant", "content": "The capital of France is"}]
TRAILING = FRANCE + [{"role": "assistant", "content": "The capital of France is "}]
TOOLS = [{"type": "function", "function": {"name": "capital", "parameters": {
    "type": "object", "properties": {"country": {"type": "string"}}}}}]
# A template of the call: every variable it reads, the content trimmed (as many templates do).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}{{ eos_token }}\n"
            "{% endfor %}{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
            "{% if shout %}ANSWER LOUDLY\n{% endif %}{% if add_generation_prompt %}assistant:"
            "{% endif %}")
CASES = {   # name -> (messages, LLM.chat options, apply_chat_template's)
    "no generation prompt": (FRANCE, dict(add_generation_prompt=False),
                             dict(add_generation_prompt=False)),
    "continue": (PARTIAL, dict(add_generation_prompt=False, continue_final_message=True),
                 dict(add_generation_prompt=False, continue_final_message=True)),
    "continue, trailing space": (
        TRAILING, dict(add_generation_prompt=False, continue_final_message=True),
        dict(add_generation_prompt=False, continue_final_message=True)),
    "template, tools, kwargs": (
        FRANCE, dict(chat_template=TEMPLATE, tools=TOOLS, chat_template_kwargs={"shout": True}),
        dict(chat_template=TEMPLATE, tools=TOOLS, shout=True)),
    "template trims, continue": (
        TRAILING, dict(chat_template=TEMPLATE, add_generation_prompt=False,
                       continue_final_message=True),
        dict(chat_template=TEMPLATE, add_generation_prompt=False, continue_final_message=True)),
}


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, dtype="float32", num_kv_blocks=64)


@pytest.mark.parametrize("case", list(CASES))
def test_chat_options_give_apply_chat_templates_prompt(llm, default_model, case):
    messages, ours, theirs = CASES[case]
    out = llm.chat(messages, stopping=StoppingParams(max_tokens=1), **ours)[0]
    assert out.prompt_token_ids == hf_chat_ids(default_model, messages, **theirs)


def test_a_continued_answer_is_transformers_greedy_one(llm, default_model):
    out = llm.chat([PARTIAL, FRANCE], SamplingParams(),
                   StoppingParams(max_tokens=6, ignore_eos=True), add_generation_prompt=False,
                   continue_final_message=True)
    assert out[0].text.startswith(" Paris")
    near_ties = []
    failure = compare_greedy("continued", out[0].token_ids,
                             hf_greedy(default_model, tuple(out[0].prompt_token_ids), 6),
                             near_ties)
    assert_greedy_agrees([failure] if failure else [], near_ties)
    # the second conversation ends with a user message: continuing it is continuing its text
    assert out[1].prompt_token_ids == hf_chat_ids(default_model, FRANCE, False,
                                                  continue_final_message=True)


@pytest.mark.parametrize("options, match", [
    (dict(continue_final_message=True), r"continue_final_message=True is invalid: must be "
                                        r"used with add_generation_prompt=False"),
    (dict(add_generation_prompt="yes"), r"add_generation_prompt='yes' is invalid"),
    (dict(chat_template_kwargs={"messages": []}), r"chat_template_kwargs\['messages'\]=\[\] is "
                                                  r"invalid"),
    (dict(chat_template_kwargs=["shout"]), r"chat_template_kwargs=\['shout'\] is invalid"),
    (dict(tools={"name": "capital"}), r"tools=.* is invalid: must be None or a list of dicts"),
    (dict(chat_template="{% if %}"), r"chat_template=.* is invalid: must be a valid Jinja"),
    (dict(chat_template="{{ messages | length }}", add_generation_prompt=False,
          continue_final_message=True), r"continue_final_message=True is invalid: must be "
                                        r"used with a chat template that writes"),
])
def test_bad_chat_options_are_refused_by_name(llm, options, match):
    with pytest.raises(ParamError, match=match):
        llm.chat(PARTIAL, **options)
    assert not llm.scheduler.has_unfinished_requests()
