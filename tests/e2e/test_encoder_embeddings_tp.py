"""Encoder embedding models (BertModel, XLMRobertaModel) on a real TP=2 layout (one worker
service, two rank processes, gloo on CPU, symmetry verification on): q/k/v and the intermediate
projection split by columns, the output projections by rows, the embeddings' vocabulary by
rows; the vectors equal TP=1's (LLM.embed in this process) and transformers', with prompts
spread over several steps, each whole in one; the workers end holding no request."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.pooling import POOL_SAMPLING, POOL_STOPPING, model_pooler_config
from scheduler_service.core.request import Request
from tests.support.encoder_models import (MAX_POSITIONS, make_encoder_model, reference_ids,
                                          reference_vectors)
from tests.support.tp_harness import engine_on, scheduler_config

TEXTS = ["Hello world, how are you today?", "the quick brown fox", "KV cache",
         "Embeddings map a sentence to a vector; similar texts lie close together."]


@pytest.mark.parametrize("arch, pooling", [("bert", "MEAN"), ("xlmr", "CLS")])
def test_tp2_vectors_equal_tp1_and_transformers(tp2, tmp_path, arch, pooling):
    model = str(make_encoder_model(tmp_path / arch, arch, pooling))
    prompts = reference_ids(model, TEXTS[:3]) + [[9] * 40, [5 + i % 30 for i in range(48)]]
    code = model_pooler_config(model).code
    eos = ModelInfo.from_dir(model).eos_token_ids
    config = dataclasses.replace(scheduler_config(), max_model_len=MAX_POSITIONS)
    vectors = {}
    with engine_on(tp2, model, config, max_model_len=MAX_POSITIONS) as core:
        for i, p in enumerate(prompts):
            core.add_request(Request(f"r{i}", list(p), POOL_SAMPLING, POOL_STOPPING, eos,
                                     num_logprobs=None, pooling=code))
        for _ in range(100):
            if not core.has_unfinished_requests():
                break
            for out in core.step():
                assert out.new_token_ids == []
                vectors[out.request_id] = out.embedding
    tp2_vectors = [torch.tensor(vectors[f"r{i}"]) for i in range(len(prompts))]
    llm = LLM(model, dtype="float32", runner="pooling", max_num_seqs=16,
              max_num_batched_tokens=48)
    tp1_vectors = [torch.tensor(o.embedding) for o in llm.embed(prompts)]
    for two, one, want in zip(tp2_vectors, tp1_vectors,
                              reference_vectors(model, prompts, pooling, True)):
        torch.testing.assert_close(two, one, rtol=0, atol=1e-5)
        torch.testing.assert_close(two, want, rtol=0, atol=1e-5)
