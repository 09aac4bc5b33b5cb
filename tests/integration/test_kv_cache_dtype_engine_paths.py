"""--kv-cache-dtype fp8_e4m3 through the engine's paths that write a block in one step and read
it in another: prefix-cache hits (blocks one request wrote, another reads), preemption and
recompute, chunked prefill across blocks of 16, async scheduling, n-gram speculative decoding
(rejected drafts' rows written, then overwritten), the torch backend's batched groups; and head
sizes 80, 96 and 256 (the torch backend: not a cpu kernel size; another seed, whose margins
are wide enough), MQA. The truth is transformers with its keys and values rounded to the same
fp8 (test_kv_cache_dtype's reference): greedy tokens equal where its top-2 margins exceed
2 x TIGHT (asserted)."""
from __future__ import annotations

import pytest
import torch

from engine_common.request.params import StoppingParams
from tests.unit.worker_service.runner.test_kv_cache_dtype import (PROMPT, TIGHT, _hf_fp8_greedy,
                                                                  _llm)

PROMPTS = [PROMPT, PROMPT + [7, 9, 11], list(range(40, 60))]
STEPS = 10
E4M3 = torch.float8_e4m3fn
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
PATHS = {
    "prefix_hits": dict(enable_prefix_caching=True),
    "preemption": dict(num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=8),
    "async": dict(async_scheduling=True),
    "ngram_spec": dict(speculative_config=NGRAM),
    "torch_batched": dict(attention_backend="torch", max_num_batched_tokens=32),
    "chunks_in_blocks_of_16": dict(block_size=16, max_num_batched_tokens=5),
}
SHAPES = {"head_80": dict(head_dim=80), "head_96": dict(head_dim=96),
          "head_256": dict(head_dim=256, seed=1), "mqa": dict(num_key_value_heads=1)}


def _reference(model: str, monkeypatch) -> list[tuple[int, ...]]:
    refs = [_hf_fp8_greedy(model, p, STEPS, E4M3, monkeypatch) for p in PROMPTS]
    assert min(min(margins) for _, margins in refs) > 2 * TIGHT, refs      # the premise
    return [tokens for tokens, _ in refs]


def _generate(llm) -> list:
    return llm.generate(PROMPTS, None, StoppingParams(max_tokens=STEPS, ignore_eos=True))


@pytest.mark.parametrize("path", list(PATHS))
def test_engine_paths_give_transformers_tokens_on_fp8_keys_and_values(tiny_models, path,
                                                                      monkeypatch):
    model = tiny_models("llama")
    llm = _llm(model, kv_cache_dtype="fp8_e4m3", **PATHS[path])
    preempted = []
    preempt = llm.scheduler._preempt

    def counted(request, plan):
        preempted.append(request.request_id)
        preempt(request, plan)
    llm.scheduler._preempt = counted
    if path == "prefix_hits":      # PROMPT's blocks written by an earlier request
        llm.generate([PROMPT], None, StoppingParams(max_tokens=1, ignore_eos=True))
    outs = _generate(llm)
    assert [tuple(o.token_ids) for o in outs] == _reference(model, monkeypatch)
    if path == "prefix_hits":
        assert outs[0].num_cached_tokens >= 20, outs[0].num_cached_tokens
    if path == "preemption":
        assert preempted, "the three requests should not have fit together"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_head_sizes_and_mqa_give_transformers_tokens(tiny_models, shape, monkeypatch):
    model = tiny_models("llama", **SHAPES[shape])
    llm = _llm(model, kv_cache_dtype="fp8_e4m3")
    want = "torch" if shape == "head_256" else "cpu"
    assert llm.runner.attention_backend_name == want
    assert [tuple(o.token_ids) for o in _generate(llm)] == _reference(model, monkeypatch)
