"""DeepSeek (models/deepseek.py) through the in-process engine beyond plain greedy runs
(tests/integration/test_deepseek_vs_transformers.py has those):

  - a KV cache too small for the requests together, so they preempt and resume, with chunked
    prefills whose chunks end inside a block (10 tokens a step, blocks of 4) and a shared
    prefix: greedy tokens equal transformers' generate(), prefix hits, no block leaked;
  - n-gram speculative decoding under a structured-output constraint: tokens and logprobs equal
    speculation off, and transformers' greedy under the same grammar;
  - LoRA refused by name (the adapters know the Llama family's projections only);
  - the latent cache's bytes: the runner's kv_block_bytes (what the worker reports at Init and
    the scheduler sizes by) is what the allocated bfloat16 caches take per block, and what the
    memory estimate counts.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.constraints.constraint import Constraint
from engine_common.request.params import SamplingParams, StoppingParams
from tests.integration.test_model_coverage_preemption import prompts
from tests.integration.test_spec_decode import SPEC
from tests.support.engine_checks import _check, assert_no_leaked_blocks
from tests.support.hf_reference import hf_greedy_guided
from worker_service.config import RunnerConfig
from worker_service.layers.mla import MLAAttention
from worker_service.runner.memory_fit import estimate_kv_bytes
from worker_service.runner.model_runner import ModelRunner

BS = 4


@pytest.mark.parametrize("backend", ["torch", "auto"])      # auto: the CPU kernel when built
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_preempted_chunked_requests_match_transformers(tiny_models, arch, backend):
    path = tiny_models(arch, seed=4)
    llm = LLM(path, dtype="float32", attention_backend=backend, block_size=BS,
              num_kv_blocks=20, max_num_seqs=4, max_num_batched_tokens=10)
    # what the runner reports is what its layers attend on
    layers = [m for m in llm.runner.model.modules() if isinstance(m, MLAAttention)]
    assert {m.attn.backend.name for m in layers} == {llm.runner.attention_backend_name}
    sched = llm.scheduler
    preempted = []
    preempt = sched._preempt

    def counted(request, plan):
        preempted.append(request.request_id)
        preempt(request, plan)
    sched._preempt = counted
    outs = _check(llm, path, prompts(llm.model_info.vocab_size), arch, max_new=30)
    assert preempted, "the four requests should not have fit together"
    assert outs[1].num_cached_tokens >= 24 // BS * BS, outs[1].num_cached_tokens


def test_ngram_drafts_under_a_regex_equal_speculation_off_and_transformers(tiny_models):
    path = tiny_models("deepseek_v3")
    regex = Constraint("regex", "(abc|xyz){4}-[0-9]{2}")
    text = "abcxyzabcabc-12 xyzxyzabcxyz-34"
    runs = {}
    for spec in (True, False):
        llm = LLM(path, dtype="float32", num_kv_blocks=128,
                  speculative_config=SPEC if spec else None)
        prompt = llm.tokenizer.encode(text)
        out = llm.generate([prompt, prompt], [SamplingParams()] * 2,
                           StoppingParams(max_tokens=32), constraint=[regex, None],
                           num_logprobs=2)
        runs[spec] = (llm, prompt, out)
    (on, prompt, got), (_, _, want) = runs[True], runs[False]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(g.logprobs, w.logprobs))
    stats = on.scheduler.spec.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    ref = hf_greedy_guided(path, tuple(prompt), 32, on.runner.grammar.compiler.matcher(regex),
                           on.model_info.eos_token_ids)
    assert tuple(got[0].token_ids) == ref
    assert_no_leaked_blocks(on)


def test_kv_block_bytes_are_the_latent_caches_bytes(tiny_models):
    """One latent head (48 + 16) per token and layer, held once, bf16: 3 layers x 4 rows x 64 x 2
    (the cache's value half is its key half: one memory)."""
    path = tiny_models("deepseek_v3")
    config = RunnerConfig(model_dir=path, device="cpu", dtype="bfloat16", num_kv_blocks=6,
                          block_size=BS)
    runner = ModelRunner(config)
    runner.init_kv_cache(6)
    allocated = sum(c.untyped_storage().nbytes() for c in runner.kv_caches)
    assert {c.dtype for c in runner.kv_caches} == {torch.bfloat16}
    assert all(c.shape[0] == 2 and c[0].data_ptr() == c[1].data_ptr() for c in runner.kv_caches)
    assert runner.kv_block_bytes == allocated // 6 == 3 * BS * 64 * 2
    hf_config = json.loads(Path(path, "config.json").read_text())
    assert estimate_kv_bytes(config, hf_config, 2) == allocated
    assert estimate_kv_bytes(config, hf_config, 2, tp_size=2) == allocated   # replicated


def test_lora_is_refused_by_name(tiny_models):
    from worker_service.lora.adapter import LoRAError
    with pytest.raises(LoRAError, match="LoRA is not supported for DeepseekV3ForCausalLM"):
        LLM(tiny_models("deepseek_v3"), dtype="float32", num_kv_blocks=32, enable_lora=True,
            allow_runtime_lora_updating=True)
