"""LoRA on routed MoE experts in the forms peft writes beyond test_lora_moe_experts.py's two:
prefill logits, fp32, equal transformers + peft's own (unmerged) forward for fused adapters on
one parameter only, other alphas, rslora and user rank / alpha patterns; equal transformers
with the adapter merged for per-expert rslora. And the adapters that must be refused naming
the key or tensor: a pattern peft would also apply to a module (served wrong otherwise), NaN
or infinite weights, fused tensors of another expert count."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.lora_adapters import make_adapter, peft_logits
from tests.support.moe_lora import merged_model, per_expert_adapter
from tests.support.paged_prefill import load, prefill_logits, tp_ids
from worker_service.lora.adapter import LoRAError, read_adapter
from worker_service.lora.families import lora_targets
from worker_service.lora.layers import attach_lora

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
# case -> (arch, target_modules, more LoraConfig fields)
PEFT_FORMS = {
    "down_only": ("qwen3_moe", ("q_proj",), {"target_parameters": ["down_proj"]}),
    "gate_up_only": ("qwen3_moe", ("q_proj",), {"target_parameters": ["gate_up_proj"],
                                                "lora_alpha": 7}),
    "rslora": ("qwen3_moe", GATE_UP_DOWN, {"use_rslora": True}),
    # bare names: peft matches them as `.*\.down_proj`
    "user_patterns": ("qwen3_moe", ("q_proj",), {
        "target_parameters": ["gate_up_proj", "down_proj"], "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {"gate_up_proj": 40}}),
    "shared_expert_left_alone": ("qwen2_moe", ("q_proj",), {
        "target_parameters": ["down_proj"], "alpha_pattern": {".*\\.down_proj": 64}}),
    "mixtral_w2": ("mixtral", ("w2",), {}),
    "mixtral_w1_w3": ("mixtral", ("w1", "w3"), {}),
}


def _ours(model_dir: str, adapter: str) -> torch.Tensor:
    model = load(model_dir)
    state = attach_lora(model, [read_adapter("a", adapter, 16, None, lora_targets(model))])
    ids = tp_ids()
    state.set_token_slots(np.zeros(len(ids), dtype=np.int64))
    return prefill_logits(model, ids)


@pytest.mark.parametrize("case", sorted(PEFT_FORMS))
def test_peft_forms_match_peft(tiny_models, tmp_path, case):
    arch, targets, extra = PEFT_FORMS[case]
    model_dir = tiny_models(arch)
    extra = dict(extra)
    path = make_adapter(model_dir, tmp_path / case, r=4, alpha=extra.pop("lora_alpha", 16),
                        seed=3, targets=targets, **extra)
    want = peft_logits(model_dir, path, tp_ids())
    assert (want - peft_logits(model_dir, None, tp_ids())).abs().max() > 1e-1
    torch.testing.assert_close(_ours(model_dir, path), want, atol=2e-4, rtol=0)


def test_per_expert_rslora_matches_merged(tiny_models, tmp_path):
    """Per-expert modules with use_rslora: scaling lora_alpha / sqrt(r) (vLLM's too)."""
    model_dir = tiny_models("qwen3_moe")
    path = per_expert_adapter(model_dir, tmp_path / "a", experts={0: [0, 1, 2, 3, 4, 5, 6, 7]},
                              r=8, alpha=8, seed=4)
    cfg_file = tmp_path / "a" / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "use_rslora": True}))
    with torch.no_grad():
        want = merged_model(model_dir, path)(input_ids=tp_ids()[None]).logits[0]
    torch.testing.assert_close(_ours(model_dir, path), want, atol=2e-4, rtol=0)


def _with_tensor(src: str, dst, key: str, value: float) -> str:
    d = shutil.copytree(src, dst)
    tensors = load_file(d / "adapter_model.safetensors")
    tensors[key][0, -1] = value
    save_file(tensors, d / "adapter_model.safetensors")
    return str(d)


def test_what_peft_would_serve_otherwise_is_refused(tiny_models, tmp_path):
    q2, q3 = tiny_models("qwen2_moe"), tiny_models("qwen3_moe")
    # alpha_pattern on the experts' down_proj also sets the shared expert's in peft
    shared = make_adapter(q2, tmp_path / "shared", r=4, seed=5, targets=("down_proj",),
                          target_parameters=["down_proj"], alpha_pattern={".*\\.down_proj": 64})
    fused = make_adapter(q3, tmp_path / "fused", r=4, seed=6, targets=GATE_UP_DOWN)
    per = per_expert_adapter(q3, tmp_path / "per", experts={0: [1]}, r=4)
    fused_a = "base_model.model.model.layers.2.mlp.experts.base_layer.lora_A.weight"
    per_b = "base_model.model.model.layers.0.mlp.experts.1.up_proj.lora_B.weight"
    cases = {
        "shared": (q2, shared, r"alpha_pattern=\{'.\*\\\\.down_proj': 64\} is not supported "
                               r"\(peft gives module model.layers.0.mlp.shared_expert.down_proj "
                               r"its value too"),
        "nan": (q3, _with_tensor(fused, tmp_path / "nan", fused_a, float("nan")),
                rf"tensor '{fused_a}' is invalid: it holds NaN or infinite values"),
        "inf": (q3, _with_tensor(per, tmp_path / "inf", per_b, float("-inf")),
                rf"tensor '{per_b}' is invalid: it holds NaN or infinite values"),
    }
    for name, (model_dir, path, reason) in cases.items():
        with pytest.raises(LoRAError, match=rf"LoRA adapter '{name}': {reason}"):
            read_adapter(name, path, 16, None, lora_targets(load(model_dir)))


def test_an_adapter_of_another_expert_count_is_refused(tiny_models, tmp_path):
    """peft's fused tensors for 4 experts on a model of 8: named, with the model's count."""
    four = make_adapter(tiny_models("qwen3_moe", num_experts=4), tmp_path / "four", r=4,
                        seed=9, targets=GATE_UP_DOWN)
    model = load(tiny_models("qwen3_moe"))
    with pytest.raises(LoRAError, match=r"LoRA adapter 'four': module model.layers.0.mlp."
                                        r"experts.base_layer: lora_A \(32, 64\) / lora_B "
                                        r"\(64, 32\) are not 8 experts \(the model's "
                                        r"num_experts\) of rank 8"):
        attach_lora(model, [read_adapter("four", four, 16, None, lora_targets(model))])
