"""Classification models on a real TP=2 layout (one worker service, two rank processes, gloo on
CPU, symmetry verification on): BERT sentence pairs (token type 1 on the second text, from
the pooling code) and a Qwen3 score head; the replicated heads give every rank the same
logits, equal to transformers'; the workers end holding no request."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.classify import pair_code
from engine_common.request.pooling import POOL_SAMPLING, POOL_STOPPING, model_pooler_config
from scheduler_service.core.request import Request
from tests.support.classifier_models import (make_classifier_model, reference_logits,
                                             reference_pairs)
from tests.support.encoder_models import MAX_POSITIONS
from tests.support.tp_harness import engine_on, scheduler_config

PAIRS = [("what is a KV cache?", "a store of keys and values"), ("hello world", "the sky"),
         ("the quick brown fox", "jumps over the lazy dog")]


@pytest.mark.parametrize("arch", ["bert", "qwen3"])
def test_tp2_logits_equal_transformers(tp2, tmp_path, arch):
    model = str(make_classifier_model(tmp_path / arch, arch, 2))
    ids, types = reference_pairs(model, PAIRS)
    base = model_pooler_config(model).code
    codes = [pair_code(base, t, arch == "bert") for t in types]
    assert (codes != [base] * 3) == (arch == "bert")
    eos = ModelInfo.from_dir(model).eos_token_ids
    config = dataclasses.replace(scheduler_config(), max_model_len=MAX_POSITIONS)
    logits = {}
    with engine_on(tp2, model, config, max_model_len=MAX_POSITIONS) as core:
        for i, (p, code) in enumerate(zip(ids, codes)):
            core.add_request(Request(f"r{i}", list(p), POOL_SAMPLING, POOL_STOPPING, eos,
                                     num_logprobs=None, pooling=code))
        for _ in range(100):
            if not core.has_unfinished_requests():
                break
            for out in core.step():
                logits[out.request_id] = out.embedding
    refs = reference_logits(model, ids, types if arch == "bert" else None)
    for i, want in enumerate(refs):
        torch.testing.assert_close(torch.tensor(logits[f"r{i}"]), want, rtol=0, atol=1e-5)
