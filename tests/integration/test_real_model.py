"""The real default model (SmolLM2-135M-Instruct, 135M parameters, fp32 on CPU), in process:
chat-templated greedy tokens equal transformers' generate on the same weights; the GGUF file and
the directory converted from it give the same weights, tokens and logprobs; the tokenizer and the
template built from the GGUF equal transformers' own GGUF reading."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from deltaserve.default_model import default_gguf_path
from deltaserve.llm import LLM
from engine_common.text.chat_template import load_chat_template
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from engine_common.text.tokenizer import Tokenizer
from kernels.attention.torch_ref import TorchAttentionBackend
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy
from tests.support.real_model import (CHATS, FRANCE, FRANCE_ANSWER, FRANCE_ANSWER_IDS,
                                      hf_chat_ids)
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group

pytestmark = [pytest.mark.slow,     # compares the loaded parameters: keep them
              pytest.mark.usefixtures("keep_dense_weights")]
MAX_NEW = 24


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, dtype="float32", num_kv_blocks=64)


def test_chat_prompts_equal_apply_chat_template(llm, default_model):
    for chat in CHATS:
        assert llm.tokenizer.encode(llm.chat_template.render(chat),
                                    add_special_tokens=False) == hf_chat_ids(default_model, chat)


def test_chat_greedy_tokens_equal_transformers(llm, default_model):
    outs = llm.chat(CHATS, SamplingParams(), StoppingParams(max_tokens=MAX_NEW, ignore_eos=True))
    near_ties, failures = [], []
    for i, (chat, out) in enumerate(zip(CHATS, outs)):
        prompt = tuple(hf_chat_ids(default_model, chat))
        assert out.prompt_token_ids == list(prompt)
        failure = compare_greedy(f"chat{i}", out.token_ids,
                                 hf_greedy(default_model, prompt, MAX_NEW), near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)


def test_the_answer_names_paris_and_stops_at_im_end(llm):
    out = llm.chat(FRANCE, stopping=StoppingParams(max_tokens=32))[0]
    assert out.token_ids == FRANCE_ANSWER_IDS and out.text == FRANCE_ANSWER
    assert out.stop_reason == 2                          # <|im_end|>, from generation_config


def test_gguf_file_and_converted_directory_give_the_same_weights(default_model):
    def state(path):
        return load_model(path, single_rank_group(), TorchAttentionBackend(), "cpu").state_dict()

    a, b = state(default_gguf_path()), state(default_model)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_gguf_file_and_converted_directory_give_the_same_tokens_and_logprobs(default_model):
    """Fresh engines on both, so the same steps run (no prefix-cache hits on one side only):
    the logprobs are then bit-identical."""
    stopping = StoppingParams(max_tokens=16, ignore_eos=True)
    a, b = (LLM(path, dtype="float32", num_kv_blocks=64).chat(
        CHATS[:2], SamplingParams(), stopping, num_logprobs=5)
        for path in (str(default_gguf_path()), default_model))
    for x, y in zip(a, b):
        assert x.prompt_token_ids == y.prompt_token_ids and x.token_ids == y.token_ids
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx == ly


def test_tokenizer_and_template_equal_transformers_gguf_reading(default_model):
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    ref = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    texts = ["Hello world!", "In 2024, 12345 people paid $3.50.", "naïve café 你好 🙂\n\n  x",
             "<|im_start|>user\nhi<|im_end|>\n"]
    for source in (gguf, Path(default_model)):
        ours = Tokenizer.from_dir(source)
        for text in texts:
            assert ours.encode(text) == ref(text)["input_ids"], (source, text)
        template = load_chat_template(source)
        for chat in CHATS:
            assert template.render(chat) == ref.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True)
    assert np.array_equal(Tokenizer.from_dir(gguf).encode("Hello world!"), [19556, 905, 17])


def test_chat_takes_openai_content_parts_as_vllm_does(llm, default_model):
    """OpenAI's content parts are joined into one string, as vLLM hands a string template; the
    template failed on the list with a TypeError before."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    out = llm.chat(parts, stopping=StoppingParams(max_tokens=2))[0]
    assert out.prompt_token_ids == hf_chat_ids(default_model, joined)


@pytest.mark.parametrize("messages, match", [
    ("What is the capital of France?", r"messages='What is the capital of France\?' is invalid"),
    ([{"content": "hi"}], r"messages\[0\]=\{'content': 'hi'\} is invalid: must be a "
                          r"ChatMessage or a dict with a string 'role'"),
    ([FRANCE, [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]],
     r"messages\[1\]\[0\]\['content'\]\[0\]=.* is invalid: must be a text part"),
])
def test_chat_refuses_what_is_no_conversation_by_name(llm, messages, match):
    with pytest.raises(ParamError, match=match):
        llm.chat(messages)
    assert not llm.scheduler.has_unfinished_requests()
