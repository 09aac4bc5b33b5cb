"""Sequence classification (cross-encoder) models through LLM(runner="pooling").classify / .score,
against transformers' AutoModelForSequenceClassification on the same tiny random weights
(float32, CPU; tests/support/classifier_models.py):

  - BERT (pooler + classifier), XLM-R (RoBERTa's head) and Qwen3 / Qwen2 / Llama (score head on
    the last token) logits equal transformers' within 1e-5, one batch of mixed lengths; an
    encoder's prompts spread over steps (each whole), a decoder's chunked and with prefix hits;
  - the activation is vLLM's: softmax over 2+ labels, sigmoid for one, none for regression,
    sigmoid per label for multi-label, and `activation=False` gives the logits;
  - sentence pairs are tokenized as transformers' tokenizer(text_1, text_2), with BERT's second
    text as token type 1 (the scores differ from an all-type-0 run), 1-to-N and N-to-N;
  - refusals: score on a multi-label model, classify on an embedding model, generate, the
    step budget for an encoder; nothing held after.
"""
from __future__ import annotations

import math

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import ParamError
from scheduler_service.core.admission import RequestRejected
from tests.support.classifier_models import (make_classifier_model, reference_logits,
                                             reference_pairs)
from tests.support.encoder_models import make_encoder_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
           [20]]
QUERY = "what is a KV cache?"
DOCS = ["a store of keys and values for attention.", "the quick brown fox",
        "Hello world, how are you today?"]


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    """(arch, num_labels, overrides) -> a model directory, built once per module."""
    root, made = tmp_path_factory.mktemp("classifiers"), {}

    def get(arch: str, num_labels: int = 3, **overrides) -> str:
        key = (arch, num_labels, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = str(make_classifier_model(root / f"{arch}-{len(made)}", arch,
                                                  num_labels, **overrides))
        return made[key]
    return get


def pooling_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, dtype="float32", max_num_seqs=8, runner="pooling", **kwargs)


def assert_close(got: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), expected, rtol=0, atol=1e-5)


def assert_nothing_held(llm: LLM) -> None:
    assert llm.scheduler.kv.pool.num_free_blocks == llm.scheduler.num_total_blocks
    assert not llm.runner.pooling and not llm.runner.requests


@pytest.mark.parametrize("arch", ["bert", "xlmr", "qwen3", "qwen2", "llama"])
def test_logits_equal_transformers(classifiers, arch):
    model = classifiers(arch)
    llm = pooling_llm(model)
    assert llm.pooler.classify and not llm.pooler.normalize
    outs = llm.classify(PROMPTS)
    refs = reference_logits(model, PROMPTS)
    for out, ref in zip(outs, refs):
        assert_close(out.logits, ref)
        assert_close(out.probs, torch.softmax(ref, -1))          # 3 labels: softmax
        assert out.label_index == int(ref.argmax())
    assert_nothing_held(llm)


@pytest.mark.parametrize("arch, budget", [("bert", 16), ("qwen3", 8)])
def test_spread_over_steps_and_chunked(classifiers, arch, budget):
    """An encoder's prompts each whole in some step; a decoder's chunked by the budget, then
    again with every block but the last a prefix-cache hit (LAST reads the last row only)."""
    model = classifiers(arch)
    llm = pooling_llm(model, max_num_batched_tokens=budget, **(
        {} if arch == "bert" else {"num_kv_blocks": 64, "block_size": 4}))
    refs = reference_logits(model, PROMPTS)
    for _ in range(2):
        for out, ref in zip(llm.classify(PROMPTS), refs):
            assert_close(out.logits, ref)
    assert (llm.scheduler.kv.stats.hits > 0) == (arch == "qwen3")
    assert_nothing_held(llm)


@pytest.mark.parametrize("overrides, activation", [
    ({}, lambda x: torch.sigmoid(x)),                           # one label: sigmoid
    ({"problem_type": "regression"}, lambda x: x),
])
def test_one_label_activations(classifiers, overrides, activation):
    model = classifiers("bert", 1, **overrides)
    outs = pooling_llm(model).classify(PROMPTS)
    for out, ref in zip(outs, reference_logits(model, PROMPTS)):
        assert_close(out.probs, activation(ref))


def test_multi_label_is_a_sigmoid_per_label_and_activation_false_is_raw(classifiers):
    model = classifiers("xlmr", 3, problem_type="multi_label_classification")
    llm = pooling_llm(model)
    refs = reference_logits(model, PROMPTS)
    for out, ref in zip(llm.classify(PROMPTS), refs):
        assert_close(out.probs, torch.sigmoid(ref))
    for out, ref in zip(llm.classify(PROMPTS, activation=False), refs):
        assert_close(out.probs, ref)


def test_bert_pairs_carry_token_types(classifiers):
    """1-to-N and N-to-N pairs: transformers' pair ids, the second text as type 1; a score
    computed with every type 0 differs, so the types reached the model."""
    model = classifiers("bert", 1)
    llm = pooling_llm(model)
    pairs = [(QUERY, d) for d in DOCS]
    ids, types = reference_pairs(model, pairs)
    assert any(1 in t for t in types)
    refs = reference_logits(model, ids, types)
    outs = llm.score(QUERY, DOCS)
    assert [o.prompt_token_ids for o in outs] == ids
    for out, ref in zip(outs, refs):
        assert math.isclose(out.score, torch.sigmoid(ref)[0].item(), abs_tol=1e-5)
    typeless = reference_logits(model, ids)
    assert all(abs(a.item() - b.item()) > 1e-3 for a, b in zip(refs, typeless))
    zipped = llm.score([QUERY, DOCS[0]], [DOCS[1], DOCS[2]], activation=False)
    ids2, types2 = reference_pairs(model, [(QUERY, DOCS[1]), (DOCS[0], DOCS[2])])
    for out, ref in zip(zipped, reference_logits(model, ids2, types2)):
        assert math.isclose(out.score, ref[0].item(), abs_tol=1e-5)
    assert_nothing_held(llm)


@pytest.mark.parametrize("arch", ["xlmr", "qwen3"])
def test_pairs_without_token_types(classifiers, arch):
    model = classifiers(arch, 1)
    pairs = [(QUERY, d) for d in DOCS]
    ids, _ = reference_pairs(model, pairs)
    outs = pooling_llm(model).score(QUERY, DOCS)
    assert [o.prompt_token_ids for o in outs] == ids
    for out, ref in zip(outs, reference_logits(model, ids)):
        assert math.isclose(out.score, torch.sigmoid(ref)[0].item(), abs_tol=1e-5)


def test_refusals(classifiers, tmp_path):
    model = classifiers("bert", 3)
    with pytest.raises(ValueError, match="BertForSequenceClassification is a classification"):
        LLM(model, dtype="float32")
    llm = pooling_llm(model, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="num_labels=1.*has 3"):
        llm.score(QUERY, DOCS)
    with pytest.raises(ParamError, match="text_2='3 texts'.*1 or 2"):
        pooling_llm(classifiers("bert", 1)).score([QUERY, QUERY], DOCS)
    with pytest.raises(RequestRejected, match="max_num_batched_tokens"):
        llm.classify([[5] * 33])
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([[5, 6]])
    assert_nothing_held(llm)
    with pytest.raises(ValueError, match="pooler-config: normalize true"):
        pooling_llm(model, pooler_config={"normalize": True})
    embedder = pooling_llm(str(make_encoder_model(tmp_path / "enc", "bert")))
    with pytest.raises(ValueError, match="classify\\(\\) needs a sequence classification"):
        embedder.classify(PROMPTS)
