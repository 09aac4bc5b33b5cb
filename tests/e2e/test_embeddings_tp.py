"""Embeddings against a real TP=2 layout (one worker service with two rank processes, gloo on
CPU, symmetry verification on): each rank holds the whole hidden state after the last
all-reduce, pools it alike, and the output rank's vectors equal transformers' (LAST normalised
and MEAN, chunked prefills mixed with generation in the same steps); the workers end holding no
request."""
from __future__ import annotations

import torch

from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.request.pooling import (LAST, MEAN, NORMALIZE, POOL_SAMPLING,
                                           POOL_STOPPING)
from scheduler_service.core.request import Request
from tests.integration.test_embeddings import expected_vectors
from tests.support.tp_harness import engine_on, reference

PROMPTS = [list(range(3, 40)), [11, 12, 13], [7, 8, 9, 10] * 9]


def test_tp2_embeddings_match_transformers(tp2, tiny_models):
    model = tiny_models("qwen3")
    eos = ModelInfo.from_dir(model).eos_token_ids
    greedy = ([[5, 17, 99, 42, 7] * 4], [SamplingParams()], [StoppingParams(max_tokens=8,
                                                                            ignore_eos=True)])
    expected_tokens, _ = reference(model, *greedy)
    with engine_on(tp2, model) as core:
        core.add_request(Request("gen", list(greedy[0][0]), greedy[1][0], greedy[2][0], eos))
        for i, prompt in enumerate(PROMPTS):
            for name, code in (("last", LAST | NORMALIZE), ("mean", MEAN)):
                core.add_request(Request(f"{name}{i}", list(prompt), POOL_SAMPLING,
                                         POOL_STOPPING, eos, num_logprobs=None, pooling=code))
        vectors, tokens = {}, []
        for _ in range(500):
            if not core.has_unfinished_requests():
                break
            for out in core.step():
                if out.request_id == "gen":
                    tokens += out.new_token_ids
                elif out.finished:
                    vectors[out.request_id] = out.embedding
    assert tokens == expected_tokens[0]
    for name, pooling, normalize in (("last", "LAST", True), ("mean", "MEAN", False)):
        for i, want in enumerate(expected_vectors(model, PROMPTS, pooling, normalize)):
            torch.testing.assert_close(torch.tensor(vectors[f"{name}{i}"]), want, rtol=0,
                                       atol=1e-5)
