"""Mixture-of-experts models through the in-process engine with the prefix cache on: requests
sharing a 70-token prefix are served partly from cached KV blocks, and every request's greedy
tokens equal transformers' generate() and the tokens of an engine without the cache, whole and
chunked (16 tokens a step, so cached prefixes meet chunked prefills and decodes in one batch).
"""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.engine_checks import MAX_NEW, _check, _shared_prefix_prompts

MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


def uncached_tokens(model: str, prompts) -> list[list[int]]:
    llm = LLM(model, dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(),
                        StoppingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert all(o.num_cached_tokens == 0 for o in outs)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefix_cache_hits_match_transformers_and_no_cache(tiny_models, arch, chunk):
    model = tiny_models(arch)
    limits = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_seqs=4, block_size=4,
              **limits)
    prompts = _shared_prefix_prompts(llm.model_info.vocab_size)
    # the first request fills the cache; the others share its 70-token prefix
    first = _check(llm, model, prompts[:1], f"{arch}/first")
    rest = _check(llm, model, prompts[1:], f"{arch}/prefix-{chunk}")
    outs = first + rest
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == 0
    assert all(c >= 68 for c in cached[1:4]), cached        # 17 whole blocks of the prefix
    assert cached[-2] > 0 and cached[-1] > 0, cached         # repeated prompts
    assert [o.token_ids for o in outs] == uncached_tokens(model, prompts)
