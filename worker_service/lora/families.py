"""Which model classes serve LoRA, and which modules an adapter may target on each
(docs/lora.md, "What is supported").

Targets are the module names transformers gives the projections (what peft's target_modules
and the adapter's tensor names say): Phi-3's checkpoint holds q/k/v as one `qkv_proj` and
gate/up as one `gate_up_proj`, GLM's gate/up as one `gate_up_proj`, StarCoder2's MLP is
`c_fc` / `c_proj`. A fused target's lora_B is cut by rows, and q/k rows reordered, by the
model's own split_checkpoint_tensor (layers.py), exactly as its base weight was at load.

MoE models serve the attention projections, their dense MLPs (Qwen MoE's mlp_only_layers,
Qwen2-MoE's shared expert) and the routed experts (expert_weights.py: per-expert modules, or
peft's target_parameters on the fused expert parameters). MLA models (DeepSeek V2/V3) and
GPT-OSS are not served.
"""
from __future__ import annotations

from types import MappingProxyType

from torch import nn

from worker_service.lora.adapter import LoRAError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")
LLAMA = ATTENTION + GATED_MLP

# model class -> the module names (transformers') an adapter may target
LORA_TARGETS = MappingProxyType({
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": LLAMA,
    "GemmaForCausalLM": LLAMA,
    "Gemma2ForCausalLM": LLAMA,
    "Gemma3ForCausalLM": LLAMA,
    "GraniteForCausalLM": LLAMA,
    "Olmo2ForCausalLM": LLAMA,
    "SmolLM3ForCausalLM": LLAMA,
    "CohereForCausalLM": LLAMA,
    "Cohere2ForCausalLM": LLAMA,
    "GlmForCausalLM": ATTENTION + ("gate_up_proj", "down_proj"),
    "Glm4ForCausalLM": ATTENTION + ("gate_up_proj", "down_proj"),
    "Phi3ForCausalLM": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "Starcoder2ForCausalLM": ATTENTION + ("c_fc", "c_proj"),
    # attention, dense layers' MLPs, the shared expert and the routed experts
    "Qwen3MoeForCausalLM": LLAMA,
    "Qwen2MoeForCausalLM": LLAMA,
    "MixtralForCausalLM": ATTENTION + ("w1", "w2", "w3"),
})


def lora_targets(model: nn.Module) -> tuple[str, ...]:
    """The module names an adapter of `model` may target; LoRAError naming the model class
    and the served classes when LoRA is not served on it."""
    name = type(model).__name__
    if name not in LORA_TARGETS:
        raise LoRAError(f"LoRA is not supported for {name}: must be one of "
                        f"{sorted(LORA_TARGETS)}")
    return LORA_TARGETS[name]

