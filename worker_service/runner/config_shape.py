"""What config.json says about a model's shapes, read the way its class builds them: the
registered class, the head size, the sparse-MLP fields. For the estimates made before a model
is built (memory_fit.py, lora_memory.py)."""
from __future__ import annotations

from worker_service.models.registry import MODEL_REGISTRY


def model_class(hf_config: dict):
    return MODEL_REGISTRY.get((hf_config.get("architectures") or [None])[0])


def head_dim(hf_config: dict) -> int:
    """config.json's head_dim, else the architecture's default (Gemma: 256, as the model builds
    it), else hidden_size / num_attention_heads."""
    default = getattr(model_class(hf_config), "default_head_dim", None)
    return int(hf_config.get("head_dim") or default
               or int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"]))


def moe_args(hf_config: dict):
    """The sparse-MLP fields (models/qwen_moe.MoeArgs) of an MoE config, None for a dense one;
    an architecture with its own reading (DeepSeek) gives them itself."""
    from worker_service.models.qwen_moe import MoeArgs

    own = getattr(model_class(hf_config), "moe_args", None)
    return own(hf_config) if own is not None else MoeArgs.of_config(hf_config)
