"""LoRA on routed MoE experts (docs/lora.md, "MoE experts"): the in-process LLM's greedy
tokens and prompt logprobs, fp32, in one batch mixing the base model and two adapters, equal
transformers' with each adapter merged into the weights (W + scale * B @ A). Adapter "fused" is
peft's own over transformers 5 (target_parameters on the fused gate_up_proj / down_proj, with
attention and the dense or shared-expert MLPs); "per_expert" adapts a few experts of some
layers in the per-expert form (Mixtral: w1 / w2 only), so most routed pairs of its tokens
reach experts it leaves alone. TP=2 gives the single rank's logits."""
from __future__ import annotations

import random

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.grpc_harness import free_port
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy
from tests.support.lora_adapters import (lora_prefill_logits, lora_tp_worker, make_adapter)
from tests.support.moe_lora import per_expert_adapter, reference
from worker_service.lora.families import ATTENTION, LLAMA
from worker_service.models.tiny_model import make_tiny_model

MAX_NEW = 8
# logprobs of fp32 models whose adapted logits reach ~20: the base MoE test's logit atol
ATOL = 2e-4
# arch -> (peft's target_modules, extra LoraConfig fields, per-expert {layer: experts}, projs)
CASES = {
    "qwen3_moe": (LLAMA, {}, {0: [1, 3], 2: [0, 5]}, (0, 1, 2)),
    "mixtral": (ATTENTION + ("w1", "w2", "w3"), {}, {0: [2], 1: [0, 3]}, (0, 2)),
    # transformers 5 does not convert Qwen2-MoE's expert targets: peft's target_parameters
    "qwen2_moe": (("q_proj", "gate_proj", "up_proj", "down_proj"),
                  {"target_parameters": ["gate_up_proj", "down_proj"]}, {0: [4]}, (0, 1, 2)),
}


def _adapters(model: str, root, arch: str) -> dict[str, str]:
    targets, extra, experts, projs = CASES[arch]
    return {"fused": make_adapter(model, root / "fused", r=4, alpha=16, seed=1,
                                  targets=targets, **extra),
            "per_expert": per_expert_adapter(model, root / "per_expert", experts=experts,
                                             projs=projs, r=8, alpha=8, seed=2)}


@pytest.mark.parametrize("arch", sorted(CASES))
def test_mixed_batch_matches_merged_transformers(tiny_models, tmp_path, arch):
    model = tiny_models(arch)
    adapters = _adapters(model, tmp_path, arch)
    llm = LLM(model, dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=2,
              lora_modules=" ".join(f"{n}={p}" for n, p in adapters.items()))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, llm.model_info.vocab_size) for _ in range(rng.randrange(5, 30))]
               for _ in range(6)]
    names = [None, "fused", "per_expert"] * 2
    outs = llm.generate(prompts, SamplingParams(), StoppingParams(max_tokens=MAX_NEW,
                                                                 ignore_eos=True),
                        lora_request=names, num_prompt_logprobs=0)
    near_ties, failures, tokens = [], [], {}
    for i, (p, name, out) in enumerate(zip(prompts, names, outs)):
        ref, prompt_lp = reference(model, adapters.get(name), tuple(p), MAX_NEW)
        failure = compare_greedy(f"{arch}/{name}/prompt{i}", out.token_ids, ref, near_ties)
        if failure:
            failures.append(failure)
        got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
        torch.testing.assert_close(got, prompt_lp, atol=ATOL, rtol=0,
                                   msg=lambda m: f"{arch}/{name}/prompt{i}: {m}")
        tokens[name, i % 3] = ref.token_ids
    assert_greedy_agrees(failures, near_ties)
    assert_no_leaked_blocks(llm)
    # each adapter changes the tokens of the same prompts: one that changed nothing proves nothing
    for name in ("fused", "per_expert"):
        first = reference(model, adapters[name], tuple(prompts[0]), MAX_NEW)[0].token_ids
        assert first != tokens[None, 0], name


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_expert_lora_tp2_matches_tp1(tmp_path, arch):
    """Two gloo ranks, each with half of every expert's width and of each adapter's expert
    stacks (gate/up B rows, down A columns), reduced with the base partial sums once."""
    import torch.multiprocessing as mp

    model = str(make_tiny_model(tmp_path / arch, arch=arch))
    adapters = list(_adapters(model, tmp_path, arch).values())
    mp.spawn(lora_tp_worker, args=(free_port(), model, adapters, str(tmp_path)), nprocs=2)
    expected = lora_prefill_logits(model, adapters)
    for rank in range(2):
        got = torch.load(tmp_path / f"lora_logits_{rank}.pt")
        # fp32 sums of the experts' partial products in another order across the ranks:
        # 1.5e-4 seen once (4 of 9,728 logits); an adapter moves logits by ~1
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
