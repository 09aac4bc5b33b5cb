"""--kv-cache-dtype fp8 on the architectures whose cached keys differ from Llama's: Qwen3 (keys
normalised, then rotated), GLM-4 (partial rotary), SmolLM3 (layers without rope), Gemma (scaled
embeddings: larger keys), Qwen2 (k/v biases), Starcoder2. The truth is transformers' eager
attention with the keys and values it attends (after norms and rope, before repeat_kv) rounded
to the same fp8 type and saturated, as write_kv_cache does: prompt logprobs agree to float32
noise (TIGHT) on both backends that read fp8 caches."""
from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.unit.worker_service.runner.test_kv_cache_dtype import (FP8, PROMPT, TIGHT, _llm,
                                                                  _prompt_logprobs)

ARCHS = ("qwen3", "glm4", "smollm3", "gemma", "qwen2", "starcoder2")


def _hf_fp8_prompt_logprobs(model_dir: str, arch: str, dtype: torch.dtype,
                            monkeypatch) -> torch.Tensor:
    modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    limit = torch.finfo(dtype).max
    original = modeling.eager_attention_forward

    def rounded(x):
        return x.clamp(-limit, limit).to(dtype).to(x.dtype)

    def attend(module, query, key, value, *args, **kwargs):
        return original(module, query, rounded(key), rounded(value), *args, **kwargs)

    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(modeling, "eager_attention_forward", attend)
        logprobs = hf(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    return logprobs[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_are_transformers_on_fp8_keys_and_values(tiny_models, arch, name,
                                                                 backend, monkeypatch):
    model = tiny_models(arch)
    llm = _llm(model, kv_cache_dtype=name, attention_backend=backend)
    assert all(c.dtype == FP8[name] for c in llm.runner.kv_caches)
    want = _hf_fp8_prompt_logprobs(model, arch, FP8[name], monkeypatch)
    torch.testing.assert_close(_prompt_logprobs(llm, PROMPT), want, atol=TIGHT, rtol=0)
