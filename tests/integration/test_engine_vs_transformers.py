"""The in-process engine's greedy tokens equal transformers' generate() on the same weights (fp32).

Each scenario submits all prompts together, then checks every request token for token, and that
no KV block leaked. Divergences on steps where transformers' own top-2 margin is below 1e-5 are
printed by name (a near tie, not a bug); any other divergence fails.
"""
from __future__ import annotations


import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import hf_greedy
from tests.support.engine_checks import MODELS, _check, _prompts, _shared_prefix_prompts
from tests.support.vllm_text import VllmTextModel











@pytest.mark.parametrize("arch", MODELS)
def test_greedy_matches_transformers(tiny_models, arch):
    model = tiny_models(arch)
    llm = LLM(model, dtype="float32", num_kv_blocks=256)
    _check(llm, model, _prompts(llm.model_info.vocab_size), f"{arch}/plain")


@pytest.mark.parametrize("arch", MODELS)
def test_chunked_prefill_matches_transformers(tiny_models, arch):
    model = tiny_models(arch)
    # A budget of 24 tokens per step is smaller than most prompts: they prefill in chunks.
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, model, _prompts(llm.model_info.vocab_size), f"{arch}/chunked")


@pytest.mark.parametrize("arch", MODELS)
def test_prefix_cache_hits_match_transformers(tiny_models, arch):
    model = tiny_models(arch)
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_seqs=4)
    prompts = _shared_prefix_prompts(llm.model_info.vocab_size)
    outs = _check(llm, model, prompts, f"{arch}/prefix")
    assert outs[-2].num_cached_tokens > 0 and outs[-1].num_cached_tokens > 0
    assert any(o.num_cached_tokens >= 64 for o in outs[1:4]), [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("arch", MODELS)
def test_preemption_matches_transformers(tiny_models, arch):
    model = tiny_models(arch)
    # 10 blocks of 16 tokens cannot hold the ten requests at once: some are preempted and
    # recomputed from scratch, and must still produce the same tokens.
    llm = LLM(model, dtype="float32", num_kv_blocks=10, enable_prefix_caching=False)
    prompts = _prompts(llm.model_info.vocab_size)
    seen = []
    orig_schedule = llm.scheduler.schedule

    def schedule():
        out = orig_schedule()
        seen.extend(out.preempted_handles)
        return out

    llm.scheduler.schedule = schedule
    _check(llm, model, prompts, f"{arch}/preempt")
    assert seen, "the KV cache was sized to force preemption, but none happened"


def test_text_prompts_and_detokenized_output(tiny_models):
    model = tiny_models("qwen3")
    llm = LLM(model, dtype="float32", num_kv_blocks=64)
    outs = llm.generate(["Hello world", "héllo wörld 你好"], SamplingParams(),
                        StoppingParams(max_tokens=8, ignore_eos=True))
    for out in outs:
        assert len(out.token_ids) == 8
        # vLLM's text (DecodeStream stepped): decode's, less a character left unfinished
        vllm = VllmTextModel(llm.tokenizer, out.prompt_token_ids, [], False)
        vllm.update(out.token_ids, False)
        assert out.text == vllm.text and llm.tokenizer.decode(out.token_ids).startswith(out.text)
        ref = hf_greedy(model, tuple(out.prompt_token_ids), 8)
        assert out.token_ids == list(ref.token_ids)
    assert_no_leaked_blocks(llm)


def test_cpu_kernels_and_fused_greedy_head_match_transformers(tiny_models):
    """On the CPU: the compiled paged attention, the MKL GEMMs and, with a vocabulary wide
    enough to be tiled, the LM head's fused greedy argmax (no logits built)."""
    from kernels.cpu import extension
    if not extension.load():
        pytest.skip(f"deltaserve_cpu not built: {extension.status()}")
    model = tiny_models("llama", vocab_size=9000)
    llm = LLM(model, dtype="float32", num_kv_blocks=128)
    head = llm.runner.model.lm_head.cpu_linear
    assert llm.runner.attention_backend_name == "cpu" and head is not None and head.fuses_greedy
    _check(llm, model, _prompts(512), "llama/cpu-kernels")
    assert head.calls > 0
    assert llm.runner.model.model.layers[0].self_attn.attn.backend.calls > 0


def test_torch_attention_backend_still_matches_transformers(tiny_models):
    model = tiny_models("qwen3")
    llm = LLM(model, dtype="float32", num_kv_blocks=256, attention_backend="torch")
    assert llm.runner.attention_backend_name == "torch"
    _check(llm, model, _prompts(llm.model_info.vocab_size), "qwen3/torch-backend")


@pytest.mark.parametrize("arch", MODELS)
def test_triton_backend_matches_transformers(tiny_models, arch):
    """The Triton kernels under TRITON_INTERPRET=1 on CPU inside the whole engine (on a GPU
    machine tests/test_gpu_engine_bf16.py runs them on CUDA instead)."""
    pytest.importorskip("triton")
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA present: Triton compiles for the GPU, not the CPU interpreter")
    model = tiny_models(arch)
    llm = LLM(model, dtype="float32", num_kv_blocks=64, attention_backend="triton",
              max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.runner.attention_backend_name == "triton"
    vocab = llm.model_info.vocab_size
    prompts = _prompts(vocab)[:3]
    prompts.append(list(prompts[2]))  # a repeat: its first 32 tokens come from the prefix cache
    outs = _check(llm, model, prompts, f"{arch}/triton")
    assert outs[3].num_cached_tokens == 32
