"""LoRA beyond the Llama family (docs/lora.md, "What is supported"): for each served family, the
in-process LLM's greedy tokens with adapters equal transformers + peft's, fp32, in one mixed
batch of base and adapter rows. Each adapter targets the modules transformers names (Phi-3's
fused qkv_proj / gate_up_proj, StarCoder2's c_fc / c_proj, GLM's gate_up_proj); MoE models
serve attention and dense / shared-expert MLPs, and refuse an adapter of a routed expert by
module name."""
from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy
from tests.support.lora_adapters import make_adapter, peft_greedy
from worker_service.lora.families import ATTENTION, LLAMA

MAX_NEW = 10
# tiny_model arch -> the modules its adapters target (transformers' names)
FAMILIES = {
    "gemma": LLAMA, "gemma2": LLAMA, "gemma3": LLAMA, "granite": LLAMA, "olmo2": LLAMA,
    "smollm3": LLAMA, "cohere": LLAMA, "cohere2": LLAMA,
    "glm": ATTENTION + ("gate_up_proj", "down_proj"),
    "glm4": ATTENTION + ("gate_up_proj", "down_proj"),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "starcoder2": ATTENTION + ("c_fc", "c_proj"),
    # peft (0.21, transformers 5) turns MLP targets of a MoE into target_parameters of the
    # fused experts (refused below): attention only; Qwen2-MoE's shared expert is modules
    "qwen3_moe": ATTENTION,
    "qwen2_moe": LLAMA,
    "mixtral": ATTENTION,
}


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_mixed_batch_matches_peft(tiny_models, tmp_path, arch):
    model = tiny_models(arch)
    targets = FAMILIES[arch]
    adapters = {"a": make_adapter(model, tmp_path / "a", r=8, alpha=32, seed=1,
                                  targets=targets),
                "b": make_adapter(model, tmp_path / "b", r=4, alpha=8, seed=2,
                                  targets=targets[:2], use_rslora=True)}
    mods = " ".join(f"{n}={p}" for n, p in adapters.items())
    llm = LLM(model, dtype="float32", num_kv_blocks=256, enable_lora=True, lora_modules=mods,
              max_loras=2)
    prompts = _prompts(llm.model_info.vocab_size, 6, 0)
    names = [None, "a", "b"] * 2
    outs = llm.generate(prompts, SamplingParams(), StoppingParams(max_tokens=MAX_NEW,
                                                                 ignore_eos=True),
                        lora_request=names)
    near_ties, failures, refs = [], [], {}
    for i, (p, name, out) in enumerate(zip(prompts, names, outs)):
        ref = peft_greedy(model, adapters.get(name), tuple(p), MAX_NEW)
        refs.setdefault(i % 3, set()).add(ref.token_ids)
        failure = compare_greedy(f"{arch}/{name}/prompt{i}", out.token_ids, ref, near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)
    assert_no_leaked_blocks(llm)
    # the adapters change the tokens: one that changed nothing would prove nothing
    first = [peft_greedy(model, adapters.get(n), tuple(prompts[0]), MAX_NEW).token_ids
             for n in (None, "a")]
    assert first[0] != first[1], first
