"""A Score call's pairs tokenized up front and held compactly (request/pair_prompts.py):

  - every pair's prompt equals Tokenizer.encode_pair's (BERT and XLM-R templates, an empty
    second text, `use_pad_token: false` concatenation);
  - a 1-to-N call tokenizes text_1 once (counted on the real tokenizer's backend);
  - a call's pairs past --max-score-tokens together are refused naming text_2, the count and
    the limit, before the rest are tokenized;
  - a bad config.json head_dtype is refused by name where the server and LLM read the
    classifier's config at start (before: only the worker failed, building the model).
"""
from __future__ import annotations

import pytest

from engine_common.request.classify import ClassifierInfo
from engine_common.request.pair_prompts import PairPrompts
from engine_common.request.params import ParamError
from engine_common.text.tokenizer import Tokenizer
from tests.support import encoder_models as enc
from tests.support.tokenizers import CountingBackend

QUERY = "what is a KV cache?"
DOCS = ["keys and values", "a fox", "", "the cache of keys " * 3]


@pytest.fixture(params=["bert", "xlmr"])
def tokenizer(request, tmp_path):
    (enc._bert_tokenizer if request.param == "bert" else enc._xlmr_tokenizer)(tmp_path)
    return Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("config", [{}, {"use_pad_token": False}])
def test_prompts_are_the_tokenizers_pairs(tokenizer, config):
    prompts = PairPrompts(tokenizer, config)
    for doc in DOCS:
        prompts.add(QUERY, doc)
    for i, doc in enumerate(DOCS):
        want = (tokenizer.encode(QUERY + doc), [0] * len(tokenizer.encode(QUERY + doc))) \
            if config else tokenizer.encode_pair(QUERY, doc)
        assert prompts.prompt(i) == want
    assert prompts.num_tokens == sum(len(prompts.prompt(i)[0]) for i in range(len(DOCS)))


def test_one_to_n_tokenizes_text_1_once(tokenizer):
    tokenizer.pair_template()                     # its probe pairs are not the call's
    counting = CountingBackend(tokenizer.backend)
    tokenizer.backend = counting
    prompts = PairPrompts(tokenizer, {})
    for doc in DOCS[:2] + DOCS[3:]:
        prompts.add(QUERY, doc)
    assert counting.texts.count(QUERY) == 1
    assert len(prompts) == 3


def test_a_call_past_the_token_limit_is_refused_by_name(tokenizer):
    one = len(tokenizer.encode_pair(QUERY, DOCS[0])[0])
    prompts = PairPrompts(tokenizer, {}, max_tokens=2 * one)
    prompts.add(QUERY, DOCS[0])
    prompts.add(QUERY, DOCS[0])
    counting = CountingBackend(tokenizer.backend)
    tokenizer.backend = counting
    with pytest.raises(ParamError) as err:
        prompts.add(QUERY, DOCS[0])
    assert err.value.field == "text_2"
    assert f"{3 * one} tokens" in str(err.value) and f"at most {2 * one} tokens" in str(err.value)
    assert len(prompts) == 2 and prompts.num_tokens == 2 * one
    assert counting.texts == [DOCS[0]]            # text_1's ids were kept, not redone


@pytest.mark.parametrize("value", ["float8", "fp32", 16, ["float32"]])
def test_a_bad_head_dtype_is_refused_by_name(value):
    with pytest.raises(ParamError) as err:
        ClassifierInfo.from_config({"num_labels": 1, "head_dtype": value})
    assert err.value.field == "config.json head_dtype"
    assert repr(value) in str(err.value) or str(value) in str(err.value)
    assert "bfloat16" in str(err.value) and '"model"' in str(err.value)


@pytest.mark.parametrize("value", [None, "model", "float32", "BFloat16", "half"])
def test_good_head_dtypes_pass(value):
    ClassifierInfo.from_config({"num_labels": 1, "head_dtype": value})
