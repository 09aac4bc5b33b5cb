"""A classifier's head runs in float32 on a bfloat16 model, as vLLM's pooling models do
(ModelConfig.head_dtype: float32 unless config.json says `"head_dtype": "model"`): the pooled
row is cast up and every head layer (BERT's pooler and classifier, RoBERTa's dense and
out_proj, a decoder's score) computes in float32 from the checkpoint's weights. Before, the
head ran in bfloat16: its logits were off by ~1e-2, enough to reorder close rerank scores.
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from deltaserve.llm import LLM
from tests.support.classifier_models import make_classifier_model


def _reference_head(model_dir: str, arch: str):
    """transformers' head (float32) as a function of the pooled row."""
    ref = tf.AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                                dtype=torch.float32).eval()
    if arch == "bert":
        return lambda x: ref.classifier(torch.tanh(ref.bert.pooler.dense(x)))
    if arch == "xlmr":
        return lambda x: ref.classifier.out_proj(torch.tanh(ref.classifier.dense(x)))
    return ref.score


@pytest.mark.parametrize("arch", ["bert", "xlmr", "qwen3"])
def test_the_head_computes_in_float32(tmp_path, arch):
    model_dir = str(make_classifier_model(tmp_path / arch, arch, 3))
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=4, runner="pooling")
    try:
        model = llm.runner.model
        pooled = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
        with torch.no_grad():
            got = model.classify(pooled)
            want = _reference_head(model_dir, arch)(pooled.float())
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert llm.classify([[5, 6, 7, 8]])[0].probs       # the whole path still serves
    finally:
        llm.close()


def test_config_head_dtype_model_keeps_the_model_dtype(tmp_path):
    model_dir = str(make_classifier_model(tmp_path / "bert", "bert", 1, head_dtype="model"))
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=4, runner="pooling")
    try:
        assert llm.runner.model.classifier.weight.dtype == torch.bfloat16
    finally:
        llm.close()
