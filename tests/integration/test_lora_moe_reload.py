"""Expert LoRA loaded, unloaded and loaded again at run time (docs/lora.md, "Loading at run
time", "Memory"): the stacks have one slot per held adapter, so unloading id 1 moves id 2's
expert and attention stacks to slot 0, and a smaller adapter loaded into the freed id takes a
slot that held another adapter's experts at a larger rank. Every row of mixed batches (several
adapters and the base model, with --max-cpu-loras 2 evicting and reading adapters again) gives
the greedy tokens of transformers with its own adapter merged, fp32: a slot that kept an old
adapter's experts or ranks, or a row mapped to another's slot, would change them."""
from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM
from tests.support.lora_adapters import check_lora_greedy, make_adapter
from tests.support.moe_lora import per_expert_adapter, reference

MAX_NEW = 8


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    model = tiny_models("qwen3_moe")
    root = tmp_path_factory.mktemp("moe-reload")
    return model, {
        "wide": per_expert_adapter(model, root / "wide", experts={0: list(range(8))},
                                   r=8, alpha=16, seed=21),
        "fused": make_adapter(model, root / "fused", r=4, alpha=16, seed=22,
                              targets=("gate_proj", "up_proj", "down_proj")),
        "narrow": per_expert_adapter(model, root / "narrow", experts={0: [2, 5]}, r=2,
                                     alpha=8, seed=23, projs=(2,), attention=False),
    }


def _check(llm, model, adapters, names, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, llm.model_info.vocab_size) for _ in range(rng.randrange(6, 20))]
               for _ in names]
    check_lora_greedy(llm, prompts, names, MAX_NEW, lambda name, p: reference(
        model, adapters.get(name), p, MAX_NEW)[0])


def test_expert_slots_freed_moved_and_reused(setup):
    model, adapters = setup
    llm = LLM(model, dtype="float32", num_kv_blocks=256, enable_lora=True,
              allow_runtime_lora_updating=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    assert llm.load_lora("wide", adapters["wide"]) == 1
    assert llm.load_lora("fused", adapters["fused"]) == 2
    _check(llm, model, adapters, ["wide", None, "fused", "wide"], 1)
    llm.unload_lora("wide")                      # fused (id 2) moves to slot 0
    assert sorted(llm.runner.lora.adapters) == [1]
    _check(llm, model, adapters, ["fused", None], 2)
    assert llm.load_lora("narrow", adapters["narrow"]) == 1    # the slot wide held, rank 2
    _check(llm, model, adapters, ["narrow", "fused", None, "narrow"], 3)
    assert llm.load_lora("wide", adapters["wide"]) == 3        # evicts the least recently used
    assert len(llm.runner.lora.adapters) == 2
    _check(llm, model, adapters, ["wide", "narrow", None, "fused", "narrow", "wide"], 4)
    assert llm._lora.cache.num_evictions >= 2
