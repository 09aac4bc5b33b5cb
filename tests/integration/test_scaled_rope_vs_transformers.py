"""YaRN and dynamic-NTK rope through whole models against transformers, float32 on the CPU, on
the C++ rope (kernels/cpu reads the cos/sin tables, the attention factor folded in) whenever the
library is built: the tests assert it ran.

  - a tiny Qwen3 with YaRN x4 over 64 original positions (the Qwen2.5 / Qwen3 128K recipe in
    small): max_model_len 256; prefill logits of a prompt past the original length equal
    transformers' forward, and the engine's greedy tokens equal generate()'s, chunked and with
    prefix-cache hits, prompts up to 130 tokens;
  - a tiny Llama with dynamic NTK x2 over 160 positions: prompts within 160 whose decoding
    crosses it give generate()'s tokens (transformers then rotates each new token with the
    base of its own length, as our per-position table does).
"""
from __future__ import annotations

import random

import torch

from deltaserve.llm import LLM
from tests.support.cpu_rope_spy import count_cpu_ropes
from tests.support.engine_checks import _check, _prompts
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import load, prefill_logits

YARN = {"max_position_embeddings": 256,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64}}
DYNAMIC = {"max_position_embeddings": 160,
           "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}


def test_yarn_prefill_logits_past_the_original_length_match_transformers(tiny_models):
    path = tiny_models("qwen3", **YARN)
    ours = load(path)
    spy = count_cpu_ropes(ours.model.layers[0].self_attn.rotary_emb)
    ids = torch.arange(100) * 37 % 500 + 3
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(ours, ids), expected, rtol=0, atol=1e-4)
    assert spy is None or spy.calls == len(ours.model.layers), "every layer on the C++ rope"


def test_yarn_greedy_matches_transformers_chunked_and_prefix_hits(tiny_models):
    model = tiny_models("qwen3", **YARN)
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    assert llm.model_info.max_model_len == 256          # 64 original positions times 4
    spy = count_cpu_ropes(llm.runner.model.model.layers[0].self_attn.rotary_emb)
    _check(llm, model, _prompts(llm.model_info.vocab_size), "yarn/chunked")
    _check(llm, model, _prompts(llm.model_info.vocab_size), "yarn/prefix-hits")
    assert llm.scheduler.kv.stats.hits > 0
    assert spy is None or spy.calls > 0, "the engine's steps ran the C++ rope"


def test_dynamic_greedy_matches_transformers_decoding_past_the_length(tiny_models):
    model = tiny_models("llama", **DYNAMIC)
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=48,
              max_num_seqs=8)
    assert llm.model_info.max_model_len == 320          # 160 positions times 2 (vLLM's)
    spy = count_cpu_ropes(llm.runner.model.model.layers[0].self_attn.rotary_emb)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, llm.model_info.vocab_size) for _ in range(n)]
               for n in (150, 40, 157, 121, 9, 145)]
    _check(llm, model, prompts, "dynamic/past-160", max_new=24)
    assert spy is None or spy.calls > 0, "the engine's steps ran the C++ rope"
