"""engine_common.request.classify: vLLM's activation rules for classify and score, the labels,
pair codes and the score inputs' shapes."""
from __future__ import annotations

import math

import pytest

from engine_common.request.classify import (IDENTITY, SIGMOID, SOFTMAX, ClassifierInfo,
                                            activate, pair_code, score_pairs,
                                            uses_token_types)
from engine_common.request.params import ParamError
from engine_common.request.pooling import PoolerConfigError, pair_start

SIG = "torch.nn.modules.activation.Sigmoid"


@pytest.mark.parametrize("config, classify, score", [
    ({}, SOFTMAX, SOFTMAX),                                   # transformers' default 2 labels
    ({"num_labels": 1}, SIGMOID, SIGMOID),
    ({"id2label": {"0": "yes", "1": "no", "2": "maybe"}}, SOFTMAX, SOFTMAX),
    ({"num_labels": 1, "problem_type": "regression"}, IDENTITY, SIGMOID),
    ({"num_labels": 4, "problem_type": "multi_label_classification"}, SIGMOID, SOFTMAX),
    ({"num_labels": 1, "sbert_ce_default_activation_function":
      "torch.nn.modules.linear.Identity"}, SIGMOID, IDENTITY),
    ({"num_labels": 1, "sentence_transformers": {"activation_fn": SIG}}, SIGMOID, SIGMOID),
])
def test_activations_follow_vllm(config, classify, score):
    info = ClassifierInfo.from_config(config)
    assert (info.classify_activation, info.score_activation) == (classify, score)


def test_labels_from_id2label_else_generic():
    info = ClassifierInfo.from_config({"id2label": {"0": "neg", "1": "pos"}})
    assert info.labels == ("neg", "pos") and info.num_labels == 2
    assert ClassifierInfo.from_config({"num_labels": 3}).labels == ("LABEL_0", "LABEL_1",
                                                                    "LABEL_2")


@pytest.mark.parametrize("config, says", [
    ({"num_labels": 0}, "num_labels=0"),
    ({"sbert_ce_default_activation_function": "os.system"}, "'os.system' is not supported"),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, "Tanh"),
])
def test_bad_configs_are_refused_by_name(config, says):
    with pytest.raises(PoolerConfigError, match=says):
        ClassifierInfo.from_config(config)


def test_activate():
    assert activate([1.0, 2.0], IDENTITY) == [1.0, 2.0]
    assert activate([0.0, -800.0, 800.0], SIGMOID) == [0.5, 0.0, 1.0]   # no overflow
    probs = activate([1000.0, 1001.0], SOFTMAX)
    assert math.isclose(sum(probs), 1.0) and math.isclose(probs[1], 1 / (1 + math.exp(-1)))


def test_pair_codes():
    assert pair_start(pair_code(24, [0, 0, 0, 1, 1], True)) == 3
    assert pair_code(24, [0, 0, 0, 1, 1], False) == 24        # no token types: ids only
    assert pair_code(24, [0, 0, 0], True) == 24
    with pytest.raises(ParamError, match="token_type_ids.*0...0 1...1"):
        pair_code(24, [0, 1, 0, 1], True)
    assert uses_token_types({"architectures": ["BertForSequenceClassification"]})
    assert not uses_token_types({"architectures": ["XLMRobertaForSequenceClassification"],
                                 "type_vocab_size": 1})
    assert not uses_token_types({"architectures": ["Qwen3ForSequenceClassification"]})


def test_score_pairs_shapes():
    assert score_pairs("q", "d") == [("q", "d")]
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    with pytest.raises(ParamError, match="documents='3 texts'.*1 or 2"):
        score_pairs(["q", "r"], ["a", "b", "c"], ("query", "documents"))
    with pytest.raises(ParamError, match="text_2.*at least one"):
        score_pairs("q", [])
    with pytest.raises(ParamError, match="text_1=.*a text or a list"):
        score_pairs([3], "d")
