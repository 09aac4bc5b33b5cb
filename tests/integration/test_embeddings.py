"""Embeddings (LLM(runner="pooling").embed) against transformers on the same tiny random weights,
float32 on the CPU: the vector is the final hidden state (transformers' base model's
last_hidden_state, after the last norm) pooled over the prompt (LAST, MEAN or CLS) and
L2-normalised when asked.

  - several prompts of different lengths in one batch, whole and chunked (a token budget smaller
    than a prompt), equal transformers' vectors within 1e-5,
  - the same prompts again hit the prefix cache (LAST) and give the same vectors,
  - MEAN and CLS skip the prefix cache and still equal transformers' after a first run,
  - a sentence-transformers directory's modules.json and 1_Pooling/config.json choose the pooling,
  - no KV block is held once embed() returns; generate() is refused on a pooling LLM and embed()
    on a generating one.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.request.pooling import MEAN, POOL_SAMPLING, POOL_STOPPING
from scheduler_service.core.request import Request
from tests.support.hf_reference import hf_greedy, hf_model

PROMPTS = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], list(range(3, 40)), [42]]


def expected_vectors(model_dir: str, prompts, pooling: str = "LAST", normalize: bool = True):
    """transformers' pooled vectors: the base model's last hidden states over each prompt."""
    base = hf_model(model_dir).model
    out = []
    for p in prompts:
        with torch.no_grad():
            h = base(torch.tensor([p])).last_hidden_state[0].float()
        vec = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling]
        out.append(torch.nn.functional.normalize(vec, dim=-1) if normalize else vec)
    return out


def assert_vectors(got, expected) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert len(g.embedding) == e.shape[0]
        torch.testing.assert_close(torch.tensor(g.embedding), e, rtol=0, atol=1e-5)


def pooling_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=128, max_num_seqs=8,
               runner="pooling", **kwargs)


def assert_no_blocks_held(llm: LLM) -> None:
    kv = llm.scheduler.kv
    assert kv.pool.num_free_blocks == llm.scheduler.num_total_blocks
    assert not llm.runner.pooling and not llm.runner.requests


@pytest.mark.parametrize("budget", [512, 16])
def test_last_pooling_matches_transformers(tiny_models, budget):
    model = tiny_models("qwen3")
    llm = pooling_llm(model, max_num_batched_tokens=budget)
    expected = expected_vectors(model, PROMPTS)
    assert_vectors(llm.embed(PROMPTS), expected)
    assert_no_blocks_held(llm)
    # the same prompts again: whole-block prefix hits, the last position computed again
    hits = llm.scheduler.kv.stats.hits
    assert_vectors(llm.embed(PROMPTS), expected)
    assert llm.scheduler.kv.stats.hits > hits
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_match_transformers(tiny_models, pooling):
    model = tiny_models("llama")
    llm = pooling_llm(model, max_num_batched_tokens=16,
                      pooler_config={"pooling_type": pooling, "normalize": False})
    expected = expected_vectors(model, PROMPTS, pooling, normalize=False)
    assert_vectors(llm.embed(PROMPTS), expected)
    hits = llm.scheduler.kv.stats.hits
    assert_vectors(llm.embed(PROMPTS), expected)      # no prefix hit: every position pooled
    assert llm.scheduler.kv.stats.hits == hits
    assert_no_blocks_held(llm)


def test_text_prompts_and_preemption_pressure(tiny_models):
    """Text prompts are tokenized as generate()'s; a KV cache too small for all prompts at once
    makes them wait and preempt, and every vector still equals transformers'."""
    model = tiny_models("qwen3")
    llm = LLM(model, dtype="float32", num_kv_blocks=8, max_num_seqs=8, block_size=16,
              max_num_batched_tokens=32, runner="pooling",
              pooler_config='{"pooling_type": "MEAN"}')
    prompts = [list(range(3 + i, 40 + i)) for i in range(6)]
    assert_vectors(llm.embed(prompts), expected_vectors(model, prompts, "MEAN"))
    text = llm.embed("hello world")[0]
    ids = llm.tokenizer.encode("hello world")
    assert text.prompt_token_ids == ids
    assert_vectors([text], expected_vectors(model, [ids], "MEAN"))
    assert_no_blocks_held(llm)


def test_sentence_transformers_files_choose_the_pooling(tiny_models, tmp_path):
    model = str(tmp_path / "st")
    shutil.copytree(tiny_models("qwen3"), model)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "st" / "1_Pooling").mkdir()
    (tmp_path / "st" / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
         "pooling_mode_cls_token": False, "pooling_mode_lasttoken": False}))
    (tmp_path / "st" / "modules.json").write_text(json.dumps(modules))
    llm = pooling_llm(model)
    assert (llm.pooler.pooling_type, llm.pooler.normalize) == ("MEAN", False)   # no Normalize
    assert_vectors(llm.embed(PROMPTS[:2]), expected_vectors(model, PROMPTS[:2], "MEAN", False))
    modules.append({"idx": 2, "name": "2", "path": "2_Dense",
                    "type": "sentence_transformers.models.Dense"})
    (tmp_path / "st" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="sentence_transformers.models.Dense"):
        pooling_llm(model)


def test_runner_mismatches_are_refused(tiny_models):
    model = tiny_models("qwen3")
    llm = pooling_llm(model)
    with pytest.raises(ValueError, match="runner='pooling'.*does not generate"):
        llm.generate([[5, 6, 7]])
    generating = LLM(model, dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    with pytest.raises(ValueError, match="embed\\(\\) needs an LLM built with runner='pooling'"):
        generating.embed([[5, 6, 7]])
    with pytest.raises(ValueError, match="runner='pool'"):
        LLM(model, dtype="float32", num_kv_blocks=64, runner="pool")
    with pytest.raises(ValueError, match="pooling_type 'SUM'"):
        pooling_llm(model, pooler_config={"pooling_type": "SUM"})


def test_pooling_requests_preempted_mid_prompt_pool_every_position_once(tiny_models):
    """A generating request that grows preempts pooling requests in the middle of their chunked
    prompts (a KV cache of 6 blocks); recomputed from position 0, MEAN adds no position twice,
    and generation and vectors both equal transformers'."""
    model = tiny_models("qwen3")
    llm = LLM(model, dtype="float32", num_kv_blocks=6, block_size=16, max_num_seqs=8,
              max_num_batched_tokens=16)
    preempted = []
    real = llm.scheduler._preempt
    llm.scheduler._preempt = lambda request, *a, **k: (preempted.append(request.request_id),
                                                       real(request, *a, **k))[1]
    eos = llm.model_info.eos_token_ids
    gen_prompt = [5, 17, 99, 42, 7] * 4
    gen = Request("gen", list(gen_prompt), SamplingParams(temperature=0.0),
                  StoppingParams(max_tokens=60, ignore_eos=True), eos)
    llm.engine.add_request(gen)
    tokens = []
    while gen.num_output_tokens < 26:    # 46 tokens: the next block needed at position 48
        tokens += [t for out in llm.engine.step() for t in out.new_token_ids]
    prompts = [list(range(3 + i, 43 + i)) for i in range(3)]
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(Request(f"p{i}", list(prompt), POOL_SAMPLING, POOL_STOPPING, eos,
                                       num_logprobs=None, pooling=MEAN))
    vectors = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.request_id == "gen":
                tokens += out.new_token_ids
            else:
                vectors[out.request_id] = out
    assert any(rid.startswith("p") for rid in preempted), preempted
    assert tokens == list(hf_greedy(model, tuple(gen_prompt), 60).token_ids)
    assert_vectors([vectors[f"p{i}"] for i in range(3)],
                   expected_vectors(model, prompts, "MEAN", normalize=False))
