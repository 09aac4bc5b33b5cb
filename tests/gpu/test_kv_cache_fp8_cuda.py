"""--kv-cache-dtype fp8 on CUDA: the Triton backend compiled (chosen by `auto` over flash-attn),
plain `fp8` as e4m3 (vLLM on CUDA), the fused rope writing the cache (fused_ops, CUDA's
default) and decode CUDA graphs replaying. The truth is transformers (float32, on the CPU) with
its post-rope keys and values rounded to the same fp8 (tests/unit/worker_service/runner/
test_kv_cache_dtype.py's reference): prompt logprobs within ATOL (two devices' float32 GEMMs,
as test_prompt_logprobs_cuda.py), greedy tokens equal where its top-2 margins exceed 2 x ATOL
(asserted); GPT-OSS's sinks and Mistral's windows against transformers' eager attention on
fp8 keys and values (test_kv_cache_dtype_archs.py). And the kernels alone in bfloat16, head 128, against the torch backend on the same
fp8 cache (test_triton_fp8.py's cases at a serving shape). Marked `gpu`; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import StoppingParams
from tests.gpu.test_engine_bf16 import _count_replays
from tests.unit.worker_service.runner.test_kv_cache_dtype import (
    PROMPT, _hf_fp8_greedy, _hf_fp8_logprobs, _prompt_logprobs)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ATOL = 2e-3
CUDA_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2}


def _llm(model: str, name: str) -> LLM:
    return LLM(model, device="cuda", dtype="float32", kv_cache_dtype=name, num_kv_blocks=64,
               block_size=16, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=8)


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_fp8_cache_on_cuda_gives_transformers_numbers_on_fp8_keys_and_values(
        tiny_models, name, monkeypatch):
    model = tiny_models("llama")
    dtype = CUDA_FP8[name]
    tokens, margins = _hf_fp8_greedy(model, PROMPT, 8, dtype, monkeypatch)
    assert min(margins) > 2 * ATOL, margins
    llm = _llm(model, name)
    try:
        assert llm.runner.attention_backend_name == "triton"
        assert llm.runner.config.fused_ops                 # the rope writes the cache
        assert all(c.dtype == dtype for c in llm.runner.kv_caches)
        got = _prompt_logprobs(llm, PROMPT)                # 24 tokens in chunks of 8
        want = _hf_fp8_logprobs(model, PROMPT, dtype, monkeypatch)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        replays = _count_replays(llm.runner)
        out = llm.generate([PROMPT], None, StoppingParams(max_tokens=8, ignore_eos=True))[0]
        assert tuple(out.token_ids) == tokens
        assert replays[0] > 0, "the decodes should replay a CUDA graph"
    finally:
        llm.close()


@pytest.mark.parametrize("arch,overrides", [("gpt_oss", {}), ("mistral", {"sliding_window": 8})])
def test_sinks_and_windows_on_cuda_give_transformers_numbers(tiny_models, arch, overrides,
                                                            monkeypatch):
    """GPT-OSS (sinks, hybrid pools: no graphs) and an all-windowed Mistral with fp8 = e4m3."""
    from tests.integration.test_kv_cache_dtype_archs import _hf_fp8_prompt_logprobs
    model = tiny_models(arch, **overrides)
    llm = _llm(model, "fp8")
    try:
        assert llm.runner.attention_backend_name == "triton"
        want = _hf_fp8_prompt_logprobs(model, arch, torch.float8_e4m3fn, monkeypatch)
        torch.testing.assert_close(_prompt_logprobs(llm, PROMPT), want, atol=ATOL, rtol=0)
    finally:
        llm.close()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_kernels_in_bfloat16_match_the_torch_backend(dtype, splits):
    from tests.support.attention_cases import check_against_reference, make_case, triton_backend
    mixed = make_case(21, [21, 40, 39, 300, 1], [21, 1, 7, 10, 1], 16, 2, 128, 16, num_pad=3,
                      dtype=torch.bfloat16, cache_dtype=dtype)
    check_against_reference(mixed, triton_backend.TritonAttentionBackend(splits), 2e-2, 2e-2)
    decode = make_case(22, [1, 17, 64, 700, 2049], [1] * 5, 16, 2, 128, 16, num_pad=2,
                       dtype=torch.bfloat16, cache_dtype=dtype)
    check_against_reference(decode, triton_backend.TritonAttentionBackend(splits), 2e-2, 2e-2)
