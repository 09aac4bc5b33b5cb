"""--kv-cache-dtype fp8 with the Triton attention backend (its interpreter on the CPU), whole
engine, against transformers on the same weights with its post-rope keys and its values
rounded to the same fp8 (test_kv_cache_dtype's reference): the prompt logprobs within TIGHT
(float32 noise), through prefill chunks of 4 in blocks of 4 (every chunk reads the blocks the
ones before it wrote) and the decodes after, with the backend's own cache write and with the
fused rope writing the cache (fused_ops, as on CUDA by default); and with attention sinks and
sliding windows (GPT-OSS, Mistral, Gemma 3's hybrid pools), which only Triton runs with fp8,
against test_kv_cache_dtype_archs' reference. On the CPU plain `fp8` is e5m2.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from engine_common.request.params import StoppingParams  # noqa: E402
from tests.integration.test_kv_cache_dtype_archs import _hf_fp8_prompt_logprobs  # noqa: E402
from tests.unit.worker_service.runner.test_kv_cache_dtype import (  # noqa: E402
    FP8, PROMPT, TIGHT, _hf_fp8_logprobs, _hf_fp8_greedy, _llm, _prompt_logprobs)

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the Triton kernels "
                       "compile for it (tests/gpu/test_kv_cache_fp8_cuda.py runs there)"),
    pytest.mark.skipif(
        not isinstance(triton.language.zeros,
                       __import__("triton.runtime.interpreter",
                                  fromlist=["InterpretedFunction"]).InterpretedFunction),
        reason="triton was imported in compiled mode without a GPU (TRITON_INTERPRET unset)")]


@pytest.mark.parametrize("name,fused", [("fp8_e4m3", False), ("fp8", True),
                                        pytest.param("fp8_e4m3", True, marks=pytest.mark.slow),
                                        pytest.param("fp8_e5m2", False, marks=pytest.mark.slow)])
def test_triton_fp8_logprobs_match_transformers_on_fp8_keys_and_values(tiny_models, name,
                                                                        fused, monkeypatch):
    model = tiny_models("llama")
    llm = _llm(model, kv_cache_dtype=name, attention_backend="triton", fused_ops=fused)
    assert llm.runner.attention_backend_name == "triton"
    assert all(c.dtype == FP8[name] for c in llm.runner.kv_caches)
    got = _prompt_logprobs(llm, PROMPT)
    want = _hf_fp8_logprobs(model, PROMPT, FP8[name], monkeypatch)
    torch.testing.assert_close(got, want, atol=TIGHT, rtol=0)


def test_triton_fp8_greedy_tokens_match_transformers_on_fp8_keys_and_values(tiny_models,
                                                                            monkeypatch):
    """Decodes (the split-KV kernel) after the chunked prefill, with a prefix-cache hit."""
    model = tiny_models("llama")
    dtype = FP8["fp8_e4m3"]
    tokens, margins = _hf_fp8_greedy(model, PROMPT, 6, dtype, monkeypatch)
    assert min(margins) > 2 * TIGHT, margins             # the premise (test_kv_cache_dtype)
    llm = _llm(model, kv_cache_dtype="fp8_e4m3", attention_backend="triton",
               enable_prefix_caching=True)
    stop = StoppingParams(max_tokens=6, ignore_eos=True)
    first = llm.generate([PROMPT], None, stop)[0]
    again = llm.generate([PROMPT], None, stop)[0]
    assert tuple(first.token_ids) == tokens and tuple(again.token_ids) == tokens
    assert again.num_cached_tokens >= 20, again.num_cached_tokens


@pytest.mark.parametrize("arch,overrides", [
    ("gpt_oss", {}),                               # attention sinks, windowed layers, hybrid
    ("mistral", {"sliding_window": 8}),            # every layer windowed
    pytest.param("gemma3", {}, marks=pytest.mark.slow)])      # hybrid KV pools
def test_triton_fp8_sinks_and_windows_match_transformers(tiny_models, arch, overrides,
                                                         monkeypatch):
    """The layouts torch and cpu refuse with fp8 (test_kv_cache_dtype): Triton applies sinks and
    windows whatever the cache holds. Windows of 8 over the 24-token prompt."""
    model = tiny_models(arch, **overrides)
    llm = _llm(model, kv_cache_dtype="fp8_e4m3", attention_backend="triton")
    assert all(c.dtype == torch.float8_e4m3fn for c in llm.runner.kv_caches)
    want = _hf_fp8_prompt_logprobs(model, arch, torch.float8_e4m3fn, monkeypatch)
    torch.testing.assert_close(_prompt_logprobs(llm, PROMPT), want, atol=TIGHT, rtol=0)
