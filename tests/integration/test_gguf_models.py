"""The in-process engine on quantized GGUF files of the Llama and Qwen families: greedy tokens
equal transformers' generate on the model transformers itself loads from the same file."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.engine_checks import _prompts
from tests.support.hf_reference import NEAR_TIE

MAX_NEW = 10


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.logits]
    return out.sequences[0, len(prompt):].tolist(), margins


@pytest.mark.parametrize("arch, qtype", [("llama", "Q8_0"), ("qwen2", "Q4_0"),
                                         ("llama", "Q4_1")])
def test_greedy_from_a_quantized_gguf_equals_transformers(tiny_ggufs, arch, qtype):
    path = Path(tiny_ggufs(arch, qtype))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    prompts = _prompts(llm.model_info.vocab_size)[:4]
    outs = llm.generate(prompts, SamplingParams(), StoppingParams(max_tokens=MAX_NEW,
                                                                  ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        want, margins = _hf_greedy(model, prompt)
        diverged = next((i for i, (a, b) in enumerate(zip(out.token_ids, want)) if a != b), None)
        assert diverged is None or margins[diverged] < NEAR_TIE, (out.token_ids, want)


def test_llama3_rope_scaling_from_rope_freqs_matches_the_original_model(tiny_models, tiny_ggufs):
    """transformers' GGUF loader ignores rope_freqs.weight; the engine rebuilds the Llama 3.1
    rope scaling from it, so a GGUF of a llama3-rope model generates what the original does."""
    from tests.support.hf_reference import compare_greedy, hf_greedy

    llm = LLM(tiny_ggufs("llama3"), dtype="float32", num_kv_blocks=64)
    prompts = _prompts(llm.model_info.vocab_size)[:4]
    outs = llm.generate(prompts, SamplingParams(), StoppingParams(max_tokens=MAX_NEW,
                                                                  ignore_eos=True))
    near_ties = []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref = hf_greedy(tiny_models("llama"), tuple(prompt), MAX_NEW)
        assert compare_greedy(f"prompt{i}", out.token_ids, ref, near_ties) is None
